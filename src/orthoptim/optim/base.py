"""Pieces every orthoptim optimizer shares: parameter names, the non-finite gradient policy,
and the view of a parameter as a stack of matrices.
"""

from __future__ import annotations

import logging
import warnings
from collections.abc import Iterable

import torch
from torch import Tensor

logger = logging.getLogger("orthoptim")

NONFINITE_POLICIES = ("raise", "skip")


class NonFiniteGradientError(ValueError):
    """A gradient holds NaN or Inf under the `nonfinite="raise"` policy."""


def check_nonfinite_policy(policy: str) -> str:
    """Validate a `nonfinite` argument."""
    if policy not in NONFINITE_POLICIES:
        raise ValueError(f"nonfinite must be one of {NONFINITE_POLICIES}, got {policy!r}")
    return policy


def param_names(optimizer: torch.optim.Optimizer) -> dict[int, str]:
    """id(param) → a readable name: the name given at construction, else its group and index."""
    names: dict[int, str] = {}
    for gi, group in enumerate(optimizer.param_groups):
        given = group.get("param_names")
        for pi, p in enumerate(group["params"]):
            if given is not None:
                names[id(p)] = given[pi]
            else:
                names[id(p)] = f"param_groups[{gi}]['params'][{pi}] (shape {tuple(p.shape)})"
    return names


def nonfinite_params(params: Iterable[Tensor]) -> list[Tensor]:
    """The parameters whose gradient holds NaN or Inf (one device sync for all of them)."""
    with_grad = [p for p in params if p.grad is not None]
    if not with_grad:
        return []
    checks = [torch.isfinite(p.grad).all() for p in with_grad]
    # A sharded (DTensor) gradient's check is reduced over its mesh, so every rank agrees.
    checks = [c.full_tensor() if hasattr(c, "full_tensor") else c for c in checks]
    flags = torch.stack(checks).cpu()
    return [p for p, ok in zip(with_grad, flags.tolist()) if not ok]


def apply_nonfinite_policy(
    optimizer: torch.optim.Optimizer, policy: str, bad: list[Tensor]
) -> bool:
    """Raise or warn for `bad` parameters; returns True when the step must be skipped."""
    if not bad:
        return False
    names = param_names(optimizer)
    listed = ", ".join(names.get(id(p), f"shape {tuple(p.shape)}") for p in bad)
    if policy == "raise":
        raise NonFiniteGradientError(
            f"non-finite gradient (NaN or Inf) in {listed}; optimizer state and parameters are "
            "untouched. Pass nonfinite='skip' to skip such steps instead."
        )
    message = f"skipping optimizer step: non-finite gradient in {listed}"
    logger.warning(message)
    warnings.warn(message, RuntimeWarning, stacklevel=3)
    return True


def matrix_view(p: Tensor) -> Tensor:
    """A parameter seen as a stack of matrices [k, rows, cols].

    2-D → one matrix; 3-D [E, out, in] → E expert matrices; ≥4-D (conv) → one (out, rest)
    matrix. The view shares storage with `p`.
    """
    if p.ndim == 2:
        return p.unsqueeze(0)
    if p.ndim == 3:
        return p
    if p.ndim >= 4:
        return p.reshape(1, p.shape[0], -1)
    raise ValueError(
        f"a matrix optimizer needs a parameter with >= 2 dims, got shape {tuple(p.shape)}"
    )
