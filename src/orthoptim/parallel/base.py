"""What every distributed driver of orthoptim shares; a driver adds only how its bytes move.

A driver (`LayerwiseDistributedOptimizer`, `FSDPOptimizer`) is a `DistributedOptimizer`: it
exposes the `param_groups` and `state` of the whole-model optimizer `build_optimizer` makes
(so LR schedulers and checkpoints act as on one process) and steps in one fixed order::

    step()  closure ─► _before_agree   (the layer-wise driver: reduce gradients to the owners)
                    ─► agreement       which items have a gradient anywhere, and whether any
                                       is non-finite: one small all-reduce per group of the
                                       stage (dp, then each tp), then ONE of a single count
                                       over pp, so every stage skips or raises together
                    ─► non-finite policy ("raise" or "skip", the same verdict everywhere)
                    ─► _step_owned     the inner optimizer on what this rank steps
                    ─► _after_step     (the layer-wise driver: launch the parameter gathers)
                    ─► stats           `comm_stats()` is then this step's bytes

`agreement_groups()` is the one place saying which groups a step agrees over; the agreement,
`clip_grad_norm_` (whose norm is so the whole model's, every stage's) and the bytes
`expected_comm_bytes()` counts for the agreement all read it.

The groups come one by one (`process_group`, `expert_group`, TP from the DTensors) or from
one `orthoptim.parallel.layout.ParallelMesh` (`layout=`): process group = its dp group,
expert group = its expert-data-parallel group when ep > 1, TP group = its tp group when
tp > 1, and its pp group when pp > 1.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterable, Iterator
from typing import Any, NamedTuple

import torch
from torch import Tensor, nn
from torch.distributed import ProcessGroup

from orthoptim import checkpoint
from orthoptim import collectives as C
from orthoptim._torch_compat import storage_key
from orthoptim._validate import check_choice, check_member, check_positive
from orthoptim.comm_bytes import CommStats, ring_all_reduce_bytes
from orthoptim.optim.base import (
    CompositeOptimizer,
    NonfinitePolicy,
    check_nonfinite_policy,
    enforce_nonfinite_policy,
)
from orthoptim.optim.guards import ParamSet, one_step
from orthoptim.optim.hybrid import RoutePredicate, build_optimizer, default_route
from orthoptim.optim.registry import OptimizerName
from orthoptim.optim.state import StateView
from orthoptim.parallel import clip
from orthoptim.parallel.assignment import BALANCES, Balance
from orthoptim.parallel.layout import ParallelMesh
from orthoptim.shards import local_shard

#: what `DistributedOptimizer.memory()` reports, in the order a shared storage is counted in
MEMORY_CATEGORIES = ("params", "grads", "masters", "state", "buffers")

#: the name a clean stage's non-finite verdict gives for the parameters of the stage that had one
ANOTHER_STAGE = "parameters of another pipeline stage"

#: the refusal a rank that found nothing wrong gives when another rank refused
ELSEWHERE = (
    "another rank refused the step (its model's trainable parameters are not "
    "those the optimizer was built over, it called step() inside no_sync(), or its "
    "gradients were changed in place before the step); its error names the cause and the fix"
)


class StepRefusedError(RuntimeError):
    """A distributed step refused on every rank before any weight moved: one line
    per cause (`DistributedOptimizer.refusal`), or `ELSEWHERE` on a rank that found none."""

    def __init__(self, lines: list[str]) -> None:
        super().__init__("\n".join(lines))
        self.lines = lines


class AgreementGroups(NamedTuple):
    """The groups a step agrees over: `stage`, over which per-item flags are summed in turn
    (data-parallel, then each tensor-parallel group), and `across` (the pipeline group),
    over which only the count of non-finite gradients travels (stages step other items)."""

    stage: tuple[ProcessGroup | None, ...]
    across: tuple[ProcessGroup | None, ...]

    @property
    def all(self) -> tuple[ProcessGroup | None, ...]:
        """Every group, stage first: what a sum over the whole model runs over."""
        return self.stage + self.across

    def ranks(self) -> int:
        """How many ranks take part in the verdict."""
        return math.prod(C.world(g)[1] for g in self.all)


def add_bytes(out: dict[str, dict[str, float]], kind: str, sent: float, received: float) -> None:
    """Count one call of `kind` in an `expected_comm_bytes()` dict."""
    d = out.setdefault(kind, {"sent": 0.0, "received": 0.0, "calls": 0})
    d["sent"] += sent
    d["received"] += received
    d["calls"] += 1


class DistributedOptimizer(CompositeOptimizer):
    """The base of the distributed drivers: the constructor preamble (`_preamble`,
    `_bind_groups`, `_adopt`), the state-dict surface, the step skeleton and the agreement
    groups (module docstring). A driver implements `_step_owned` and, where it moves bytes or
    holds gradients otherwise than every rank holding its averaged ones, `_before_agree`,
    `_after_step`, `_agreement_items`, `_clip_tensors` and `state_view`."""

    layout: ParallelMesh | None = None  # the ParallelMesh it was built with, if any
    process_group: ProcessGroup | None = None  # data-parallel
    expert_group: ProcessGroup | None = None  # expert data-parallel (ep > 1)
    # pipeline (None: the default group, when every rank is a stage)
    pp_group: ProcessGroup | None = None
    stages = 1  # pipeline stages of the layout (1 without one)
    # tensor-parallel (set by _bind_groups; a driver may find them)
    tp_groups: list[ProcessGroup | None]
    rank, world_size = 0, 1  # in `process_group`
    _prepared: dict[str, Any] | None = None  # prepare_state_dict()'s, until the next step

    # -- construction ------------------------------------------------------------------
    def _preamble(
        self,
        model: nn.Module,
        optimizer: OptimizerName,
        lr: float | None,
        route: RoutePredicate | None,
        nonfinite: NonfinitePolicy,
        balance: Balance,
        bucket_mb: float,
        state_dict_to: checkpoint.StateDictTo,
        inner_kwargs: dict[str, Any],
    ) -> None:
        """Check the arguments every driver takes and build the whole-model optimizer
        (`template`: it fixes the hyper-parameter groups every rank exposes and validates
        the inner arguments on every rank), the routing rule (`rule`) and the trainable
        parameters by name (`named`)."""
        if not isinstance(model, nn.Module):
            raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
        check_choice("balance", balance, BALANCES)
        check_positive("bucket_mb", bucket_mb)
        self.state_dict_to = check_choice("state_dict_to", state_dict_to, checkpoint.STATE_DICT_TO)
        self.nonfinite = check_nonfinite_policy(nonfinite)
        self.model = model
        self.rule = route if route is not None else default_route(model)
        self.template = build_optimizer(
            model, optimizer=optimizer, lr=lr, route=self.rule, nonfinite=nonfinite, **inner_kwargs
        )
        self.named: dict[str, nn.Parameter] = {
            n: p for n, p in model.named_parameters() if p.requires_grad
        }
        self.param_set = ParamSet(type(self).__name__, self.named)
        self.accumulating = 0  # how many no_sync() blocks are open
        # this step's bytes, one counter for the driver's life (its gradient sync records in
        # it), and the last step's, a copy
        self._stats = CommStats()
        self._last_stats = CommStats()

    def _bind_groups(
        self,
        process_group: ProcessGroup | None = None,
        expert_group: ProcessGroup | None = None,
        layout: ParallelMesh | None = None,
    ) -> None:
        """Take the process groups, one by one or from `layout` (a `ParallelMesh`; not both),
        and check every trainable parameter's device against each group's backend."""
        if layout is not None:
            if process_group is not None or expert_group is not None:
                raise ValueError(
                    f"{type(self).__name__}: pass layout= or process_group= / expert_group=, "
                    "not both (the layout hands out its dp and expert groups)"
                )
            dims = layout.dims
            process_group = layout.dp_group
            expert_group = layout.expert_group if dims.ep > 1 else None
            self.stages, self.pp_group = dims.pp, layout.pp_group
        self.layout = layout
        self.process_group = check_member("process_group", process_group)
        self.expert_group = expert_group
        self.tp_groups = [layout.tp_group] if layout is not None and layout.dims.tp > 1 else []
        self.rank, self.world_size = C.world(process_group)
        groups = [process_group] + ([expert_group] if expert_group is not None else [])
        for group in groups + ([self.pp_group] if self.stages > 1 else []):
            for n, p in self.named.items():
                C.check_device(p, f"{type(self).__name__}: parameter {n!r}", group)

    def _adopt(self, groups: list[dict[str, Any]], state: Any, defaults: dict[str, Any]) -> None:
        """The end of construction: torch's bookkeeping over every trainable parameter, then
        `groups`, `state` (None: torch's empty one) and `defaults` exposed as the optimizer's
        own (`adopt`)."""
        CompositeOptimizer.__init__(self, self.named.values())
        self.adopt(groups, self.state if state is None else state, defaults)
        self._built = True
        C.finish_at_exit(self)  # `wait_for_params()` at interpreter exit

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Not supported once built: what each rank steps is computed from the whole model."""
        if not getattr(self, "_built", False):  # torch's constructor
            super().add_param_group(param_group)
            return
        raise ValueError(
            f"{type(self).__name__} cannot add param groups: ownership is computed from the "
            "whole model at construction; build a new optimizer instead"
        )

    def copy_refusal(self) -> str | None:
        """A copy over a process group would share its groups with the original; at world
        size 1 without one, a copy (with its copy of the model) steps like the original."""
        groups = (self.process_group, self.expert_group)
        if self.layout is not None or any(g is not None for g in groups) or self.tp_groups:
            return "it runs over process groups, which a copy cannot share"
        if self.world_size > 1:
            return f"it runs over the {self.world_size} ranks of the default process group"
        return None

    # -- the step ----------------------------------------------------------------------
    def agreement_groups(self) -> AgreementGroups:
        """The groups a step agrees over (the agreement, `clip_grad_norm_` and the bytes
        `expected_comm_bytes` counts for them): the data-parallel group and each
        tensor-parallel group (the TP ranks of an owner step together), then across the
        pipeline stages."""
        across = (self.pp_group,) if self.stages > 1 else ()
        return AgreementGroups((self.process_group, *self.tp_groups), across)

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """closure → `_before_agree` → agreement → non-finite policy → `_step_owned` →
        `_after_step` → this step's bytes in `comm_stats()`."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self._prepared = None
        refusal = self.refusal()
        self._before_agree()
        present, bad, refused = self._agree(bool(refusal))
        try:
            if refused:
                raise StepRefusedError(refusal or [ELSEWHERE])
            skip = enforce_nonfinite_policy(self.nonfinite, bad, self.agreement_groups().ranks())
            if not skip:
                with one_step():
                    self._step_owned(present)
        finally:
            self._end_owned()
        if not skip:
            self._after_step()
        self._last_stats = self._stats.copy()
        self._stats.reset()
        return loss

    def refusal(self) -> list[str]:
        """Why this rank must not step now, one line per cause ([] when it may): a trainable
        parameter added, replaced or frozen since construction (`ParamSet`), or `step()`
        called inside `no_sync()` (Newton-Schulz would run per micro-batch on gradients
        never reduced). Host-side only; the verdict rides in the agreement, so every rank of
        the stage refuses together, each naming what it found."""
        lines, _ = self.param_set.problems(self.model, self.named.values())
        if self.accumulating:
            lines.append(
                f"{type(self).__name__}: step() was called inside no_sync(), so the optimizer "
                "(and Newton-Schulz) would run per micro-batch on gradients never reduced "
                "across ranks; call step() once, after the last micro-batch's backward, "
                "outside no_sync()"
            )
        return lines

    def _before_agree(self) -> None:
        """What must happen before the gradients can be checked (nothing by default)."""

    def _step_owned(self, present: list[bool]) -> None:
        """Step what this rank steps; `present[i]`: item i has a gradient on some rank."""
        raise NotImplementedError

    def _end_owned(self) -> None:
        """After the policy and `_step_owned`, even when they raised (nothing by default)."""

    def _after_step(self) -> None:
        """After a step that was not skipped (nothing by default)."""

    def _agreement_items(self) -> tuple[list[bool], list[Tensor], Callable[[], Tensor], list[str]]:
        """What the agreement checks: (a flag per item, whether it has a gradient here; 0-d
        device flags, true where a local gradient holds NaN or Inf; a callable giving a flag
        per item, on the device, to name them; the items' names). By default the items are
        the trainable parameters and the gradients the local shards of their `.grad`."""
        params = list(self.named.values())
        checks = [~torch.isfinite(local_shard(p.grad)).all() for p in params if p.grad is not None]
        device = self._device()

        def per_param() -> Tensor:
            return torch.stack(
                [
                    ~torch.isfinite(local_shard(p.grad)).all().to(device)
                    if p.grad is not None
                    else torch.zeros((), dtype=torch.bool, device=device)
                    for p in params
                ]
            )

        return [p.grad is not None for p in params], checks, per_param, list(self.named)

    def _agree(self, refused: bool = False) -> tuple[list[bool], list[str], bool]:
        """Which items had a gradient on some rank, the names of those whose gradient is
        non-finite (`ANOTHER_STAGE` on a stage whose own are finite while another stage's are
        not), and whether some rank, of the stage or another, `refused` the step (`refusal`):
        `collectives.agree_nonfinite` over `agreement_groups()`."""
        present, checks, per_item, names = self._agreement_items()
        groups = self.agreement_groups()
        verdict = C.agree_nonfinite(
            present, checks, per_item, list(groups.stage), self._stats, self._device(),
            across=groups.across, refused=refused,
        )  # fmt: skip
        bad = [n for n, v in zip(names, verdict.which) if v]
        bad = bad or ([ANOTHER_STAGE] if verdict.elsewhere else [])
        return verdict.present, bad, verdict.refused

    def _device(self) -> torch.device:
        """The device of the parameters (CPU for a model without trainable ones)."""
        return next(iter(self.named.values())).device if self.named else torch.device("cpu")

    # -- gradient clipping -------------------------------------------------------------
    @torch.no_grad()
    def clip_grad_norm_(
        self, max_norm: float, norm_type: float = 2.0, error_if_nonfinite: bool = False
    ) -> Tensor:
        """Clip the gradients of the whole model by their global norm, as
        `torch.nn.utils.clip_grad_norm_(model.parameters(), ...)` on a single process with the
        averaged gradients; call it between the (last) backward and `step()`.

        Each rank sums the `norm_type`-th powers of the averaged gradient elements it is
        responsible for (`_clip_tensors`: each element of the model counted on exactly one
        rank), ONE small all-reduce per group of `agreement_groups()` (sum; max for inf:
        data-parallel, each tensor-parallel group, then across the pipeline stages, so every
        stage clips by the whole model's norm) gives the total, and the gradients this rank
        applies are scaled by min(1, max_norm / (total + 1e-6)). Returns the total norm (the
        same on every rank).

        A non-finite total raises RuntimeError with `error_if_nonfinite`; otherwise the
        gradients are left unscaled and `step()` applies the optimizer's `nonfinite` policy
        to the parameters whose gradients are non-finite. Collective: call it on every rank."""
        p = clip.check_norm_type(norm_type)
        counted, scaled, dtype = self._clip_tensors()
        return clip.clip_(
            counted,
            scaled,
            max_norm,
            p,
            error_if_nonfinite,
            device=C.device_for(self.process_group, self._device()),
            groups=self.agreement_groups().all,
            dtype=dtype,
            stats=self._stats,
        )

    def _clip_tensors(self) -> tuple[Iterable[Tensor], list[Tensor], torch.dtype | None]:
        """(the averaged gradients this rank counts in the norm, those it scales, the dtype
        the norm is returned in). By default the local shards of every `.grad`, both."""
        grads = [local_shard(q.grad) for q in self.named.values() if q.grad is not None]
        dtype = next(iter(self.named.values())).dtype if self.named else None
        return grads, grads, dtype

    # -- the driver's contract with training loops -------------------------------------
    def wait_for_params(self) -> None:
        """Finish every parameter gather still in flight (call it before reading parameters
        outside a forward pass); nothing by default, where none outlives the step."""

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """A context in which backward passes accumulate gradients without communicating
        (gradient accumulation: every micro-batch but the last; `step()` inside it is
        refused): the driver's `_accumulate()`, which does nothing where its gradients
        travel otherwise."""
        self.accumulating += 1
        try:
            with self._accumulate():
                yield
        finally:
            self.accumulating -= 1

    def _accumulate(self) -> contextlib.AbstractContextManager[None]:
        """The driver's part of `no_sync()` (nothing by default)."""
        return contextlib.nullcontext()

    def memory_tensors(self) -> dict[str, list[Tensor]]:
        """The tensors this rank holds for training, by `MEMORY_CATEGORIES` (local shards of
        DTensors): by default the model's parameters and gradients and the optimizer's state;
        a driver adds what it holds beyond them (masters, flat buffers)."""
        params = list(self.model.parameters())
        return {
            "params": params,
            "grads": [p.grad for p in params if p.grad is not None],
            "masters": [],
            "state": list(_state_tensors(self.state.values())),
            "buffers": [],
        }

    def memory(self) -> dict[str, int]:
        """Bytes this rank holds by category (`MEMORY_CATEGORIES`: params, grads, masters,
        state, buffers), from `memory_tensors()`: each storage counted once, in the first
        category holding it (a parameter that views a flat buffer makes the buffer params)."""
        seen: set[int] = set()
        out = dict.fromkeys(MEMORY_CATEGORIES, 0)
        for cat, tensors in self.memory_tensors().items():
            for t in tensors:
                storage = local_shard(t).untyped_storage()
                if storage_key(storage) not in seen:
                    seen.add(storage_key(storage))
                    out[cat] += storage.nbytes()
        return out

    # -- accounting --------------------------------------------------------------------
    def comm_stats(self) -> dict[str, dict[str, float]]:
        """Bytes sent / received per collective kind (and calls) in the last step."""
        return self._last_stats.as_dict()

    def _expected_agreement(self, out: dict[str, dict[str, float]], items: int) -> None:
        """Add the agreement's bytes to `out` (an `expected_comm_bytes()` dict): an int32
        flag per item, the non-finite count and the refusal flag over each stage group, the
        count and the refusal alone across stages."""
        groups = self.agreement_groups()
        for nbytes, gs in (((items + 2) * 4, groups.stage), (2 * 4, groups.across)):
            for g in gs:
                size = C.world(g)[1]
                if size > 1:
                    ar = ring_all_reduce_bytes(nbytes, size)
                    add_bytes(out, "all_reduce", ar, ar)

    def reduce_max(self, t: Tensor) -> Tensor:
        """The elementwise max of `t` over the data-parallel replicas (QK-clip's agreement on
        max logits). Collective."""
        return C.all_reduce_max(t, self.process_group, "QK-clip max-logit agreement (all-reduce)")

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clear the gradients of every trainable parameter."""
        self.template.zero_grad(set_to_none=set_to_none)

    # -- state -------------------------------------------------------------------------
    def state_view(self) -> StateView:
        """The state by name for checkpoints (by default the whole-model optimizer's)."""
        return self.template.state_view()

    def state_dict(self) -> dict[str, Any]:
        """The whole optimizer's state in the format of `build_optimizer(model, ...)`'s
        `state_dict()` on one process (a single-process optimizer loads it as is; so does
        this optimizer at any world size), gathered to every rank, or with
        `state_dict_to="rank0"` to rank 0 only (the others get {}). Collective: call it on
        every rank, or `prepare_state_dict()` on every rank first. A call that some rank does
        not make fails within `orthoptim.collectives.store.RENDEZVOUS_TIMEOUT_S`
        seconds. For per-rank DCP checkpoints use `sharded_state_dict()`."""
        if self._prepared is not None:
            return self._prepared
        return self.full_state_dict(to_rank0=self.state_dict_to == "rank0")

    def prepare_state_dict(self) -> None:
        """Gather the full state dict to rank 0 now (collective: call it on every rank), so
        that `state_dict()` called by rank 0 alone returns it without communicating, until the
        next `step()` or load (the other ranks' `state_dict()` then returns {}). For trainers
        that save the optimizer from rank 0 only, as Hugging Face Trainer does."""
        self._prepared = None
        self._prepared = self.full_state_dict(to_rank0=True)

    def full_state_dict(self, to_rank0: bool = False) -> dict[str, Any]:
        """`state_dict()` with the destination given here instead of by `state_dict_to`;
        see `orthoptim.checkpoint.full_state_dict`. Collective."""
        C.rendezvous(
            f"{type(self).__name__}.state_dict()",
            "call it on every rank, or call opt.prepare_state_dict() on every rank first "
            "(after which state_dict() on rank 0 alone returns the gathered dict; see "
            "docs/integrations.md for Hugging Face Trainer, which saves from rank 0 only)",
            group=self.process_group,
        )
        return checkpoint.full_state_dict(self, to_rank0=to_rank0)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a full dict (`state_dict()` of this optimizer at any world size, or of a
        single-process `build_optimizer` / `Muon` / `SOAP` over the same model): every rank
        keeps the state of what it steps, hyper-parameters go to every group. Every mismatch
        is listed in one `CheckpointMismatchError` before anything changes."""
        self._prepared = None
        with self._loading():
            checkpoint.load_full_state_dict(self, state_dict)

    def sharded_state_dict(self) -> dict[str, Any]:
        """This rank's share for torch.distributed.checkpoint, under world-size-free keys;
        see `orthoptim.checkpoint` (`save_sharded` / `load_sharded` save and reshard)."""
        return checkpoint.sharded_state_dict(self)

    def load_sharded_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Install a DCP-read dict (keys as `sharded_state_dict()`, written at any world size)."""
        self._prepared = None
        with self._loading():
            checkpoint.load_sharded_state_dict(self, state_dict)

    def _loading(self) -> contextlib.AbstractContextManager[None]:
        """What a load runs inside (nothing by default)."""
        return contextlib.nullcontext()


def _state_tensors(states: Iterable[Any]) -> Iterator[Tensor]:
    """The tensors of an optimizer's per-parameter states (dicts), nested lists and dicts
    included."""
    for v in states:
        if isinstance(v, Tensor):
            yield v
        elif isinstance(v, dict):
            yield from _state_tensors(v.values())
        elif isinstance(v, (list, tuple)):
            yield from _state_tensors(v)
