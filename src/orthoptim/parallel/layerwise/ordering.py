"""The order of a bucket's slots in its flat buffers, and of a group's buckets: pure functions
of the slots' owners, sizes and places in their parameters."""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import Protocol, TypeVar

from orthoptim.parallel.assignment import MAX_PADDING
from orthoptim.parallel.layerwise.slots import Slot, start_of
from orthoptim.shards import local_shard


class _Unit(Protocol):
    unit: int


class _HasSlots(Protocol):
    @property
    def slots(self) -> Sequence[_Unit]: ...


B = TypeVar("B", bound=_HasSlots)


def rank_major_order(params: list[list[Slot]], n: int) -> tuple[list[Slot | int], int] | None:
    """The order of a bucket laid out rank by rank in equal shards (so one reduce-scatter and
    one all-gather serve it), with padding (ints, in elements) where a shard falls short, or
    None when that would pad more than `MAX_PADDING` or split a parameter.

    Shard r: the end of a sharded AdamW parameter whose run began on rank r-1, rank r's whole
    units, padding, then r's other runs (the last of which may go on into shard r+1)."""
    if n == 1:
        return None
    head: list[list[Slot]] = [[] for _ in range(n)]
    whole: list[list[Slot]] = [[] for _ in range(n)]
    tail: list[list[Slot]] = [[] for _ in range(n)]
    for ss in params:
        owners = [s.owner for s in ss]
        if all(s.flat is None for s in ss):
            if len(set(owners)) > 1:
                return None  # expert slices of several owners: not rank-major
            whole[owners[0]] += ss
            continue
        if owners != sorted(owners) or len(set(owners)) != len(owners):
            return None
        for k, s in enumerate(ss):
            (head if k > 0 else tail)[s.owner].append(s)
    for r in range(n):
        if len(head[r]) > 1:
            return None
    sizes = [sum(s.numel for s in head[r] + whole[r] + tail[r]) for r in range(n)]
    width = max(sizes)
    padding = n * width - sum(sizes)
    if padding > MAX_PADDING * sum(sizes):
        return None
    order: list[Slot | int] = []
    for r in range(n):
        order += head[r] + whole[r]
        if width > sizes[r]:
            order.append(width - sizes[r])
        order += tail[r]
    # every parameter's slots must lie back to back, in element order
    at = {}
    pos = 0
    for item in order:
        if isinstance(item, int):
            pos += item
            continue
        at[item] = pos
        pos += item.numel
    for ss in params:
        for x, y in itertools.pairwise(ss):
            if at[x] + x.numel != at[y]:
                return None
    return order, width


def natural_order(params: list[list[Slot]]) -> list[Slot | int]:
    """The order of a bucket reduced region by region, each parameter's slots back to back,
    no padding: first the parameter whose earlier slots are in the bucket before, last the
    one whose later slots are in the next (so that a parameter across buckets stays in one
    piece of the group's buffers), the others by the owners of their first and last slots
    (so a rank's runs join its whole units)."""

    def key(ss: list[Slot]) -> tuple[int, int, int]:
        end = start_of(ss[-1]) + ss[-1].numel
        place = 0 if start_of(ss[0]) > 0 else 2 if end < local_shard(ss[0].param).numel() else 1
        return place, ss[0].owner, ss[-1].owner

    return [s for ss in sorted(params, key=key) for s in ss]


def adjacent(buckets: list[B]) -> list[B]:
    """The order buckets take in their group's flat buffers: by first unit, except that a
    bucket whose units lie inside another's range (a unit of at least `bucket_mb` alone,
    `make_buckets`) goes after all the others, so that buckets continuing one another are
    adjacent and a parameter across them stays in one piece."""
    spans = sorted(
        ((min(s.unit for s in b.slots), max(s.unit for s in b.slots)), i)
        for i, b in enumerate(buckets)
    )
    outer: list[B] = []
    inner: list[B] = []
    reach = -1
    for (_, hi), i in spans:
        (inner if hi < reach else outer).append(buckets[i])
        reach = max(reach, hi)
    return outer + inner
