"""The contract every matrix optimizer keeps, so that one code path runs it in a single
process, layer-wise (each matrix owned whole by one rank) and under FSDP2 (every rank holds a
dim-0 shard of every matrix), and so that checkpoints read its state without knowing it.

One step of a parameter W with gradient G splits in three::

    u = prepare(G, state, group)         elementwise: runs on any shard of G (under FSDP each
                                         rank on its rows); reads and writes the "elementwise"
                                         state, e.g. momentum
    d = directions([(u, state), ...], group, names)
                                         whole matrices, on the owner only, batched (Newton-
                                         Schulz of same-shape matrices in one call); reads and
                                         writes the "matrix" state; d is u's shape, any
                                         per-shape LR scale included; None leaves W in place.
                                         It may write d into u's storage (Muon, where u is a
                                         fresh tensor: `Muon.owns_updates`), so a caller reads
                                         no u after it
    apply(W, d, state, group)            elementwise: W ← (1 − lr·wd)·W − lr·d by default

`state_kinds` declares each state entry, `StateKind`:

    "elementwise"   shaped like W; under FSDP it stays sharded like W (a DTensor), so memory is
                    spread and checkpoints reshard it as they reshard W
    "matrix"        whole-matrix state (SOAP's factors, NorMuon's per-neuron moment), held by
                    the owner only, created in `directions`
    "scalar"        a small value every rank holding part of W keeps alike (a step count),
                    advanced in `apply`, so that `moves` agrees on every rank

`init_state` makes the elementwise entries (zeros like the parameter: a DTensor parameter
gives DTensor state); scalar and matrix entries appear as the step first sets them.
`moves(state, shape, group)` says, before a step and from the scalar state alone, whether
that step will move a parameter of global `shape`; a rank holding a shard passes None to
`apply` when it does not.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any, ClassVar, Literal

import torch
from torch import Tensor

from orthoptim.optim import telemetry
from orthoptim.optim.base import GuardedOptimizer, compute_dtype, param_name
from orthoptim.optim.guards import mark_stepped

StateKind = Literal["elementwise", "matrix", "scalar"]
Group = dict[str, Any]  # a param group: its hyper-parameters and "params"
State = dict[str, Any]  # one parameter's optimizer state
Prepared = Sequence[tuple[Tensor, State]]  # what `directions` takes: (prepared update, state)
Directions = list[Tensor | None]


class MatrixOptimizer(GuardedOptimizer):
    """Base of the per-matrix optimizers (Muon, SOAP, NorMuon, AdaMuon, PolarGrad, Scion).

    A subclass declares `state_kinds` and implements `prepare` and `directions`; `init_state`,
    `moves` and `apply` have defaults (zero elementwise state, always moves, decoupled weight
    decay then W −= lr·d). The single-process step is fixed here and is what the layer-wise
    optimizer's owners run; `FSDPOptimizer` runs the same three functions on shards and owners.
    """

    state_kinds: ClassVar[dict[str, StateKind]] = {}
    #: the whole-matrix work, for cost-balanced ownership (`orthoptim.parallel.assignment`):
    #: "newton_schulz" (Muon and its variants) or "eigenbasis" (SOAP)
    work: ClassVar[str] = "newton_schulz"
    #: the gradients are the caller's scratch (the layer-wise optimizer's reduced buffers):
    #: `prepare` may compute the update in their storage instead of a tensor of its own
    consumes_grads: bool = False
    #: same-shape matrices may be batched into one call (how many a rank holds may follow the
    #: layout); False: each matrix on its own, its path and batch the same on any layout
    batch_matrices: bool = True
    marks_stepped = True
    #: its steps record their updates in telemetry themselves (`step_params`)
    records_updates = True

    @classmethod
    def state_numel(cls, shape: Sequence[int]) -> int:
        """Optimizer-state elements of a parameter of `shape` held whole (for levelling state
        per rank): one per element for each non-scalar entry, the default."""
        return math.prod(shape) * sum(kind != "scalar" for kind in cls.state_kinds.values())

    def add_defaults(self, **hypers: Any) -> None:
        """Add a subclass's own hyper-parameters to the defaults and to every group that does
        not set them (a variant built on its parent's constructor)."""
        self.defaults.update(hypers)
        for group in self.param_groups:
            for key, value in hypers.items():
                group.setdefault(key, value)

    def init_state(self, param: Tensor, group: dict[str, Any]) -> dict[str, Any]:
        """Fresh elementwise and scalar state of `param`: zeros like it, in the group's
        `state_dtype` where it sets one (bfloat16 storage, `orthoptim.optim.lean`), else in
        the compute dtype (float32 for bf16/fp16 parameters, `compute_dtype`)."""
        dtype = group.get("state_dtype") or compute_dtype(param)
        return {
            key: torch.zeros_like(param, dtype=dtype)
            for key, kind in self.state_kinds.items()
            if kind == "elementwise"
        }

    def prepare(self, grad: Tensor, state: dict[str, Any], group: dict[str, Any]) -> Tensor:
        """The elementwise part of a step: what travels to the matrix's owner (any shard)."""
        raise NotImplementedError

    def directions(self, items: Prepared, group: Group, names: Sequence[str]) -> Directions:
        """The whole-matrix part of a step, for every (prepared update, state) of one group:
        each parameter's update direction (its shape, LR scale included), or None to leave it
        in place this step. `names` label the parameters in errors and fused-matrix splits.
        An update may come back overwritten (its direction written into it): read none after
        this."""
        raise NotImplementedError

    def moves(self, state: dict[str, Any], shape: torch.Size, group: dict[str, Any]) -> bool:
        """Whether the coming step moves a parameter of global `shape` with this state."""
        return True

    def apply(
        self, param: Tensor, direction: Tensor | None, state: dict[str, Any], group: dict[str, Any]
    ) -> None:
        """W ← (1 − lr·wd)·W − lr·d on `param` (any shard, with its rows of d); nothing for None."""
        if direction is not None:
            descend(param, direction, group["lr"], group["weight_decay"])

    def lr_factor(self, param: Tensor, group: dict[str, Any], name: str) -> float:
        """The factor on the group's LR this optimizer's step gives `param` (its LR scale;
        1 by default), for the effective LR telemetry reports."""
        return 1.0

    def state_of(self, param: Tensor, group: dict[str, Any]) -> dict[str, Any]:
        """The state of `param`, its `init_state` made on first sight."""
        state = self.state[param]
        if not state:
            state.update(self.init_state(param, group))
        return state

    def init_compiled_state(self) -> None:
        """`init_state` of every parameter with a gradient and no state yet."""
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    self.state_of(p, group)

    def _update(self) -> None:
        for gi, group in enumerate(self.param_groups):
            live = [i for i, p in enumerate(group["params"]) if p.grad is not None]
            params = [group["params"][i] for i in live]
            self.step_params(params, group, [param_name(group, gi, i) for i in live])

    @torch.no_grad()
    def step_params(self, params: list[Tensor], group: dict[str, Any], names: list[str]) -> None:
        """One step of `params` (of `group`, each with a gradient, each held whole here)."""
        mark_stepped(params, type(self).__name__, names)
        items = []
        moving = []
        for p in params:
            state = self.state_of(p, group)
            moving.append(self.moves(state, p.shape, group))
            items.append((self.prepare(p.grad, state, group), state))
        record = telemetry.active()
        found = self.directions(items, group, names)
        for p, (_, state), d, moves, name in zip(params, items, found, moving, names):
            telemetry.apply_recorded(record, self, p, d if moves else None, state, group, name)


Scalar = float | Tensor  # a hyper-parameter the step reads: a float or a 1-element tensor


def step_scalar(value: Scalar) -> Scalar:
    """A hyper-parameter (an LR) as the step's arithmetic takes it. A 1-element tensor (of any
    shape: torch.optim's way to let a scheduler change an LR without recompiling a compiled
    step) is read as a Python float in eager code, so the step is exactly the float's, and
    stays a 0-d tensor under `torch.compile`, so the compiled step reads nothing on the host."""
    if not isinstance(value, Tensor):
        return value
    return value.reshape(()) if torch.compiler.is_compiling() else value.item()


def descend(
    param: Tensor,
    direction: Tensor,
    lr: Scalar,
    weight_decay: float,
    step_size: Scalar | None = None,
) -> None:
    """W ← (1 − lr·wd)·W − step_size·d (step_size defaults to lr), in place on `param` (any
    shard, with its rows of d). A bf16/fp16 parameter is updated in the direction's (state)
    dtype and rounded once. `lr` and `step_size` may be 1-element tensors (`step_scalar`)."""
    lr = step_scalar(lr)
    step_size = step_scalar(step_size) if step_size is not None else None
    w = param if param.dtype == direction.dtype else param.to(direction.dtype)
    if weight_decay != 0.0:
        w.mul_(1.0 - lr * weight_decay)
    w.add_(direction.view(w.shape), alpha=-(lr if step_size is None else step_size))
    if w is not param:
        param.copy_(w)
