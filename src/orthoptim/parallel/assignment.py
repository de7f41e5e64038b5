"""Who owns which matrix: the cost model and the deterministic balancing of the layer-wise
distributed optimizer.

A model's trainable parameters become `Unit`s (a matrix, a vector, or a slice of the experts
of a 3-D parameter), listed in backward order. `assign` gives every unit one owner rank and
cuts the list into communication buckets (`make_buckets`). It is a pure function of its inputs, so
every rank (and the planner, for models nobody can run here) computes the same assignment.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from torch import Tensor, nn

from orthoptim.parallel import collectives as C

KINDS = ("muon", "soap", "adamw")
BALANCES = ("cost", "round_robin", "capped")
CAPPED_FACTOR = 1.3
SPREAD = 2.0


@dataclass(frozen=True)
class Unit:
    """One ownable piece of a model: a matrix, a vector, or a slice of a 3-D expert weight.

    `shape` is the piece's own global shape ([k, out, in] for k experts; a tensor-parallel
    DTensor's full matrix, so costs are the whole Newton-Schulz's), `nbytes` the bytes one
    rank holds and communicates (the largest local shard of a DTensor), `part`
    the expert slice [start, stop) along dim 0 of the parameter (None: the whole parameter).
    """

    name: str
    shape: tuple[int, ...]
    kind: str
    nbytes: int
    part: tuple[int, int] | None = None

    @property
    def numel(self) -> int:
        """Elements of the piece."""
        return math.prod(self.shape)

    @property
    def cost(self) -> float:
        """The piece's optimizer cost under `unit_cost`."""
        return unit_cost(self.shape, self.kind)


def _matrices(shape: tuple[int, ...]) -> tuple[int, int, int]:
    """(count, rows, cols) of the matrices a parameter of `shape` stands for (cf. matrix_view)."""
    if len(shape) == 2:
        return 1, shape[0], shape[1]
    if len(shape) == 3:
        return shape[0], shape[1], shape[2]
    return 1, shape[0], math.prod(shape[1:])


def unit_cost(shape: tuple[int, ...], kind: str) -> float:
    """Relative optimizer work for a piece of `shape` updated by `kind`.

    muon: Newton-Schulz ≈ max(m,n)·min(m,n)² per matrix; soap: m³ + n³ per matrix
    (eigenbasis refresh of both preconditioners); adamw and every <2-D piece: numel.
    3-D [E, m, n] is E matrices; ≥4-D (conv) is one (out, rest) matrix.
    """
    if kind not in KINDS:
        raise ValueError(f"unit kind must be one of {KINDS}, got {kind!r}")
    if kind == "adamw" or len(shape) < 2:
        return float(math.prod(shape))
    k, m, n = _matrices(tuple(shape))
    if kind == "muon":
        return float(k) * max(m, n) * min(m, n) ** 2
    return float(k) * (float(m) ** 3 + float(n) ** 3)


@dataclass
class Assignment:
    """Owner rank per unit, the resulting per-rank load, and the communication buckets."""

    owners: list[int]
    rank_cost: list[float]
    rank_bytes: list[int]
    buckets: list[list[int]]
    unit_bytes: list[int] = field(default_factory=list)
    balance: str = "cost"

    @property
    def world_size(self) -> int:
        """Number of ranks the units were dealt to."""
        return len(self.rank_cost)

    @property
    def imbalance(self) -> float:
        """max(rank_cost) / mean(rank_cost); 1.0 is perfect balance."""
        mean = sum(self.rank_cost) / len(self.rank_cost)
        return max(self.rank_cost) / mean if mean > 0 else 1.0

    def units_of(self, rank: int) -> list[int]:
        """Indices of the units `rank` owns, in input order."""
        return [i for i, r in enumerate(self.owners) if r == rank]

    def bucket_shard_bytes(self, bucket: int) -> list[int]:
        """Bytes each rank owns inside bucket `bucket` (its shard before padding)."""
        shard = [0] * self.world_size
        for i in self.buckets[bucket]:
            shard[self.owners[i]] += self.unit_bytes[i]
        return shard

    def padded_bytes(self) -> int:
        """Total bytes of the flat buckets the optimizer communicates: a bucket with several
        owners is N shards padded to its largest (what its reduce-scatter and all-gather
        move), a bucket with one owner is just its units (reduced to it, broadcast from it).
        """
        total = 0
        for b in range(len(self.buckets)):
            shard = self.bucket_shard_bytes(b)
            owners = sum(1 for x in shard if x)
            total += max(shard) * (self.world_size if owners > 1 else 1)
        return total

    def comm_bytes(self, rank: int, gather_ratio: float = 1.0) -> dict[str, tuple[float, float]]:
        """(sent, received) bytes per collective kind for `rank` in one step of the layer-wise
        optimizer, under collectives.py's ring accounting, for one parameter dtype.

        A bucket with several owners moves its padded flat once by reduce-scatter and once by
        all-gather; a bucket with one owner is reduced to it and broadcast from it.
        `gather_ratio` is gather bytes / parameter bytes (0.5 for a bf16 gather of fp32).
        The optimizer adds one all-reduce of 2 int32 flags per unit (`all_reduce`).
        """
        n = self.world_size
        out: dict[str, tuple[float, float]] = {}

        def add(kind: str, sent: float, received: float) -> None:
            s0, r0 = out.get(kind, (0.0, 0.0))
            out[kind] = (s0 + sent, r0 + received)

        if n == 1:
            return out
        for b in range(len(self.buckets)):
            shard = self.bucket_shard_bytes(b)
            owners = [r for r, x in enumerate(shard) if x > 0]
            if not owners:
                continue
            if len(owners) == 1:
                size = shard[owners[0]]
                add("reduce", *C.reduce_bytes(size, n, owners[0])[rank])
                add("broadcast", *C.broadcast_bytes(size * gather_ratio, n, owners[0])[rank])
            else:
                add("reduce_scatter", *C.ring_reduce_scatter_bytes([max(shard)] * n)[rank])
                g = max(shard) * gather_ratio
                add("all_gather", *C.ring_all_gather_bytes([g] * n)[rank])
        flags = C.ring_all_reduce_bytes(2 * len(self.owners) * 4, n)
        add("all_reduce", flags, flags)
        return out


