"""A parameter as a stack of matrices: the one rule every matrix optimizer, the cost model
and the checkpoint checks share (2-D: one matrix; 3-D [E, out, in]: E expert matrices; ≥4-D
conv weights: one (out, rest) matrix)."""

from __future__ import annotations

import math
from collections.abc import Sequence

from torch import Tensor


def stack_shape(shape: Sequence[int]) -> tuple[int, int, int]:
    """(count, rows, cols) of the matrices a parameter of `shape` (>= 2 dims) stands for."""
    if len(shape) == 2:
        return 1, shape[0], shape[1]
    if len(shape) == 3:
        return shape[0], shape[1], shape[2]
    if len(shape) >= 4:
        return 1, shape[0], math.prod(shape[1:])
    raise ValueError(
        f"a matrix optimizer needs a parameter with >= 2 dims, got shape {tuple(shape)}"
    )


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
