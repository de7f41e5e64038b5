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

#: the elements of one block of a norm (`block_power_sums`): the sharded AdamW runs of
#: `reproducible=True` start and end on these blocks (`assignment.deal_adamw`'s `align`)
NORM_BLOCK = 2**16
#: the elements a norm's tree works on at once (float64: 8 MiB, the most it holds)
NORM_CHUNK = 2**20


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


def block_power_sums(t: Tensor, norm_type: float, dtype: torch.dtype, block: int) -> Tensor:
    """Σ |x|^p of each `block` consecutive elements of `t` flattened (a power of two; the
    last block short, zeros after its end), each in the binary tree over its positions
    (halving: element i with i + half), in `dtype`; max |x| per block for p = inf, which
    needs no order. One entry per block (none for an empty `t`)."""
    x = t.detach().reshape(-1)
    n, b = x.numel(), block
    blocks = -(-n // b)
    out = torch.zeros(blocks, dtype=dtype, device=x.device)
    per = max(1, NORM_CHUNK // b)
    for first in range(0, blocks, per):
        last = min(blocks, first + per)
        rows = torch.zeros((last - first) * b, dtype=dtype, device=x.device)
        piece = x[first * b : min(n, last * b)]
        rows[: piece.numel()] = piece
        rows = rows.abs_().view(last - first, b)
        if math.isinf(norm_type):
            out[first:last] = rows.amax(dim=1)
            continue
        rows.square_() if norm_type == 2 else rows.pow_(norm_type)
        width = b
        while width > 1:  # in place: one chunk is all the sum holds
            width //= 2
            rows[:, :width].add_(rows[:, width : 2 * width])
        out[first:last] = rows[:, 0]
    return out


def tree_power_sum(
    t: Tensor, norm_type: float, dtype: torch.dtype, block: int = NORM_BLOCK
) -> Tensor:
    """Σ |x|^p over the elements of `t` (max |x| for p = inf): its `block_power_sums` summed
    in the binary tree over the block index. A 0-d tensor in `dtype`."""
    blocks = block_power_sums(t, norm_type, dtype, block)
    if math.isinf(norm_type):
        return blocks.max() if blocks.numel() else blocks.new_zeros(())
    return tree_total(blocks)