def make_buckets(
    nbytes: Sequence[int], bucket_bytes: int, world_size: int = 1, spread: float = SPREAD
) -> list[list[int]]:
    """Cut units (in the given order) into buckets, listed by their first unit.

    A unit of at least `bucket_bytes` gets a bucket of its own (one owner: reduced to it and
    broadcast from it, nothing to pad) and does not interrupt the bucket being filled. The
    others fill contiguous runs (contiguous but for such big units) of up to
    max(bucket_bytes, spread × world_size × their largest unit), so that whole units can make
    N shards of nearly equal size: a greedy split pads by less than about 1 + 1/spread.
    """
    buckets: list[list[int]] = []
    current: list[int] = []
    size = largest = 0
    for i, b in enumerate(nbytes):
        if b >= bucket_bytes:
            buckets.append([i])
            continue
        cap = bucket_bytes
        if world_size > 1:
            cap = max(bucket_bytes, int(spread * world_size * max(largest, b)))
        if current and size + b > cap:
            buckets.append(current)
            current, size, largest = [], 0, 0
        current.append(i)
        size += b
        largest = max(largest, b)
    if current:
        buckets.append(current)
    buckets.sort(key=lambda bucket: bucket[0])
    return buckets


def _bucketed_lpt(
    costs: Sequence[float], nbytes: Sequence[int], buckets: list[list[int]], world_size: int
) -> list[int]:
    """Cost balancing that keeps every bucket's shards even.

    First the buckets of several units, in order: inside one, units go largest cost first,
    each to the least-loaded rank (total cost so far, then bytes, then rank) among those
    whose shard in this bucket stays within the bucket's current largest shard, or, when none
    can, to the rank with the smallest shard. Then the one-unit buckets (one owner, nothing
    to pad) fill the gaps longest-processing-time first. Deterministic: every rank computes
    the same owners.
    """
    owners = [0] * len(costs)
    load = [0.0] * world_size
    used = [0] * world_size

    def give(i: int, r: int) -> None:
        owners[i] = r
        load[r] += costs[i]
        used[r] += nbytes[i]

    for bucket in buckets:
        if len(bucket) == 1:
            continue
        shard = [0] * world_size
        for i in sorted(bucket, key=lambda i: (-costs[i], -nbytes[i], i)):
            top = max(shard)
            fits = [r for r in range(world_size) if shard[r] + nbytes[i] <= top]
            if fits:
                r = min(fits, key=lambda r: (load[r], used[r], r))
            else:
                r = min(range(world_size), key=lambda r: (shard[r], load[r], used[r], r))
            shard[r] += nbytes[i]
            give(i, r)
    solo = sorted((b[0] for b in buckets if len(b) == 1), key=lambda i: (-costs[i], -nbytes[i], i))
    heap = [(load[r], used[r], r) for r in range(world_size)]
    heapq.heapify(heap)
    for i in solo:
        _, _, r = heapq.heappop(heap)
        give(i, r)
        heapq.heappush(heap, (load[r], used[r], r))
    return owners


def _lpt(costs: Sequence[float], nbytes: Sequence[int], world_size: int) -> list[int]:
    """Longest-processing-time first: largest cost to the least-loaded rank.

    Ties are broken by (bytes, index) for units and (bytes, rank) for ranks, so the result is
    identical on every rank.
    """
    owners = [0] * len(costs)
    heap = [(0.0, 0, r) for r in range(world_size)]
    for i in sorted(range(len(costs)), key=lambda i: (-costs[i], -nbytes[i], i)):
        load, used, r = heapq.heappop(heap)
        owners[i] = r
        heapq.heappush(heap, (load + costs[i], used + nbytes[i], r))
    return owners


def _round_robin(nbytes: Sequence[int], world_size: int) -> list[int]:
    """Sort by size (largest first, stable) and deal the units to ranks 0, 1, …, N−1, 0, …"""
    owners = [0] * len(nbytes)
    for k, i in enumerate(sorted(range(len(nbytes)), key=lambda i: (-nbytes[i], i))):
        owners[i] = k % world_size
    return owners


