"""Sums whose bits depend on the values alone: every sum here follows the perfect binary tree
over its terms' index, so the same terms give the same bits whichever rank sums them and
however the work was cut (what `reproducible=True` rests on: `layerwise.reduction`'s ordered
reduction across ranks, `layerwise.accumulation`'s tree over micro-batches, `clip`'s norm).

Each level of a tree is one element-wise add of two views, so the result does not depend on
how many threads a reduction kernel would have used, nor on its vector width."""

from __future__ import annotations

import math

import torch
from torch import Tensor

#: the terms summed at once by `tree_power_sum` (float64: 32 MiB); a longer tensor is cut into
#: blocks of this many, which depends on its length alone
TREE_BLOCK = 2**22


def tree_sum_(rows: Tensor) -> Tensor:
    """Sum the rows of `rows` [n, ...] in place in the perfect binary tree over their index
    (n a power of two): ((r0 + r1) + (r2 + r3)) + ...; returns row 0, which holds the sum."""
    n = rows.shape[0]
    if n < 1 or n & (n - 1):
        raise ValueError(f"tree_sum_ needs a power-of-two number of rows, got {n}")
    step = 1
    while step < n:
        pairs = rows.view(n // (2 * step), 2 * step, *rows.shape[1:])
        pairs[:, 0].add_(pairs[:, step])
        step *= 2
    return rows[0]


def tree_total(values: Tensor) -> Tensor:
    """The sum of a 1-D `values` in the binary tree over the next power of two, zeros after
    the end (a 0-d tensor; 0 for none). `values` is not changed."""
    n = values.numel()
    size = 1 << max(0, math.ceil(math.log2(max(n, 1))))
    rows = torch.zeros(size, dtype=values.dtype, device=values.device)
    rows[:n] = values
    return tree_sum_(rows)


def tree_power_sum(t: Tensor, norm_type: float, dtype: torch.dtype) -> Tensor:
    """Σ |x|^p over the elements of `t` in `dtype` (max |x| for p = inf, which needs no
    order), in the binary tree over the flattened index: blocks of `TREE_BLOCK` terms, then
    the blocks' sums. A 0-d tensor."""
    x = t.detach().reshape(-1)
    if math.isinf(norm_type):
        return x.abs().max().to(dtype) if x.numel() else x.new_zeros((), dtype=dtype)
    blocks = []
    for start in range(0, max(x.numel(), 1), TREE_BLOCK):
        block = x[start : start + TREE_BLOCK].to(dtype).abs()
        blocks.append(tree_total(block.square() if norm_type == 2 else block.pow(norm_type)))
    return blocks[0] if len(blocks) == 1 else tree_total(torch.stack(blocks))
