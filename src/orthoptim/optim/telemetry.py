"""What one optimizer step did, measured while it runs: the recorder the steps write into.

A recorded step (`recording(record)`, opened by `orthoptim.telemetry.Telemetry`) adds, per
parameter class (`param_class`: attention q/k/v/o, MLP, experts, router, other matrices, and
the elementwise part that AdamW or Lion steps), sums that meet across ranks by addition:

    update      Σ (W_after − W_before)²  over the elements this rank stepped
    weight      Σ W_after²
    elements    how many
    lr          Σ effective LR · elements (the group's LR times the optimizer's LR scale)
    momentum    Σ m², and its elements (Muon's momentum buffer, AdamW's and Lion's exp_avg)
    residual    Σ ‖OOᵀ − I‖_F / √m of one sampled matrix per class (O the step's own
                Newton-Schulz output for it, at the group's steps and dtype, before any LR
                scale; m its short side: the RMS over singular values of σ² − 1), and how
                many were sampled
    tensors     how many parameters (or shards) were stepped

Every sum is RMS-friendly: a tensor replicated on several ranks adds equally to a sum and to
its count, so `rms = √(Σ/count)` is the same however many ranks hold it. The sums stay on the
device; `StepRecord.values()` reads them once. A step outside `recording` pays one attribute
read per `step_params`.
"""

from __future__ import annotations

import contextlib
import math
import re
import threading
from collections.abc import Iterator
from typing import Any

import torch
from torch import Tensor

from orthoptim import host
from orthoptim.shards import local_shard

#: the parameter classes, in report order
CLASSES = (
    "attn_q",
    "attn_k",
    "attn_v",
    "attn_qkv",
    "attn_o",
    "mlp",
    "experts",
    "router",
    "matrix_other",
    "elementwise",
)
#: the sums a record keeps per class (see the module's docstring)
FIELDS = (
    "update_sq",
    "weight_sq",
    "elements",
    "lr_elements",
    "momentum_sq",
    "momentum_elements",
    "residual_sum",
    "residual_count",
    "tensors",
)
_FIELD = {f: i for i, f in enumerate(FIELDS)}
#: the state entries read as momentum, first found wins
MOMENTUM_KEYS = ("momentum_buffer", "exp_avg")

_ATTENTION = re.compile(r"(^|[._])(attn|attention|self_attn|self_attention|mixer)([._]|$)")
_TABLES = re.compile(r"(^|[._])(embed\w*|wte|wpe|tok_embeddings|lm_head|output|unembed)([._]|$)")
_ROLES = (
    ("router", re.compile(r"(^|\.)(router|gate|gating|wg)(\.|$)")),
    ("experts", re.compile(r"expert")),
    ("attn_qkv", re.compile(r"(^|[._])(qkv|wqkv|c_attn|in_proj|query_key_value)([._]|$)")),
    ("attn_q", re.compile(r"(^|[._])(q|wq|q_proj|query)([._]|$)")),
    ("attn_k", re.compile(r"(^|[._])(k|wk|k_proj|key)([._]|$)")),
    ("attn_v", re.compile(r"(^|[._])(v|wv|v_proj|value)([._]|$)")),
    ("attn_o", re.compile(r"(^|[._])(o|wo|o_proj|out_proj|proj|c_proj|dense|output)([._]|$)")),
)


def param_class(name: str, ndim: int) -> str:
    """The telemetry class of the parameter `name` with `ndim` dimensions (one of `CLASSES`),
    from its name: vectors, embeddings and output heads are "elementwise" (what
    `build_optimizer` gives AdamW); expert stacks "experts"; a MoE router ("router", "gate")
    "router"; matrices of an attention module by their projection; everything else inside
    the blocks "mlp" when its name says MLP/FFN, else "matrix_other"."""
    low = name.lower()
    if ndim < 2 or _TABLES.search(low):
        return "elementwise"
    for cls, pattern in _ROLES[:2]:
        if pattern.search(low):
            return cls
    if _ATTENTION.search(low):
        for cls, pattern in _ROLES[2:]:
            if pattern.search(low):
                return cls
        return "attn_qkv"
    if re.search(r"mlp|ffn|feed_forward|fc|up_proj|down_proj|gate_proj|w[123](\.|$)", low):
        return "mlp"
    return "matrix_other"


def _wide(t: Tensor) -> torch.dtype:
    """The dtype `t` is measured in: float32, or its own where wider (float64)."""
    return torch.promote_types(t.dtype, torch.float32)


def _sq(t: Tensor) -> Tensor:
    """Σ t² as a 0-d float64 tensor on t's device (the norm taken in `_wide`)."""
    return torch.linalg.vector_norm(t, dtype=_wide(t)).double().square()


