"""Muon: momentum orthogonalized by Newton-Schulz (Jordan et al. 2024).

Per matrix parameter W with gradient G, one step is::

    W ← W − lr·wd·W                                  (decoupled weight decay)
    M ← μ·M + (1−μ)·G                                (momentum, EMA form)
    U ← (1−μ)·G + μ·M  if nesterov else M
    W ← W − lr·scale(rows, cols)·orthogonalize(U)

Same-shape matrices (and the experts of a 3-D parameter) are orthogonalized in one batched
call. A fused parameter (QKV, gate/up, per-head blocks) is orthogonalized block by block: the
`split` option maps its name to the row sizes of its blocks (`qkv_split` builds them); each
block joins the batch of its own shape and gets the LR scale of its own shape.

Muon never talks to a process group: a tensor-parallel orthogonalizer plugs in through
`orthogonalizer`. DTensor parameters (e.g. from `parallelize_module`) stay DTensors here:
shapes, and so LR scales, are global, and the orthogonalizer gets the stacked DTensor batch.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch
from torch import Tensor

from orthoptim._validate import (
    check_choice,
    check_dtype_or_auto,
    check_nonnegative,
    check_positive,
    check_unit_interval,
)
from orthoptim.newton_schulz import (
    CoefficientsLike,
    NSDtype,
    coefficient_schedule,
    newton_schulz,
    stacking_pays,
)
from orthoptim.optim.base import (
    GuardedOptimizer,
    check_nonfinite_policy,
    check_params,
    matrix_view,
    state_dtype,
)

# LR-scale conventions by their published names; LR_SCALE_ALIASES maps other libraries' spellings
# (NVIDIA Emerging-Optimizers' `scale_mode`, torch.optim.Muon's `adjust_lr_fn`) onto them.
LR_SCALES = ("keller", "unit_rms_norm", "spectral", "match_adamw_rms", "none")
LR_SCALE_ALIASES = {
    "shape_scaling": "keller",  # Emerging-Optimizers
    "original": "keller",  # torch.optim.Muon
    "match_rms_adamw": "match_adamw_rms",  # torch.optim.Muon
}

Orthogonalizer = Callable[[Tensor], Tensor]

Split = tuple[int, ...]


def qkv_split(
    n_head: int, head_dim: int, n_kv_head: int | None = None, per_head: bool = False
) -> Split:
    """Row sizes of a fused [q; k; v] weight for `Muon(split=...)`.

    Grouped-query attention: `n_kv_head` key/value heads (default `n_head`). `per_head`
    gives one block per head (q heads, then k heads, then v heads), else three blocks q, k, v.
    """
    kv = n_head if n_kv_head is None else n_kv_head
    if min(n_head, head_dim, kv) < 1:
        raise ValueError(
            f"qkv_split needs n_head, head_dim, n_kv_head >= 1, got {n_head}, {head_dim}, {kv}"
        )
    if per_head:
        return (head_dim,) * (n_head + 2 * kv)
    return (n_head * head_dim, kv * head_dim, kv * head_dim)


def base_name(name: str) -> str:
    """The parameter name of a piece label: "w[0:2]" (experts 0..1 of w) → "w"."""
    return name.split("[", 1)[0] if name.endswith("]") else name


def split_of(group: dict[str, Any], name: str) -> Split | None:
    """The row blocks of parameter (or piece label) `name` in a Muon param group (None: one)."""
    split = group.get("split") or {}
    return split.get(name, split.get(base_name(name)))


def orthogonalize_blocks(
    items: list[tuple[Tensor, Split | None]],
    orthogonalize: Orthogonalizer,
    lr_scale: str,
    stack: Callable[[torch.device], bool] = lambda device: True,
) -> Iterator[tuple[int, int | None, Tensor, float]]:
    """Orthogonalize matrix stacks [k, rows, cols], each whole or by row blocks (`split`).

    Yields (item index, first row of the block or None for a whole stack, the orthogonalized
    block, the LR-scale factor of the block's shape). Blocks of one shape (and one DTensor
    layout) go through one `orthogonalize` call when `stack(device)` says so, else one call
    each (no copy into a stack; each block is yielded as soon as it is done).
    """
    # (rows, cols, device, layout) → [(item, first row, block)]; a DTensor's layout (mesh,
    # placements) is part of the key so a batch never mixes shardings.
    batches: dict[tuple[Any, ...], list[tuple[int, int | None, Tensor]]] = defaultdict(list)
    for i, (mats, sizes) in enumerate(items):
        layout = (getattr(mats, "device_mesh", None), tuple(getattr(mats, "placements", ())))
        if sizes is None:
            batches[(mats.shape[-2], mats.shape[-1], mats.device, layout)].append((i, None, mats))
            continue
        if layout[0] is not None:
            raise NotImplementedError("Muon split of a DTensor parameter is not supported")
        row = 0
        for block in mats.split(list(sizes), dim=-2):
            batches[(block.shape[-2], mats.shape[-1], mats.device, layout)].append((i, row, block))
            row += block.shape[-2]
    for (rows, cols, device, _), entries in batches.items():
        scale = lr_scale_factor(lr_scale, rows, cols)
        if len(entries) > 1 and not stack(device):
            for i, row, block in entries:
                yield i, row, orthogonalize(block), scale
            continue
        blocks = [b for _, _, b in entries]
        ortho = orthogonalize(torch.cat(blocks) if len(blocks) > 1 else blocks[0])
        offset = 0
        for i, row, block in entries:
            k = block.shape[0]
            yield i, row, ortho[offset : offset + k], scale
            offset += k


def check_split(name: str, sizes: Any, rows: int) -> Split:
    """Validate one `split` entry against the rows of the parameter's matrices."""
    if isinstance(sizes, int) or not all(isinstance(s, int) and s > 0 for s in sizes):
        raise ValueError(f"split[{name!r}] must be a tuple of positive row sizes, got {sizes!r}")
    if sum(sizes) != rows:
        raise ValueError(
            f"split[{name!r}] = {tuple(sizes)} sums to {sum(sizes)} rows, but {name} has "
            f"{rows} rows per matrix"
        )
    return tuple(sizes)


