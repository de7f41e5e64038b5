"""Pieces of tensors, made without communication: the one DTensor test, a DTensor's local
shard, the shard sizes of DTensor's Shard placement, a local or full tensor laid out as
another DTensor, and the packed upper triangle of symmetric matrices (what
`all_reduce_symmetric` sends). Re-exported by `orthoptim.collectives`, whose `unshard`
gathers a DTensor whole."""

from __future__ import annotations

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


def pack_upper(A: Tensor) -> Tensor:
    """The upper triangle (diagonal included) of each symmetric [..., m, m] matrix, flattened."""
    m = A.shape[-1]
    rows, cols = torch.triu_indices(m, m, device=A.device)
    return A[..., rows, cols]


def unpack_upper(packed: Tensor, m: int) -> Tensor:
    """Rebuild the full symmetric [..., m, m] matrices from `pack_upper`'s output."""
    rows, cols = torch.triu_indices(m, m, device=packed.device)
    A = packed.new_zeros(*packed.shape[:-1], m, m)
    A[..., rows, cols] = packed
    A[..., cols, rows] = packed
    return A