def _capped(costs: Sequence[float], buckets: list[list[int]], world_size: int) -> list[int]:
    """A size-capped greedy per bucket: walk the bucket in order, filling one rank after the
    other, each up to CAPPED_FACTOR × the bucket's mean cost per rank; the next bucket starts
    at the rank after the last one used (wrapping), so one-unit buckets are dealt in turn.
    """
    owners = [0] * len(costs)
    start = 0
    for bucket in buckets:
        cap = CAPPED_FACTOR * sum(costs[i] for i in bucket) / world_size
        r, filled, load = start, 1, 0.0
        for i in bucket:
            if load > 0 and load + costs[i] > cap and filled < world_size:
                r, filled, load = (r + 1) % world_size, filled + 1, 0.0
            owners[i] = r
            load += costs[i]
        start = (r + 1) % world_size
    return owners


def assign(
    units: Sequence[Unit],
    world_size: int,
    balance: str = "cost",
    bucket_bytes: int = 25 * 2**20,
) -> Assignment:
    """Give every unit one owner rank among `world_size` and cut the units into buckets.

    balance: "cost" (balance `unit_cost` over ranks while keeping each bucket's shards even,
    see `_bucketed_lpt`), "round_robin" (size-sorted dealing, the simple baseline) or "capped"
    (fill ranks in order up to 1.3 × the mean cost per bucket). Buckets come from
    `make_buckets(…, bucket_bytes, world_size)`; ownership inside a bucket is free because the
    optimizer lays each bucket out rank by rank.
    """
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    if balance not in BALANCES:
        raise ValueError(f"balance must be one of {BALANCES}, got {balance!r}")
    if bucket_bytes <= 0:
        raise ValueError(f"bucket_bytes must be > 0, got {bucket_bytes}")
    costs = [unit_cost(u.shape, u.kind) for u in units]
    nbytes = [int(u.nbytes) for u in units]
    buckets = make_buckets(nbytes, bucket_bytes, world_size)
    if balance == "cost":
        owners = _bucketed_lpt(costs, nbytes, buckets, world_size)
    elif balance == "round_robin":
        owners = _round_robin(nbytes, world_size)
    else:
        owners = _capped(costs, buckets, world_size)
    rank_cost = [0.0] * world_size
    rank_bytes = [0] * world_size
    for i, r in enumerate(owners):
        rank_cost[r] += costs[i]
        rank_bytes[r] += nbytes[i]
    return Assignment(owners, rank_cost, rank_bytes, buckets, nbytes, balance)


RoutePredicate = Callable[[str, nn.Parameter], bool]


def units_from_model(
    model: nn.Module,
    optimizer: str = "muon",
    route: RoutePredicate | None = None,
    split_experts: bool | int = False,
) -> list[Unit]:
    """The units of `model` in backward order (reverse of registration), as the layer-wise
    optimizer owns them.

    Trainable parameters only; a tied parameter appears once, under its first name. `route`
    (default: `default_route(model)`) decides matrix optimizer (`optimizer`) vs AdamW, exactly
    as `build_optimizer` does. `split_experts` (True, or k experts per unit) turns each 3-D
    matrix-optimizer parameter [E, out, in] into expert slices with `part` set.
    """
    from orthoptim.optim.hybrid import default_route

    if optimizer not in KINDS:
        raise ValueError(f"optimizer must be one of {KINDS}, got {optimizer!r}")
    rule = route if route is not None else default_route(model)
    per = int(split_experts)
    if per < 0:
        raise ValueError(f"split_experts must be a bool or a positive int, got {split_experts}")
    units: list[Unit] = []
    for name, p in reversed(list(model.named_parameters())):
        if not p.requires_grad:
            continue
        kind = optimizer if optimizer != "adamw" and rule(name, p) else "adamw"
        shape = tuple(p.shape)
        if per and kind != "adamw" and p.ndim == 3:
            row_bytes = p[0].numel() * p.element_size()
            for start in range(0, shape[0], per):
                stop = min(start + per, shape[0])
                units.append(
                    Unit(
                        name,
                        (stop - start, *shape[1:]),
                        kind,
                        (stop - start) * row_bytes,
                        (start, stop),
                    )
                )
        else:
            units.append(Unit(name, shape, kind, math.prod(shard_shape(p)) * p.element_size()))
    return units


def shard_shape(p: Tensor) -> tuple[int, ...]:
    """The shape of the largest local shard of `p`: its own shape for a plain tensor; for a
    DTensor every Shard(d) placement divides dim d by its mesh dimension, rounding up (the
    torch.chunk rule). Computed from the global shape, so every rank gets the same answer.
    """
    shape = list(p.shape)
    mesh = getattr(p, "device_mesh", None)
    for mesh_dim, placement in enumerate(getattr(p, "placements", ())):
        dim = getattr(placement, "dim", None)
        if mesh is not None and dim is not None and placement.is_shard():
            shape[dim] = -(-shape[dim] // mesh.size(mesh_dim))
    return tuple(shape)
