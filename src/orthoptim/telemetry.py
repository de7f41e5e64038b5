"""See what the optimizer did: an opt-in report any training loop can read.

    telemetry = Telemetry(opt, model)
    ...
    loss.backward()
    with telemetry.recording(every_step % 10 == 0):   # a recorded step measures itself
        opt.step()
    if step % 10 == 0:
        report = telemetry.report()        # every rank calls it under a distributed driver

A recorded step measures, per parameter class (`orthoptim.optim.telemetry.CLASSES`), the RMS
of the update (W_after − W_before, weight decay included), of the weight, their ratio, the
effective LR (the group's LR times the optimizer's LR scale, averaged over elements), the
momentum RMS, and the Newton-Schulz residual ‖OOᵀ − I‖_F/√m of one sampled matrix per class
per rank at the run's steps and dtype; and this rank's optimizer time (by `clock`, the
device synchronised around a recorded step on CUDA) and bytes sent. `report()` adds the
classes' sums over every rank (one all-gather of a few dozen floats under a distributed
driver) and gives the busiest and the mean rank's time and bytes. An unrecorded step costs
nothing beyond one attribute read per inner step; a recorded one copies each parameter it
steps, one at a time, to measure its update (the AdamW part's are copied together: the
elementwise optimizer steps them in one call).
"""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from orthoptim import collectives as C
from orthoptim.comm_bytes import CommStats
from orthoptim.optim import telemetry as recorder
from orthoptim.optim.base import GuardedOptimizer, param_names
from orthoptim.optim.telemetry import CLASSES, FIELDS
from orthoptim.parallel.base import DistributedOptimizer

__all__ = ["Telemetry", "comm_totals"]


def comm_totals(optimizer: Any) -> tuple[float, float]:
    """(bytes sent, bytes received) by this rank in `optimizer`'s last step (0 for an
    optimizer that counts none: one process, or a replicated optimizer under DDP)."""
    if not hasattr(optimizer, "comm_stats"):
        return 0.0, 0.0
    stats = optimizer.comm_stats()
    if isinstance(stats, CommStats):
        stats = stats.as_dict()
    total = stats.get("total")
    if total is None:
        total = {
            "sent": sum(v.get("sent", 0.0) for v in stats.values()),
            "received": sum(v.get("received", 0.0) for v in stats.values()),
        }
    return float(total["sent"]), float(total["received"])


class Telemetry:
    """Health telemetry of `optimizer` (an orthoptim optimizer or driver; any other torch
    optimizer is measured from outside, its update only): `recording()` around a step,
    `report()` after it.

    `model` (optional, recommended) names the parameters and their whole shapes: an
    optimizer that does not name its parameters (torch's) is classed by the model's names,
    and the flat shards a driver steps as the matrices they belong to. `clock` times the
    step (inject one in tests). `distributed`: add the ranks' figures with one collective
    in `report()` (default: under a distributed driver with an initialised process group
    of several ranks)."""

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        model: nn.Module | None = None,
        clock: Callable[[], float] = time.perf_counter,
        distributed: bool | None = None,
    ) -> None:
        self.optimizer = optimizer
        self.clock = clock
        named = list(model.named_parameters()) if model is not None else []
        self.ndims = {n: p.ndim for n, p in named}
        self.names = {id(p): n for n, p in named}
        if distributed is None:
            distributed = (
                isinstance(optimizer, DistributedOptimizer)
                and dist.is_initialized()
                and dist.get_world_size() > 1
            )
        self.distributed = distributed
        self.last: tuple[recorder.StepRecord, float, float] | None = None

    def _device(self) -> torch.device | None:
        for group in self.optimizer.param_groups:
            for p in group["params"]:
                return p.device
        return None

    def _sync(self) -> None:
        device = self._device()
        if device is not None and device.type == "cuda":
            torch.cuda.synchronize(device)

    @contextlib.contextmanager
    def recording(self, active: bool = True) -> Iterator[None]:
        """Record the optimizer step taken inside (nothing when `active` is False)."""
        if not active:
            yield
            return
        record = recorder.StepRecord(self.ndims, self.names)
        self._sync()
        start = self.clock()
        with recorder.recording(record):
            if isinstance(self.optimizer, (GuardedOptimizer, DistributedOptimizer)):
                yield
            else:
                with recorder.updates_recorded(record, self.optimizer, param_names(self.optimizer)):
                    yield
        self._sync()
        elapsed = self.clock() - start
        self.last = (record, elapsed, comm_totals(self.optimizer)[0])

    def report(self) -> dict[str, Any]:
        """The last recorded step's figures ({} before any): per class the RMS of the
        update and the weight, their ratio, the effective LR, momentum RMS, Newton-Schulz
        residual (None where not measured) and how many tensors; the busiest and mean
        rank's optimizer time and bytes sent. Collective when `distributed`."""
        if self.last is None and not self.distributed:
            return {}
        record, elapsed, sent = self.last or (recorder.StepRecord(), 0.0, 0.0)
        mine = [*record.values(), elapsed, sent]
        ranks = C.gather_floats(mine) if self.distributed else [mine]
        width = len(CLASSES) * len(FIELDS)
        sums = [sum(r[i] for r in ranks) for i in range(width)]
        times = [r[width] for r in ranks]
        sent_by_rank = [r[width + 1] for r in ranks]
        return {
            "classes": _classes(sums),
            "opt_time_s": {"max": max(times), "mean": sum(times) / len(times)},
            "comm_bytes": {"max": max(sent_by_rank), "mean": sum(sent_by_rank) / len(ranks)},
            "ranks": len(ranks),
        }


def _classes(sums: list[float]) -> dict[str, dict[str, Any]]:
    """Per class with elements: the figures from the summed `FIELDS`."""
    out = {}
    for ci, cls in enumerate(CLASSES):
        f = dict(zip(FIELDS, sums[ci * len(FIELDS) : (ci + 1) * len(FIELDS)]))
        n = f["elements"]
        if n == 0:
            continue
        update, weight = math.sqrt(f["update_sq"] / n), math.sqrt(f["weight_sq"] / n)
        m_n, r_n = f["momentum_elements"], f["residual_count"]
        out[cls] = {
            "update_rms": update,
            "weight_rms": weight,
            "ratio": update / weight if weight > 0 else None,
            "lr": f["lr_elements"] / n,
            "momentum_rms": math.sqrt(f["momentum_sq"] / m_n) if m_n else None,
            "ns_residual": f["residual_sum"] / r_n if r_n else None,
            "tensors": int(f["tensors"]),
        }
    return out