def lr_scale_name(convention: str) -> str:
    """The published name of an LR-scale convention given by its name or an alias
    (`LR_SCALE_ALIASES`); raises ValueError naming `lr_scale` and every accepted spelling."""
    check_choice("lr_scale", convention, (*LR_SCALES, *LR_SCALE_ALIASES))
    return LR_SCALE_ALIASES.get(convention, convention)


def lr_scale_factor(convention: str, rows: int, cols: int) -> float:
    """The per-matrix learning-rate multiplier of an LR-scale convention (name or alias).

    keller (Jordan's Muon; EO `shape_scaling`, torch `original`): √max(1, rows/cols);
    unit_rms_norm (Bernstein's RMS→RMS norm; EO the same): √(rows/cols);
    spectral (Scion, EO the same): √max(rows, cols);
    match_adamw_rms (Moonlight; torch `match_rms_adamw`): 0.2·√max(rows, cols), update RMS
    ≈ AdamW's, so AdamW learning rates and decay carry over; none: 1.
    Earlier orthoptim versions called √(rows/cols) `spectral`; that is now `unit_rms_norm`.
    """
    convention = lr_scale_name(convention)
    if convention == "keller":
        return math.sqrt(max(1.0, rows / cols))
    if convention == "unit_rms_norm":
        return math.sqrt(rows / cols)
    if convention == "spectral":
        return math.sqrt(max(rows, cols))
    if convention == "match_adamw_rms":
        return 0.2 * math.sqrt(max(rows, cols))
    return 1.0


