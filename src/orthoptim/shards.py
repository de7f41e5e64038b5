"""Pieces of tensors, made without communication: the one DTensor test, a DTensor's local
shard, the shard sizes of DTensor's Shard placement, a local or full tensor laid out as
another DTensor, and the packed upper triangle of symmetric matrices (what
`all_reduce_symmetric` sends). Re-exported by `orthoptim.collectives`, whose `unshard`
gathers a DTensor whole."""

from __future__ import annotations

import functools
import itertools
from typing import Any

import torch
from torch import Tensor


def is_dtensor(t: Any) -> bool:
    """True for a torch.distributed.tensor.DTensor (sharded or replicated over a mesh): the one
    DTensor test of the package."""
    return isinstance(t, Tensor) and hasattr(t, "device_mesh") and hasattr(t, "to_local")


def local_shard(t: Tensor) -> Tensor:
    """The local shard of a DTensor (a plain tensor is its own shard); shares storage."""
    return t.to_local() if is_dtensor(t) else t


def shard_sizes(size: int, world_size: int) -> list[int]:
    """Sizes of the `world_size` shards of a dimension of `size` under DTensor's Shard (the
    torch.chunk rule): chunks of ceil(size / N), so trailing ranks may hold less or nothing."""
    full = -(-size // world_size) if size else 0
    return [max(0, min(full, size - r * full)) for r in range(world_size)]


def wrap_local(local: Tensor, like: Tensor) -> Tensor:
    """`local` as THIS rank's shard of a DTensor laid out as `like` (mesh, placements, global
    shape); `local` itself when `like` is a plain tensor. No communication, no copy."""
    if not is_dtensor(like):
        return local
    from torch.distributed.tensor import DTensor

    return DTensor.from_local(
        local, like.device_mesh, like.placements, run_check=False, shape=like.shape,
        stride=like.stride(),
    )  # fmt: skip


def cut_like(full: Tensor, like: Tensor) -> Tensor:
    """The full tensor `full`, which every rank holds, cut into a DTensor laid out as `like`
    (each rank keeps its shard): no communication. A plain `like` gives `full` back."""
    if not is_dtensor(like):
        return full
    from torch.distributed.tensor import distribute_tensor

    return distribute_tensor(full, like.device_mesh, like.placements, src_data_rank=None)


def packed_triangle_size(m: int) -> int:
    """Elements of the packed upper triangle of an m×m symmetric matrix: m(m+1)/2."""
    return m * (m + 1) // 2


TRIANGLE_BLOCK = 128  # rows per block of the packed triangle's layout (`triangle_blocks`)


def triangle_blocks(m: int, nblocks: int | None = None) -> list[tuple[int, int]]:
    """Row blocks [(start, stop), ...] of an m×m matrix that `pack_upper` lays its triangle out
    by: `nblocks` near-equal ones, or blocks of about TRIANGLE_BLOCK rows when None."""
    n = max(1, min(m, -(-m // TRIANGLE_BLOCK) if nblocks is None else nblocks))
    bounds = [round(i * m / n) for i in range(n + 1)]
    return [(a, b) for a, b in itertools.pairwise(bounds) if b > a]


def triangle_block_size(start: int, stop: int, m: int) -> int:
    """Elements block rows start..stop−1 hold in the packed triangle: the upper triangle of
    their diagonal block and the whole rectangle right of it."""
    h = stop - start
    return h * (h + 1) // 2 + h * (m - stop)


@functools.lru_cache(maxsize=64)
def _triangle_index(h: int, device: torch.device) -> Tensor:
    rows, cols = torch.triu_indices(h, h, device=device)
    return rows * h + cols


def pack_block_row(rows: Tensor) -> Tensor:
    """One row block's part of `pack_upper`: `rows` is [..., h, w], block rows a..a+h−1 of the
    matrix from column a on (A[..., a:a+h, a:]); the upper triangle of its first h columns,
    then the rest, flattened."""
    h, w = rows.shape[-2], rows.shape[-1]
    lead = rows.shape[:-2]
    diag = rows[..., :h].reshape(*lead, h * h).index_select(-1, _triangle_index(h, rows.device))
    return torch.cat([diag, rows[..., h:].reshape(*lead, h * (w - h))], dim=-1)


def pack_upper(A: Tensor, blocks: list[tuple[int, int]] | None = None) -> Tensor:
    """The upper triangle (diagonal included) of each symmetric [..., m, m] matrix, m(m+1)/2
    elements: per row block of `blocks` (`triangle_blocks(m)` by default) the triangle of its
    diagonal block, then the rectangle right of it. Contiguous copies and one small gather per
    block, so packing costs about one read of the triangle."""
    blocks = blocks if blocks is not None else triangle_blocks(A.shape[-1])
    return torch.cat([pack_block_row(A[..., a:b, a:]) for a, b in blocks], dim=-1)


def unpack_upper(packed: Tensor, m: int, blocks: list[tuple[int, int]] | None = None) -> Tensor:
    """Rebuild the full symmetric [..., m, m] matrices from `pack_upper`'s output (the same
    `blocks`): each rectangle written once in place and once transposed below the diagonal."""
    lead = packed.shape[:-1]
    A = packed.new_empty(*lead, m, m)
    at = 0
    for a, b in blocks if blocks is not None else triangle_blocks(m):
        h, w = b - a, m - b
        tri = packed.narrow(-1, at, h * (h + 1) // 2)
        diag = packed.new_zeros(*lead, h * h)
        diag.index_copy_(-1, _triangle_index(h, packed.device), tri)
        diag = diag.view(*lead, h, h)
        A[..., a:b, a:b] = diag + diag.mT.tril(-1)
        rect = packed.narrow(-1, at + tri.shape[-1], h * w).view(*lead, h, w)
        A[..., a:b, b:] = rect
        A[..., b:, a:b] = rect.mT
        at += triangle_block_size(a, b, m)
    return A