class StepRecord:
    """The sums of one recorded step, per class (`FIELDS`), kept on the device; `sample`
    says which classes still want a Newton-Schulz residual on this rank."""

    def __init__(
        self, ndims: dict[str, int] | None = None, names: dict[int, str] | None = None
    ) -> None:
        self.sums: Tensor | None = None
        self.sampled: set[str] = set()
        #: the model's parameters' dimensions by name: a flat shard is classed as its whole
        self.ndims = ndims or {}
        #: the model's names of its parameters (id → name), for optimizers that do not name them
        self.names = names or {}

    def class_of(self, name: str, ndim: int) -> str:
        """`param_class` of `name`, by the whole parameter's dimensions where known."""
        return param_class(name, self.ndims.get(name, ndim))

    def _row(self, cls: str, device: torch.device) -> Tensor:
        if self.sums is None:
            self.sums = torch.zeros(len(CLASSES), len(FIELDS), dtype=torch.float64, device=device)
        return self.sums[CLASSES.index(cls)]

    def add_update(
        self, name: str, before: Tensor, after: Tensor, lr: float, state: dict[str, Any]
    ) -> None:
        """One parameter (or this rank's shard of it) stepped from `before` to `after` (its
        local tensors) at effective LR `lr`, with optimizer `state` after the step."""
        row = self._row(self.class_of(name, after.ndim), after.device)
        n = after.numel()
        moved = after.to(_wide(after)) - before.to(_wide(after))
        values = [_sq(moved), _sq(after)]
        momentum = next((state[k] for k in MOMENTUM_KEYS if torch.is_tensor(state.get(k))), None)
        momentum = local_shard(momentum) if momentum is not None else None
        m_sq = _sq(momentum) if momentum is not None else values[0].new_zeros(())
        m_n = momentum.numel() if momentum is not None else 0
        stacked = torch.stack([*values, m_sq.to(values[0].device)])
        idx = [_FIELD["update_sq"], _FIELD["weight_sq"], _FIELD["momentum_sq"]]
        row[idx] += stacked
        row[_FIELD["elements"]] += n
        row[_FIELD["lr_elements"]] += float(lr) * n
        row[_FIELD["momentum_elements"]] += m_n
        row[_FIELD["tensors"]] += 1

    def wants_sample(self, name: str, ndim: int) -> bool:
        """Whether the class of `name` has no residual sampled yet in this step here."""
        cls = self.class_of(name, ndim)
        return cls != "elementwise" and cls not in self.sampled

    def add_residual(self, name: str, ndim: int, ortho: Tensor) -> None:
        """The orthogonality residual of `ortho` (the orthogonalizer's output for parameter
        `name`: a matrix or a stack, of which the first matrix is measured) for its class,
        when that class has none yet in this step here."""
        if type(ortho) is not Tensor or not self.wants_sample(name, ndim):
            return
        ortho = ortho.reshape(-1, *ortho.shape[-2:])[0]
        cls = self.class_of(name, ndim)
        self.sampled.add(cls)
        row = self._row(cls, ortho.device)
        row[_FIELD["residual_sum"]] += orthogonality_residual(ortho).to(row.device)
        row[_FIELD["residual_count"]] += 1

    def values(self) -> list[float]:
        """The sums, class by class (`CLASSES` × `FIELDS`, row-major; zeros when nothing was
        recorded): one host read."""
        if self.sums is None:
            return [0.0] * (len(CLASSES) * len(FIELDS))
        return host.read(self.sums, "telemetry").flatten().tolist()


def orthogonality_residual(ortho: Tensor) -> Tensor:
    """‖XXᵀ − I‖_F / √m for X = `ortho` [rows, cols] on its short side (m rows), in float32:
    0 for an exact polar factor, the RMS of σᵢ² − 1 over its singular values otherwise."""
    x = ortho.detach().to(torch.float32)
    if x.shape[-2] > x.shape[-1]:
        x = x.mT
    m = x.shape[-2]
    gram = x @ x.mT
    gram.diagonal().sub_(1.0)
    return torch.linalg.matrix_norm(gram) / math.sqrt(m)


class _Active(threading.local):
    record: StepRecord | None = None


_active = _Active()


def active() -> StepRecord | None:
    """The record of the step being recorded on this thread, or None (the usual case, and
    always inside a compiled step: telemetry records eager steps)."""
    if torch.compiler.is_compiling():
        return None
    return _active.record


@contextlib.contextmanager
def recording(record: StepRecord) -> Iterator[StepRecord]:
    """Steps inside write what they do into `record` (nested: the outer record is kept)."""
    if _active.record is not None or torch.compiler.is_compiling():
        yield _active.record or record
        return
    _active.record = record
    try:
        yield record
    finally:
        _active.record = None


def lr_of(group: dict[str, Any]) -> float:
    """A group's LR as a float (a 1-element tensor LR read once: recorded steps only)."""
    lr = group.get("lr", 0.0)
    return float(lr.item()) if torch.is_tensor(lr) else float(lr)


@torch.no_grad()
def apply_recorded(
    record: StepRecord | None,
    optimizer: Any,
    param: Tensor,
    direction: Tensor | None,
    state: dict[str, Any],
    group: dict[str, Any],
    name: str,
    whole: Tensor | None = None,
) -> None:
    """`optimizer.apply(param, direction, state, group)`, with its update recorded into
    `record` when there is one: the parameter's local tensor is copied first (one parameter
    at a time, recorded steps only). `whole`: the parameter `param` is a shard of (its shape
    gives the LR scale)."""
    if record is None or direction is None:
        optimizer.apply(param, direction, state, group)
        return
    local = local_shard(param)
    before = local.detach().clone()
    optimizer.apply(param, direction, state, group)
    factor = optimizer.lr_factor(param if whole is None else whole, group, name)
    record.add_update(name, before, local, lr_of(group) * factor, state)


@contextlib.contextmanager
def updates_recorded(
    record: StepRecord, optimizer: torch.optim.Optimizer, names: dict[int, str]
) -> Iterator[None]:
    """Record the update of every parameter `optimizer` steps inside (an optimizer that does
    not record itself: torch's AdamW, Lion, a bf16-state AdamW), named by `names` (id →
    name) where the model does not name it: the local tensors of the parameters that have a
    gradient are copied on entry (recorded steps only) and compared on exit."""
    live = [(p, g) for g in optimizer.param_groups for p in g["params"] if p.grad is not None]
    with torch.no_grad():
        before = [local_shard(p).detach().clone() for p, _ in live]
    yield
    with torch.no_grad():
        for (p, g), old in zip(live, before):
            state = optimizer.state.get(p, {})
            name = record.names.get(id(p), names[id(p)])
            record.add_update(name, old, local_shard(p), lr_of(g), state)
