"""Recursive blocked SYRK over torch matmuls: beta·C + alpha·X·Xᵀ computing one triangle.

The rows of X split in two: the two diagonal blocks recurse, the off-diagonal block is one
general matmul, and its transpose is mirrored. Recursing until blocks have at most `leaf`
rows does m²n·(1/2 + 1/2^levels) multiply-adds instead of m²n, while every product stays
large enough for the BLAS to run near its peak.
"""

from __future__ import annotations

import torch
from torch import Tensor

# Diagonal blocks of at most this many rows use one plain product (measured on 2 AVX2 cores,
# 1 thread: 128 rows beat 256 by 3–5 % and 768 by 30–45 % for 768–1024-row Grams and sym_polys).
LEAF_ROWS = 128
# Split points are rounded to a multiple of this many rows so blocks stay SIMD-aligned.
ALIGN = 32


def product(
    X1: Tensor,
    X2: Tensor,
    C: Tensor | None,
    beta: float,
    alpha: float,
    out: Tensor | None = None,
) -> Tensor:
    """beta·C + alpha·X1·X2ᵀ for 2-D or 3-D operands (C None: alpha·X1·X2ᵀ), into `out` when
    given: the one general product the symmetric kernels and Newton-Schulz build on."""
    if C is None:
        res = torch.matmul(X1, X2.mT, out=out)
        return res if alpha == 1.0 else res.mul_(alpha)
    if X1.ndim == 2:
        return torch.addmm(C, X1, X2.mT, beta=beta, alpha=alpha, out=out)
    return torch.baddbmm(C, X1, X2.mT, beta=beta, alpha=alpha, out=out)


def syrk_matmul(
    X: Tensor, C: Tensor | None = None, beta: float = 0.0, alpha: float = 1.0
) -> Tensor:
    """beta·C + alpha·X·Xᵀ by one general product (the reference path), [..., m, n] input."""
    if X.ndim == 2:
        return product(X, X, C, beta, alpha)
    lead = X.shape[:-2]
    X3 = X.flatten(0, -3) if X.ndim > 2 else X  # not reshape(-1, ...): an empty X
    C3 = C.flatten(0, -3) if C is not None and C.ndim > 2 else C
    out = product(X3, X3, C3, beta, alpha)
    return out.reshape(*lead, X.shape[-2], X.shape[-2])


def _blocked_into(
    X: Tensor,
    Y: Tensor,
    C: Tensor | None,
    beta: float,
    alpha: float,
    leaf: int,
    out: Tensor,
) -> None:
    """Fill `out` (a row-major view, so BLAS writes into it directly) with beta·C + alpha·X·Yᵀ,
    a product known to be symmetric (Y is X for a SYRK)."""
    m = X.shape[-2]
    if m <= leaf:
        product(X, Y, C, beta, alpha, out=out)
        return
    h = min(m - 1, (m // 2 + ALIGN - 1) // ALIGN * ALIGN)
    C11 = C21 = C22 = None
    if C is not None:
        C11, C21, C22 = C[..., :h, :h], C[..., h:, :h], C[..., h:, h:]
    _blocked_into(X[..., :h, :], Y[..., :h, :], C11, beta, alpha, leaf, out[..., :h, :h])
    _blocked_into(X[..., h:, :], Y[..., h:, :], C22, beta, alpha, leaf, out[..., h:, h:])
    product(X[..., h:, :], Y[..., :h, :], C21, beta, alpha, out=out[..., h:, :h])
    out[..., :h, h:] = out[..., h:, :h].mT


def syrk(
    X: Tensor,
    C: Tensor | None = None,
    beta: float = 0.0,
    alpha: float = 1.0,
    leaf: int | None = None,
) -> Tensor:
    """beta·C + alpha·X·Xᵀ for X [..., m, n] and symmetric C [..., m, m] (or None).

    Diagonal blocks of at most `leaf` rows (default LEAF_ROWS) use one plain product.
    C must be symmetric: its blocks above the diagonal are never read, the result's are the
    mirror of those below.
    """
    leaf = LEAF_ROWS if leaf is None else leaf
    if leaf < 1:
        raise ValueError(f"leaf must be a positive number of rows, got {leaf}")
    lead = X.shape[:-2]
    X3 = X.flatten(0, -3) if X.ndim > 2 else X  # not reshape(-1, ...): an empty X
    C3 = C.flatten(0, -3) if C is not None and C.ndim > 2 else C
    out = X3.new_empty((*X3.shape[:-1], X3.shape[-2]))
    _blocked_into(X3, X3, C3, beta, alpha, leaf, out)
    return out.reshape(*lead, X.shape[-2], X.shape[-2])


def sym_matmul(P: Tensor, S: Tensor, leaf: int | None = None) -> Tensor:
    """P·S for 2-D or 3-D P [..., m, k], S [..., k, m] whose product is known to be symmetric
    (e.g. two commuting symmetric matrices): the blocks below the diagonal are computed, the
    ones above are their mirror. `leaf` as in `syrk`."""
    out = P.new_empty((*P.shape[:-1], P.shape[-2]))
    _blocked_into(P, S.mT, None, 0.0, 1.0, LEAF_ROWS if leaf is None else leaf, out)
    return out
