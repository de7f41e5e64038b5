"""The cost model of the tensor-parallel modes, apart from the runs themselves: what a mode
costs one rank per batch (`TPShape` priced as `TPCost`: bytes sent, collective rounds,
flops), what that takes in seconds (`CostModel`, which `auto` minimises), and what a batch
holds while it runs (`TPBatch` and each mode's transient bytes, which the planner's memory
model adds up).

The table of modes (`tensor_parallel.TP_MODES`) maps each mode to these and to its run.
"""

from __future__ import annotations

import math
import statistics
import time
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

from orthoptim import collectives
from orthoptim.ns_cost import NSForm, iterate_bytes


@dataclass(frozen=True)
class CostModel:
    """Seconds a mode is expected to take: bytes ÷ bandwidth + rounds·latency + flops ÷ throughput.

    `bandwidth` is bytes per second one rank pushes through a collective (ring algorithm),
    `latency` the fixed cost of one collective, `throughput` the matmul flop rate. The
    defaults describe a GPU node with NVLink; `calibrate` measures the actual group.
    """

    bandwidth: float = 100e9
    latency: float = 20e-6
    throughput: float = 100e12

    def __post_init__(self) -> None:
        for name in ("bandwidth", "latency", "throughput"):
            value = getattr(self, name)
            if not (value >= 0.0 and math.isfinite(value)) or (name != "latency" and value == 0):
                raise ValueError(f"CostModel.{name} must be a finite positive number, got {value}")

    def seconds(self, cost: TPCost) -> float:
        """Expected time of a mode whose per-rank cost is `cost`."""
        return (
            cost.bytes_sent / self.bandwidth
            + cost.rounds * self.latency
            + cost.flops / self.throughput
        )

    @classmethod
    def calibrate(
        cls,
        group: ProcessGroup | None = None,
        nbytes: int = 4 << 20,
        matmul_size: int = 512,
        repeats: int = 5,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str | None = None,
    ) -> CostModel:
        """Measure bandwidth, latency and matmul throughput on `group` with a quick probe.

        Every rank of `group` must call it. The slowest rank's figures are used on all ranks
        (a max all-reduce), so every rank's cost model, and hence `auto`'s choice, agrees.
        """
        if repeats < 1:
            raise ValueError(f"repeats must be >= 1, got {repeats}")
        _, n = collectives.world(group)
        dev = collectives.device_for(group, device)
        elem = torch.empty((), dtype=dtype).element_size()

        def timed(fn: Any) -> float:
            fn()
            samples = []
            for _ in range(repeats):
                if dev.type == "cuda":
                    torch.cuda.synchronize(dev)
                t0 = time.perf_counter()
                fn()
                if dev.type == "cuda":
                    torch.cuda.synchronize(dev)
                samples.append(time.perf_counter() - t0)
            return statistics.median(samples)

        big = torch.zeros(max(1, nbytes // elem), dtype=dtype, device=dev)
        tiny = torch.zeros(1, dtype=dtype, device=dev)
        a = torch.randn(matmul_size, matmul_size, dtype=dtype, device=dev)
        t_big = timed(lambda: collectives.all_reduce(big, group=group)) if n > 1 else 0.0
        t_tiny = timed(lambda: collectives.all_reduce(tiny, group=group)) if n > 1 else 0.0
        t_mm = timed(lambda: a @ a)
        times = torch.tensor([t_big, t_tiny, t_mm], dtype=torch.float64, device=dev)
        collectives.all_reduce(times, op=dist.ReduceOp.MAX, group=group)
        t_big, t_tiny, t_mm = times.tolist()
        defaults = cls()
        sent = 2 * (n - 1) / n * big.numel() * elem
        bandwidth = sent / max(t_big - t_tiny, 1e-9) if n > 1 else defaults.bandwidth
        return cls(
            bandwidth=bandwidth,
            latency=max(t_tiny, 0.0) if n > 1 else defaults.latency,
            throughput=2 * matmul_size**3 / max(t_mm, 1e-12),
        )


@dataclass(frozen=True)
class TPCost:
    """Per-rank cost of orthogonalizing one batch: bytes sent, collective rounds, flops."""

    bytes_sent: float
    rounds: int
    flops: float


class TPShape(NamedTuple):
    """A batch a mode is priced for: k global rows×cols matrices split along `shard_dim` (0:
    rows, 1: columns) over `world_size` ranks, `steps` iterations in `element_size`-byte
    elements."""

    k: int
    rows: int
    cols: int
    shard_dim: int
    world_size: int
    steps: int
    element_size: int


@dataclass(frozen=True)
class TPBatch:
    """A batch of k same-shape matrices one rank orthogonalizes, as the memory model sees it:
    its local shards `local` (rows, cols) of the global `full`, split along `shard_dim` (0:
    rows, 1: columns; None: not split), `steps` iterations in `ns_bytes` elements, updates of
    `state_bytes`; `local_form` is the form single-device Newton-Schulz takes on one local
    shard (`ns_cost.ns_path`)."""

    k: int
    local: tuple[int, int]
    full: tuple[int, int]
    shard_dim: int | None
    steps: int
    ns_bytes: int
    state_bytes: int
    local_form: NSForm = "step"


def local_transient(b: TPBatch) -> int:
    """Peak bytes of Newton-Schulz on the local shards alone (blockwise mode, and matrices
    not split): the output in the state dtype and the iteration (`ns_cost.iterate_bytes`)."""
    r, c = b.local
    m = min(r, c)
    x = b.k * r * c
    iterate = iterate_bytes(
        b.local_form, x * b.ns_bytes, b.k * m * m * b.ns_bytes, b.steps, b.ns_bytes == b.state_bytes
    )
    return x * b.state_bytes + iterate


def distributed_transient(b: TPBatch) -> int:
    """Peak bytes of distributed mode: the output copy (two when the split side is the rows:
    the transposed result is made contiguous apart), the last iterate and its p×p Gram in the
    iteration dtype (p the unsplit side), or the iteration itself (the iterate, the Gram, A·W
    and the next iterate)."""
    assert b.shard_dim is not None
    r, c = b.local
    x = b.k * r * c
    p = (r, c)[1 - b.shard_dim]
    gram = b.k * p * p * b.ns_bytes
    copies = 2 if b.shard_dim == 0 else 1
    return max(copies * x * b.state_bytes + x * b.ns_bytes + gram, 3 * x * b.ns_bytes + gram)


def duplicated_transient(b: TPBatch) -> int:
    """Peak bytes of duplicated mode: the local shard and the gathered and concatenated whole
    stack in the iteration dtype with the plain iteration on the whole stack, then the local
    slice of its output."""
    r, c = b.local
    x = b.k * r * c
    m, n = sorted(b.full)
    whole = b.k * m * n * b.ns_bytes
    iterate = iterate_bytes("step", whole, b.k * m * m * b.ns_bytes, b.steps, True)
    return x * b.ns_bytes + 2 * whole + max(iterate, whole + x * b.state_bytes)
