"""Global-norm gradient clipping when no rank holds every gradient.

Each rank sums the `norm_type`-th powers of the gradient elements it is responsible for
(`power_sum`; the max of their magnitudes for the inf-norm), ONE small all-reduce per group
(sum; max for the inf-norm) gives the model's total on every rank (`total_norm`), and each
rank scales its gradients by torch's coefficient (`clip_coefficient`), as
`torch.nn.utils.clip_grad_norm_` does on a single process. `ordered_norm` is a norm summed
in fixed trees instead, whose bits do not follow the layout (`reproducible=True`).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from orthoptim import collectives as C
from orthoptim import host
from orthoptim.comm_bytes import CommStats
from orthoptim.parallel.ordered import tree_total


def check_norm_type(norm_type: float) -> float:
    """A p > 0 or inf, as a float; anything else named in a ValueError."""
    try:
        p = float(norm_type)
    except (TypeError, ValueError):
        raise ValueError(f"norm_type must be a number > 0 or inf, got {norm_type!r}") from None
    if not (p > 0):  # also NaN
        raise ValueError(f"norm_type must be a number > 0 or inf, got {norm_type!r}")
    return p


def accumulator_dtype(device: torch.device) -> torch.dtype:
    """float64 where the device has it (the partial sums meet exactly once, so accumulate
    them accurately), float32 on MPS."""
    return torch.float32 if device.type == "mps" else torch.float64


def power_sum(tensors: Iterable[Tensor], norm_type: float, device: torch.device) -> Tensor:
    """Σ |x|^p over every element of `tensors` (max |x| for p = inf), as a 1-element tensor of
    `accumulator_dtype` on `device` (0 when there are none)."""
    acc = accumulator_dtype(device)
    parts = [
        torch.linalg.vector_norm(t, norm_type, dtype=acc).to(device) for t in tensors if t.numel()
    ]
    if not parts:
        return torch.zeros(1, dtype=acc, device=device)
    norms = torch.stack(parts)
    if math.isinf(norm_type):
        return norms.max().reshape(1)
    return norms.pow(norm_type).sum().reshape(1)


def total_norm(
    partial: Tensor, norm_type: float, groups: Iterable[Any], stats: CommStats | None = None
) -> Tensor:
    """The global norm from every rank's `power_sum`: one all-reduce per group (sum; max for
    the inf-norm), then the p-th root. `partial` must be on `collectives.device_for(group)`."""
    op = dist.ReduceOp.MAX if math.isinf(norm_type) else dist.ReduceOp.SUM
    for group in groups:
        with C.phase("gradient norm (all-reduce)", group):
            C.all_reduce(partial, op=op, group=group, stats=stats, kind="grad_norm")
    total = partial[0]
    return total if math.isinf(norm_type) else total.pow(1.0 / norm_type)


def check_finite(total: Tensor, norm_type: float) -> None:
    """Raise as torch does when `total` is not finite (one host read: `error_if_nonfinite`)."""
    if bool(host.read(~torch.isfinite(total), "gradient norm check")):  # zero: finite
        raise RuntimeError(
            f"The total norm of order {norm_type} for gradients from `parameters` is "
            "non-finite, so it cannot be clipped. To disable this error and scale the gradients "
            "by the non-finite norm anyway, set `error_if_nonfinite=False`"
        )


def clip_coefficient(total: Tensor, max_norm: float) -> Tensor:
    """torch's clip_coef, min(1, max_norm / (total + 1e-6)), but 1 where `total` is not finite
    (such gradients are left unscaled for the `nonfinite` policy), computed on the device."""
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    return torch.where(torch.isfinite(total), coef, torch.ones_like(coef))


def scale_(tensors: Iterable[Tensor], coef: Tensor) -> None:
    """Multiply every tensor in place by `coef` (in its own dtype and device)."""
    for t in tensors:
        t.mul_(coef.to(device=t.device, dtype=t.dtype))


def apply_clip(
    total: Tensor,
    scaled: Iterable[Tensor],
    max_norm: float,
    norm_type: float,
    error_if_nonfinite: bool,
    dtype: torch.dtype | None,
) -> Tensor:
    """Multiply `scaled` (the gradients this rank applies) by `clip_coefficient` of the global
    norm `total`, with no host read unless `error_if_nonfinite` asks for one
    (`check_finite`). Returns the norm in `dtype` (None: the accumulator's)."""
    if error_if_nonfinite:
        check_finite(total, norm_type)
    scale_(scaled, clip_coefficient(total, max_norm))
    return total if dtype is None else total.to(dtype)


def clip_(
    counted: Iterable[Tensor],
    scaled: Iterable[Tensor],
    max_norm: float,
    norm_type: float,
    error_if_nonfinite: bool,
    device: torch.device,
    groups: Iterable[Any],
    dtype: torch.dtype | None,
    stats: CommStats | None = None,
) -> Tensor:
    """The whole clip of a distributed optimizer: the global norm of the `counted` tensors
    (each element of the model counted on exactly one rank of `groups`), then `apply_clip`.
    Returns the norm, the same on every rank, as a tensor on the device."""
    p = check_norm_type(norm_type)
    total = total_norm(power_sum(counted, p, device), p, groups, stats=stats)
    return apply_clip(total, scaled, max_norm, p, error_if_nonfinite, dtype)


def ordered_norm(
    items: Iterable[tuple[int, Tensor]],
    spans: Sequence[tuple[int, int]],
    norm_type: float,
    device: torch.device,
    groups: Iterable[Any],
    stats: CommStats | None = None,
) -> Tensor:
    """The global norm with bits that do not depend on which rank holds what
    (`reproducible=True`). The model's units are fixed blocks: unit u has the places
    `spans[u]` = (first, count) of a vector, one for a unit held whole by one rank (its
    `ordered.tree_power_sum`), one per block of elements (`ordered.NORM_BLOCK`, the driver's
    `norm_block`) for a unit sharded in runs that start and end on those blocks (their
    `block_power_sums`). `items` gives this rank's as
    (first place, values). One all-reduce per group adds the vectors (one rank's term and
    zeros: exact), each sharded unit's blocks are summed in the binary tree over the block
    index, then the units in the binary tree over the unit index (max for the inf-norm)."""
    p = check_norm_type(norm_type)
    acc = accumulator_dtype(device)
    size = sum(count for _, count in spans)
    parts = torch.zeros(size, dtype=acc, device=device)
    for first, values in items:
        parts[first : first + values.numel()] = values.to(device)
    inf = math.isinf(p)
    op = dist.ReduceOp.MAX if inf else dist.ReduceOp.SUM
    for group in groups:
        with C.phase("gradient norm (all-reduce)", group):
            C.all_reduce(parts, op=op, group=group, stats=stats, kind="grad_norm")
    firsts = torch.tensor([first for first, _ in spans], dtype=torch.long, device=device)
    units = parts.index_select(0, firsts) if spans else parts[:0]
    for u, (first, count) in enumerate(spans):
        if count > 1:
            blocks = parts[first : first + count]
            units[u] = blocks.max() if inf else tree_total(blocks)
    if inf:
        return units.max() if units.numel() else units.new_zeros(())
    return tree_total(units).pow(1.0 / p)
