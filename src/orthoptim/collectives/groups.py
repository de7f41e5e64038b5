"""Ranks in a process group: this rank and the group's size, and the translation between a
group's ranks and the global ranks torch.distributed takes as a root."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch.distributed as dist

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup


def world(group: ProcessGroup | None = None) -> tuple[int, int]:
    """(rank, world size) in `group`; (0, 1) when torch.distributed is not initialised."""
    if not dist.is_available() or not dist.is_initialized():
        return 0, 1
    return dist.get_rank(group), dist.get_world_size(group)


def group_rank(group: ProcessGroup | None, global_rank: int) -> int:
    """The rank in `group` of `global_rank` (what broadcast / reduce take as src / dst)."""
    if group is None or not dist.is_initialized():
        return global_rank
    return dist.get_group_rank(group, global_rank)


def global_rank(group: ProcessGroup | None, group_rank: int) -> int:
    """The global rank of `group_rank` in `group` (what broadcast / reduce take as src / dst)."""
    if group is None or not dist.is_initialized():
        return group_rank
    return dist.get_global_rank(group, group_rank)