class Muon(GuardedOptimizer):
    """Muon for matrix parameters (2-D, 3-D experts [E, out, in], conv weights as (out, rest)).

    1-D parameters are rejected: route them to AdamW with `orthoptim.build_optimizer`.
    `split` ({parameter name: row sizes}) orthogonalizes each row block of a fused matrix on
    its own (for a 3-D parameter: the rows of every expert); it needs named parameters. The
    LR-scale convention is applied per block shape (a q block of a fused QKV gets the scale
    a separate q matrix would get). `lr_scale` takes the published names or the
    Emerging-Optimizers / torch.optim.Muon spellings (`lr_scale_factor`; README, "LR scales").
    `coefficients`: "quintic" (default) repeats its last tuple past 5 steps, where
    Emerging-Optimizers cycles; "polar_express" normalises by ‖X‖_F without the paper's 1.01
    (`orthoptim.newton_schulz.COEFFICIENT_SETS`).
    The momentum buffer is kept in float32 for low-precision parameters (fp32 master state),
    whatever `ns_dtype` is. `ns_dtype` is the Newton-Schulz dtype, resolved per batch from the
    device of the matrices (`resolve_ns_dtype`): "auto" (default) is bfloat16 on CUDA and
    float32 elsewhere, float64 parameters stay float64; a torch dtype (e.g. torch.float32)
    forces it; None is float32 on every device (the default before "auto"). A custom
    `orthogonalizer` uses its own (`TensorParallelOrthogonalizer(ns_dtype=...)`).
    """

    def __init__(
        self,
        params: Iterable[Any],
        lr: float = 0.02,
        momentum: float = 0.95,
        nesterov: bool = True,
        weight_decay: float = 0.0,
        ns_steps: int = 5,
        coefficients: CoefficientsLike = "quintic",
        lr_scale: str = "keller",
        ns_dtype: NSDtype = "auto",
        orthogonalizer: Orthogonalizer | None = None,
        nonfinite: str = "raise",
        eps: float = 1e-7,
        split: dict[str, Split] | None = None,
    ) -> None:
        check_nonnegative("lr", lr)
        check_unit_interval("momentum", momentum)
        check_nonnegative("weight_decay", weight_decay)
        check_positive("eps", eps)
        lr_scale = lr_scale_name(lr_scale)
        coefficient_schedule(coefficients, ns_steps, name="ns_steps")
        check_dtype_or_auto("ns_dtype", ns_dtype)
        if orthogonalizer is not None and not callable(orthogonalizer):
            raise TypeError(
                "orthogonalizer must be a callable (Tensor) -> Tensor or None, "
                f"got {orthogonalizer!r}"
            )
        self.nonfinite = check_nonfinite_policy(nonfinite)
        self.orthogonalizer = orthogonalizer
        defaults = dict(
            lr=lr,
            momentum=momentum,
            nesterov=nesterov,
            weight_decay=weight_decay,
            ns_steps=ns_steps,
            coefficients=coefficients,
            lr_scale=lr_scale,
            ns_dtype=ns_dtype,
            eps=eps,
            split=dict(split or {}),
        )
        super().__init__(params, defaults)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """As torch's, but rejects parameters that are not matrices, naming them."""
        super().add_param_group(param_group)
        group = self.param_groups[-1]
        group["lr_scale"] = lr_scale_name(group["lr_scale"])
        check_dtype_or_auto("ns_dtype", group["ns_dtype"])
        check_params("Muon", self.param_groups)
        names = group.get("param_names")
        for i, p in enumerate(group["params"]):
            if p.ndim < 2:
                name = names[i] if names is not None else f"parameter {i} of the new group"
                raise ValueError(
                    f"Muon got {name} with shape {tuple(p.shape)}: Muon only optimizes matrices "
                    "(>= 2 dims). Route vectors, scalars and embeddings to AdamW with "
                    "orthoptim.build_optimizer(model, optimizer='muon')."
                )
            if p.is_complex():
                raise ValueError(
                    f"Muon does not support complex parameters (shape {tuple(p.shape)})"
                )
        if group["split"] and names is None:
            raise ValueError(
                "Muon(split=...) names parameters: pass named parameters, e.g. "
                "Muon(model.named_parameters(), split=...)"
            )
        for i, p in enumerate(group["params"]):
            sizes = self._split_of(group, i)
            if sizes is not None:
                check_split(names[i], sizes, matrix_view(p).shape[-2])

    @staticmethod
    def _split_of(group: dict[str, Any], index: int) -> Split | None:
        """The row blocks of parameter `index` of `group` (None: one block)."""
        if not group["split"]:
            return None
        return split_of(group, group["param_names"][index])

    def _update(self) -> None:
        for group in self.param_groups:
            self._step_group(group)

    def _step_group(self, group: dict[str, Any]) -> None:
        momentum, nesterov = group["momentum"], group["nesterov"]
        lr, wd = group["lr"], group["weight_decay"]
        params: list[Tensor] = []
        items: list[tuple[Tensor, Split | None]] = []
        for i, p in enumerate(group["params"]):
            if p.grad is None:
                continue
            if p.grad.is_sparse:
                raise ValueError(f"Muon does not support sparse gradients (shape {tuple(p.shape)})")
            state = self.state[p]
            grad = p.grad.to(state_dtype(p))
            if "momentum_buffer" not in state:
                state["momentum_buffer"] = torch.zeros_like(
                    grad, memory_format=torch.preserve_format
                )
            buf = state["momentum_buffer"]
            buf.lerp_(grad, 1.0 - momentum)
            update = grad.lerp(buf, momentum) if nesterov else buf
            if wd != 0.0:
                p.mul_(1.0 - lr * wd)
            params.append(p)
            items.append((matrix_view(update), self._split_of(group, i)))

        blocks = orthogonalize_blocks(
            items, lambda mats: self._orthogonalize(mats, group), group["lr_scale"], self.stacks
        )
        for i, row, o, scale in blocks:
            p = params[i]
            if row is None:
                p.add_(o.reshape(p.shape).to(p.dtype), alpha=-lr * scale)
            else:
                rows = matrix_view(p)[:, row : row + o.shape[-2]]
                rows.add_(o.to(p.dtype), alpha=-lr * scale)

    def stacks(self, device: torch.device) -> bool:
        """Whether same-shape blocks on `device` go to the orthogonalizer as one stack: always
        for a custom one (one call, e.g. one collective, per shape), else where batched
        Newton-Schulz pays (`stacking_pays`)."""
        return self.orthogonalizer is not None or stacking_pays(device)

    def _orthogonalize(self, mats: Tensor, group: dict[str, Any]) -> Tensor:
        if self.orthogonalizer is not None:
            return self.orthogonalizer(mats)
        return newton_schulz(
            mats,
            steps=group["ns_steps"],
            coefficients=group["coefficients"],
            eps=group["eps"],
            dtype=group["ns_dtype"],
        )
