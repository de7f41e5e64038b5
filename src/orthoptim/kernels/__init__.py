"""Symmetric products for Newton-Schulz: X·Xᵀ (`gram`) and b·A + c·A·A (`sym_poly`).

Both results are symmetric, so only one triangle needs computing. These entry points are
where the device/dtype dispatch lives; every caller goes through them.
"""

from __future__ import annotations

import torch
from torch import Tensor


def gram(X: Tensor) -> Tensor:
    """X·Xᵀ for a matrix or a batch [..., m, n] (result [..., m, m])."""
    return X @ X.mT


def sym_square(A: Tensor) -> Tensor:
    """A·A for a symmetric A (or a batch of them)."""
    return A @ A


def sym_poly(A: Tensor, b: float, c: float) -> Tensor:
    """b·A + c·A·A for a symmetric A (or a batch of them)."""
    if A.ndim == 2:
        return torch.addmm(A, A, A, beta=b, alpha=c)
    lead = A.shape[:-2]
    Af = A.reshape(-1, *A.shape[-2:])
    return torch.baddbmm(Af, Af, Af, beta=b, alpha=c).reshape(*lead, *A.shape[-2:])
