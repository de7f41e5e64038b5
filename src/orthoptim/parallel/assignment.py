"""Who owns which matrix: the cost model and the deterministic balancing of the layer-wise
distributed optimizer.

A model's trainable parameters become `Unit`s (a matrix, a vector, or a slice of the experts
of a 3-D parameter), listed in backward order. `assign` gives every unit one owner rank and
cuts the list into communication buckets (`make_buckets`). It is a pure function of its inputs, so
every rank (and the planner, for models nobody can run here) computes the same assignment.
The balancing algorithms themselves, on plain lists of costs and bytes, are `balancing`'s.
"""

from __future__ import annotations

import bisect
import dataclasses
import functools
import itertools
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal, get_args

import torch
from torch import Tensor, nn

from orthoptim import kernels
from orthoptim.comm_bytes import (
    broadcast_bytes,
    reduce_bytes,
    ring_all_gather_bytes,
    ring_all_reduce_bytes,
    ring_reduce_scatter_bytes,
)
from orthoptim.ns_cost import NS_STEPS, NSPath, ns_flops, ns_path
from orthoptim.optim.registry import (
    ELEMENTWISE_OPTIMIZERS,
    ELEMENTWISE_STATE,
    MATRIX_OPTIMIZERS,
    ElementwiseOptimizerName,
    OptimizerName,
    is_elementwise,
)
from orthoptim.optim.shapes import stack_shape
from orthoptim.parallel.balancing import CAPPED_FACTOR as CAPPED_FACTOR
from orthoptim.parallel.balancing import KINDS_PER_COST as KINDS_PER_COST
from orthoptim.parallel.balancing import MAX_IMPROVEMENTS as MAX_IMPROVEMENTS
from orthoptim.parallel.balancing import PAD_ALLOWANCE as PAD_ALLOWANCE
from orthoptim.parallel.balancing import RELEASE_GAIN as RELEASE_GAIN
from orthoptim.parallel.balancing import RELEASE_SLACK as RELEASE_SLACK
from orthoptim.parallel.balancing import (
    SPREAD,
    balance_cost,
    capped,
    count_movable,
    lower_bound,
    release_pinned,
    round_robin,
)
from orthoptim.parallel.balancing import SWAP_PARTNERS as SWAP_PARTNERS
from orthoptim.shards import is_dtensor

if TYPE_CHECKING:
    from orthoptim.optim.routing import RoutePredicate

KINDS = (*MATRIX_OPTIMIZERS, *ELEMENTWISE_OPTIMIZERS)
Balance = Literal["cost", "round_robin", "capped"]
BALANCES: tuple[Balance, ...] = get_args(Balance)
# Padding (bytes) a bucket laid out rank by rank in equal shards may carry, as a fraction of
# what it holds; a bucket that would need more is reduced to and broadcast from each owner
# (`Assignment.rank_major`).
MAX_PADDING = 0.02


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
        """The piece's optimizer cost under `unit_cost` (the GPU path)."""
        return unit_cost(self.shape, self.kind)


# the planner prices many matrices of few shapes
_shape_path = functools.lru_cache(maxsize=4096)(ns_path)


@dataclass(frozen=True)
class MatrixCost:
    """The optimizer work of a unit on the path its matrices really take: the one cost the
    balancing (`assign`), the planner's per-rank figures and the tensor-parallel model share.

    muon: Newton-Schulz flops on the `ns_path` of each matrix (`ns_flops`: SYRK, Gram form or
    plain matmul, by device, dtype and shape); soap: m³ + n³ per matrix (the eigenbasis
    refresh of both preconditioners); adamw and every <2-D piece: numel. 3-D [E, m, n] is E
    matrices; ≥4-D (conv) is one (out, rest) matrix. The default is the GPU path: CUDA,
    "auto" dtype (bf16), Triton SYRK, 5 steps; `for_device` describes a real device.
    """

    device: str = "cuda"
    dtype: torch.dtype | str = "auto"
    steps: int = NS_STEPS
    triton: bool = True
    kernel_mode: str = "auto"

    @classmethod
    def for_device(
        cls,
        device: torch.device | str,
        dtype: torch.dtype | str | None = "auto",
        steps: int = NS_STEPS,
    ) -> MatrixCost:
        """The path on `device` as this process would run it (Triton installed or not,
        `ORTHOPTIM_KERNELS`); `dtype` as Muon's `ns_dtype` (None: float32)."""
        dev = torch.device(device).type
        return cls(
            dev,
            torch.float32 if dtype is None else dtype,
            steps,
            dev == "cuda" and kernels.triton_available(),
            kernels.kernel_mode(),
        )

    def path(self, rows: int, cols: int) -> NSPath:
        """`ns_path` of one rows×cols matrix on this device."""
        return _shape_path(rows, cols, self.device, self.dtype, self.triton, self.kernel_mode)

    def flops(self, rows: int, cols: int) -> float:
        """Newton-Schulz flops of one rows×cols matrix on its path."""
        return ns_flops(rows, cols, self.steps, self.path(rows, cols))

    def of(self, shape: tuple[int, ...], kind: str) -> float:
        """The cost of a piece of `shape` updated by `kind`."""
        if kind not in KINDS:
            raise ValueError(f"unit kind must be one of {KINDS}, got {kind!r}")
        if is_elementwise(kind) or len(shape) < 2:
            return float(math.prod(shape))
        k, m, n = stack_shape(shape)
        if MATRIX_OPTIMIZERS[kind].work == "newton_schulz":
            return float(k) * self.flops(m, n)
        return float(k) * (float(m) ** 3 + float(n) ** 3)

    def __call__(self, unit: Unit) -> float:
        return self.of(unit.shape, unit.kind)


GPU_COST = MatrixCost()


def unit_cost(shape: tuple[int, ...], kind: str, cost: MatrixCost = GPU_COST) -> float:
    """Optimizer work for a piece of `shape` updated by `kind` (`MatrixCost.of`; default
    the GPU path)."""
    return cost.of(shape, kind)


@dataclass
class Assignment:
    """Owner rank per unit, the resulting per-rank load, and the communication buckets.

    `rank_cost` is the cost of the units each rank owns, `base` the load it already carried
    (another assignment's, e.g. dense weights under an expert group; empty: none), `bound` a
    lower bound on max(base + rank_cost) that no assignment of these units can beat.
    """

    owners: list[int]
    rank_cost: list[float]
    rank_bytes: list[int]
    buckets: list[list[int]]
    unit_bytes: list[int] = field(default_factory=list)
    balance: Balance = "cost"
    base: list[float] = field(default_factory=list)
    bound: float = 0.0
    # matrix-optimizer units with a choice of owner: alone in their bucket, or in one where
    # some rank has room for them without padding the bucket further (`count_movable`)
    movable: int = 0
    # AdamW units sharded element-wise (`deal_adamw`, owner -1): per bucket, the elements of
    # its AdamW units each rank holds ([] for a bucket without), and their element size
    adamw_split: list[list[int]] = field(default_factory=list)
    adamw_itemsize: list[int] = field(default_factory=list)

    @property
    def world_size(self) -> int:
        """Number of ranks the units were dealt to."""
        return len(self.rank_cost)

    @property
    def loads(self) -> list[float]:
        """base + rank_cost of every rank: the work it does."""
        if not self.base:
            return list(self.rank_cost)
        return [b + c for b, c in zip(self.base, self.rank_cost)]

    @property
    def imbalance(self) -> float:
        """max / mean of `loads` (the cost balancing's objective); 1.0 is perfect balance."""
        loads = self.loads
        mean = sum(loads) / len(loads)
        return max(loads) / mean if mean > 0 else 1.0

    @property
    def imbalance_bound(self) -> float:
        """The smallest imbalance any assignment of these units could reach by `bound`
        (> 1: the layout is lumpy, e.g. fewer units than ranks or one unit above the mean)."""
        loads = self.loads
        mean = sum(loads) / len(loads)
        return max(1.0, self.bound / mean) if mean > 0 else 1.0

    def units_of(self, rank: int) -> list[int]:
        """Indices of the units `rank` owns whole, in input order (sharded AdamW units, owner
        -1, are in no rank's list)."""
        return [i for i, r in enumerate(self.owners) if r == rank]

    def bucket_shard_bytes(self, bucket: int) -> list[int]:
        """Bytes each rank owns inside bucket `bucket` (its shard before padding): its
        whole units and its run of the bucket's sharded AdamW elements."""
        shard = [0] * self.world_size
        for i in self.buckets[bucket]:
            if self.owners[i] >= 0:
                shard[self.owners[i]] += self.unit_bytes[i]
        if self.adamw_split and self.adamw_split[bucket]:
            item = self.adamw_itemsize[bucket]
            shard = [s + x * item for s, x in zip(shard, self.adamw_split[bucket])]
        return shard

    def adamw_runs(self, bucket: int) -> dict[int, list[tuple[int, int, int]]]:
        """Each sharded AdamW unit of bucket `bucket` (its index) → (rank, lo, hi) of every
        rank's run of it, elements lo:hi of the unit: the bucket's AdamW units back to back,
        rank r holding the r-th `adamw_split[bucket]` elements."""
        split = self.adamw_split[bucket] if bucket < len(self.adamw_split) else []
        runs: dict[int, list[tuple[int, int, int]]] = {}
        if not split:
            return runs
        bounds = list(itertools.accumulate(split, initial=0))
        start = 0
        for i in self.buckets[bucket]:
            if self.owners[i] >= 0:
                continue
            numel = self.unit_bytes[i] // self.adamw_itemsize[bucket]
            for r in range(len(split)):
                lo, hi = max(start, bounds[r]), min(start + numel, bounds[r + 1])
                if lo < hi:
                    runs.setdefault(i, []).append((r, lo - start, hi - start))
            start += numel
        return runs

    def rank_major(self, bucket: int, units: Sequence[Unit] | None = None) -> bool:
        """Whether bucket `bucket` is laid out in N equal shards (one reduce-scatter, one
        all-gather): it has several owners, padding its shards to the largest costs at most
        `MAX_PADDING` of its bytes, and every parameter can stay in one piece: no sharded
        AdamW unit's run passes a rank that owns whole units or pads (between the first and
        the last rank holding it), and (given `units`, the units the assignment was made of)
        every parameter cut into expert slices here has all its slices here, of one owner.
        Otherwise each owner's region is reduced to it and broadcast from it, unpadded."""
        shard = self.bucket_shard_bytes(bucket)
        total = sum(shard)
        if sum(1 for x in shard if x) < 2 or len(shard) * max(shard) - total > MAX_PADDING * total:
            return False
        ids = self.buckets[bucket]
        whole = {self.owners[i] for i in ids if self.owners[i] >= 0}
        for runs in self.adamw_runs(bucket).values():
            # a rank between the first and the last holding it is all of it: no whole unit,
            # no padding
            if any(r in whole or shard[r] < max(shard) for r in range(runs[0][0] + 1, runs[-1][0])):
                return False
        if units is not None:
            here = set(ids)
            owner_of: dict[str, int] = {}
            for i in ids:
                if units[i].part is None:
                    continue
                # slices of one parameter are consecutive units: all of them here
                for j in (i - 1, i + 1):
                    if 0 <= j < len(units) and units[j].name == units[i].name and j not in here:
                        return False
                if owner_of.setdefault(units[i].name, self.owners[i]) != self.owners[i]:
                    return False
        return True

    def padded_bytes(self) -> int:
        """Total bytes of the flat buckets the optimizer communicates: a rank-major bucket
        is N shards padded to its largest (what its reduce-scatter and all-gather move),
        any other just its units."""
        total = 0
        for b in range(len(self.buckets)):
            shard = self.bucket_shard_bytes(b)
            total += max(shard) * self.world_size if self.rank_major(b) else sum(shard)
        return total

    def comm_bytes(self, rank: int, gather_ratio: float = 1.0) -> dict[str, tuple[float, float]]:
        """(sent, received) bytes per collective kind for `rank` in one step of the layer-wise
        optimizer, under `orthoptim.collectives`' ring accounting, for one parameter dtype.

        A rank-major bucket moves its padded flat once by reduce-scatter and once by
        all-gather; any other is reduced to and broadcast from each owner, region by region
        (pipelined chains, so every rank but the owner sends it, every rank but the owner's
        successor receives it, and the reverse for the broadcast). `gather_ratio` is gather bytes /
        parameter bytes (0.5 for a bf16 gather of fp32).
        The optimizer adds one all-reduce of an int32 flag per unit, one count of
        non-finite buckets and one of ranks refusing the step (`all_reduce`).
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
            if not self.rank_major(b):
                for o in owners:
                    add("reduce", *reduce_bytes(shard[o], n, o)[rank])
                    add("broadcast", *broadcast_bytes(shard[o] * gather_ratio, n, o)[rank])
            else:
                add("reduce_scatter", *ring_reduce_scatter_bytes([max(shard)] * n)[rank])
                g = max(shard) * gather_ratio
                add("all_gather", *ring_all_gather_bytes([g] * n)[rank])
        flags = ring_all_reduce_bytes((len(self.owners) + 2) * 4, n)  # + count, refusal
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


def assign(
    units: Sequence[Unit],
    world_size: int,
    balance: Balance = "cost",
    bucket_bytes: int = 25 * 2**20,
    cost: Callable[[Unit], float] | Sequence[float] | None = None,
    base: Sequence[float] | None = None,
    shard_adamw: bool = False,
    masters: bool = False,
    align_adamw: int | None = None,
) -> Assignment:
    """Give every unit one owner rank among `world_size` and cut the units into buckets.

    balance: "cost" minimises the busiest rank's load: `bucketed_lpt` (largest first, each
    bucket's shards kept even), then `local_search` (moves and swaps off the busiest rank
    that never grow a bucket's padding); round-robin's dealing, improved the same way, is
    kept instead whenever its busiest rank is lighter, so "cost" is never worse than
    "round_robin" on the cost it balances. Where even shards pin equal units (every rank
    the same number of them) and that keeps the busiest rank above the bound, `release_pinned`
    frees some into one-owner buckets. "round_robin": size-sorted dealing, the simple
    baseline. "capped": fill ranks in order up to 1.3 × the mean cost per bucket. Buckets come
    from `make_buckets(…, bucket_bytes, world_size)` (less what `release_pinned` frees); ownership
    inside a bucket is free because the optimizer lays each bucket out rank by rank.

    cost: a function of a unit (e.g. `MatrixCost.for_device(device)`) or the list of unit
    costs; default `unit_cost` on the GPU path. base: load every rank already carries (from
    another assignment), which the cost balancing fills around.

    shard_adamw: AdamW units get no owner (-1) but are sharded element-wise over all ranks
    (`deal_adamw`, levelling the optimizer state; `masters`: a master copy per owned element
    counts too); the balancing sees only the other units (buckets still hold every unit).
    align_adamw: every run starts and ends at a multiple of this many elements of its unit
    (or at the unit's end), as `reproducible=True` needs (`deal_adamw`).
    """
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    if balance not in BALANCES:
        raise ValueError(f"balance must be one of {BALANCES}, got {balance!r}")
    if bucket_bytes <= 0:
        raise ValueError(f"bucket_bytes must be > 0, got {bucket_bytes}")
    if cost is None:
        costs = [unit_cost(u.shape, u.kind) for u in units]
    elif callable(cost):
        costs = [float(cost(u)) for u in units]
    else:
        costs = [float(c) for c in cost]
        if len(costs) != len(units):
            raise ValueError(f"cost has {len(costs)} entries for {len(units)} units")
    base_load = [float(b) for b in base] if base is not None else []
    if base is not None and len(base_load) != world_size:
        raise ValueError(f"base has {len(base_load)} entries for world_size {world_size}")
    nbytes = [int(u.nbytes) for u in units]
    buckets = make_buckets(nbytes, bucket_bytes, world_size)
    if shard_adamw:  # dealt element-wise afterwards (`deal_adamw`): no weight in the balancing
        costs = [0.0 if is_elementwise(u.kind) else c for u, c in zip(units, costs)]
        nbytes = [0 if is_elementwise(u.kind) else b for u, b in zip(units, nbytes)]
    if balance == "cost":
        owners = balance_cost(costs, nbytes, buckets, world_size, base_load)
        owners, buckets = release_pinned(
            costs, nbytes, bucket_bytes, buckets, owners, world_size, base_load
        )
    elif balance == "round_robin":
        owners = round_robin(nbytes, world_size)
    else:
        owners = capped(costs, buckets, world_size)
    rank_cost = [0.0] * world_size
    rank_bytes = [0] * world_size
    for i, r in enumerate(owners):
        rank_cost[r] += costs[i]
        rank_bytes[r] += nbytes[i]
    bound = lower_bound(costs, world_size, base_load, buckets, nbytes, owners)
    a = Assignment(owners, rank_cost, rank_bytes, buckets, nbytes, balance, base_load, bound)
    matrix = [not is_elementwise(u.kind) and c > 0 for u, c in zip(units, costs)]
    a.movable = count_movable(matrix, nbytes, buckets, owners, world_size)
    if shard_adamw:
        a.owners = [-1 if is_elementwise(u.kind) else o for u, o in zip(units, owners)]
        return deal_adamw(units, a, masters, align_adamw)
    return a


def units_from_model(
    model: nn.Module,
    optimizer: OptimizerName = "muon",
    route: RoutePredicate | None = None,
    split_experts: bool | int = False,
    elementwise: ElementwiseOptimizerName = "adamw",
) -> list[Unit]:
    """The units of `model` in backward order (reverse of registration), as the layer-wise
    optimizer owns them.

    Trainable parameters only; a tied parameter appears once, under its first name. `route`
    (default: `default_route(model)`) decides matrix optimizer (`optimizer`) vs AdamW, exactly
    as `build_optimizer` does; the rest are units of `elementwise` ("adamw" or "lion", as
    `build_optimizer(elementwise=...)`). `split_experts` (True, or k experts per unit) turns each
    matrix-optimizer parameter the model declares an expert stack [E, out, in] (see
    `orthoptim.optim.routing`; being 3-D is not enough) into expert slices with `part` set.
    """
    from orthoptim.optim.routing import ModelRoute

    if optimizer not in KINDS:
        raise ValueError(f"optimizer must be one of {KINDS}, got {optimizer!r}")
    default = route if isinstance(route, ModelRoute) else ModelRoute(model)
    rule = route if route is not None else default
    per = int(split_experts)
    if per < 0:
        raise ValueError(f"split_experts must be a bool or a positive int, got {split_experts}")
    units: list[Unit] = []
    for name, p in reversed(list(model.named_parameters())):
        if not p.requires_grad:
            continue
        kind = optimizer if optimizer != "adamw" and rule(name, p) else elementwise
        shape = tuple(p.shape)
        if per and not is_elementwise(kind) and default.is_expert(name, p):
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
    if not is_dtensor(p):
        return tuple(shape)
    for mesh_dim, placement in enumerate(p.placements):
        if placement.is_shard():
            shape[placement.dim] = -(-shape[placement.dim] // p.device_mesh.size(mesh_dim))
    return tuple(shape)


# -- AdamW sharded element-wise (ZeRO-1 inside the layer-wise buckets) -------------------------
# AdamW is element-wise, so its units need no single owner: `assign(..., shard_adamw=True)`
# balances the whole-owned units (Muon / SOAP matrices) alone, then `deal_adamw` gives every
# rank a run of the AdamW elements of each bucket. Rank r's shard of a bucket is then its
# whole units followed by its AdamW run; how many AdamW elements each rank gets levels the
# optimizer state per rank (`state_numel`), not the element count.
# Uneven runs pad the AdamW buckets' collectives, so the runs are as even as they can be while
# every rank's state stays within STATE_SLACK of the mean (or, where the whole-owned units
# leave no such room, as level as it gets).
STATE_SLACK = 0.01


def state_numel(unit: Unit, masters: bool = False) -> int:
    """Optimizer-state elements of a unit owned whole (an estimate for levelling, in elements
    of its dtype): the matrix optimizer's `state_numel` (Muon's momentum; SOAP's two moments
    plus, per matrix, a Kronecker factor and an eigenbasis of each side), AdamW's two moments.
    `masters` adds the master copy a `gather_dtype` run keeps of every owned element."""
    numel = unit.numel
    if is_elementwise(unit.kind):
        state = ELEMENTWISE_STATE[unit.kind] * numel
    elif len(unit.shape) < 2:
        state = 2 * numel
    else:
        state = MATRIX_OPTIMIZERS[unit.kind].state_numel(unit.shape)
    return state + (numel if masters else 0)


def water_fill(base: Sequence[int], cap: Sequence[int], total: int) -> list[int]:
    """Integers x_r with 0 ≤ x_r ≤ cap_r and Σ x_r = total (≤ Σ cap_r) that minimise
    max_r(base_r + x_r): the lowest ranks are filled first, up to a common level; the last
    few elements go to the lowest-numbered ranks at that level. Deterministic."""
    if total > sum(cap):
        raise ValueError(f"water_fill: {total} elements exceed the caps' {sum(cap)}")
    if total <= 0:
        return [0] * len(base)

    def filled(level: int) -> int:
        return sum(min(c, max(0, level - b)) for b, c in zip(base, cap))

    lo, hi = min(base), max(b + c for b, c in zip(base, cap))
    while lo < hi:  # the smallest level that holds `total`
        mid = (lo + hi) // 2
        if filled(mid) >= total:
            hi = mid
        else:
            lo = mid + 1
    x = [min(c, max(0, lo - 1 - b)) for b, c in zip(base, cap)]
    extra = total - sum(x)
    for r in range(len(x)):
        if extra == 0:
            break
        if x[r] < cap[r] and base[r] + x[r] < lo:
            x[r] += 1
            extra -= 1
    return x


def settled(quota: list[int]) -> list[int]:
    """`quota` with no rank below zero and the same total: what an aligned run took beyond a
    rank's quota comes off the largest quotas, one element at a time in effect (levelled
    from the top, lowest-numbered rank first among equals). Deterministic."""
    deficit = -sum(q for q in quota if q < 0)
    out = [max(0, q) for q in quota]
    while deficit > 0:
        top = max(out)
        rest = max([q for q in out if q < top], default=0)
        at_top = [r for r, q in enumerate(out) if q == top]
        take = min(deficit, (top - rest) * len(at_top))
        for k, r in enumerate(at_top):
            out[r] -= take // len(at_top) + (1 if k < take % len(at_top) else 0)
        deficit -= take
    return out


def aligned_split(split: list[int], numels: list[int], align: int) -> list[int]:
    """`split` (elements per rank of units of `numels` elements back to back) with each
    boundary between two ranks moved to the nearest multiple of `align` elements of the unit
    it falls in (or that unit's end): a rank's run then covers whole blocks of `align`."""
    starts = list(itertools.accumulate(numels, initial=0))
    bounds = list(itertools.accumulate(split, initial=0))
    moved = []
    for c in bounds[1:-1]:
        u = max(0, bisect.bisect_right(starts, c) - 1)
        if u >= len(numels):
            moved.append(c)
            continue
        offset = min(numels[u], align * round((c - starts[u]) / align))
        moved.append(starts[u] + offset)
    edges = [bounds[0], *moved, bounds[-1]]
    return [hi - lo for lo, hi in itertools.pairwise(edges)]


def deal_adamw(
    units: Sequence[Unit], a: Assignment, masters: bool = False, align: int | None = None
) -> Assignment:
    """`a` with every AdamW unit sharded element-wise over all ranks (owner -1) instead of
    owned whole. `adamw_split[b][r]` is how many elements of bucket b's AdamW units (taken
    back to back in unit order) rank r holds: rank 0 the first run, rank 1 the next, and so on.

    The runs level the optimizer state: each rank's quota of AdamW elements is as even as it
    can be while no rank's state (whole-owned units by `state_numel`, with `masters`, plus
    two moments per AdamW element) exceeds the mean by more than STATE_SLACK; when the whole
    units leave no such room, the quotas fill the ranks with the least whole-owned state up
    to a common level. Each bucket is then dealt in order, water-filling its shards (whole
    units + AdamW run) within the ranks' remaining quotas, so AdamW elements fill the gaps
    the whole units leave before they pad a bucket. With no whole-owned units (or equal
    ones) this is ZeRO-1: ⌈S/N⌉ or ⌊S/N⌋ elements of every bucket per rank. `align`: each
    boundary between two ranks' runs moved to the nearest multiple of `align` elements of the
    unit it falls in, or to that unit's end (`aligned_split`).
    """
    n = a.world_size
    sharded = [is_elementwise(u.kind) for u in units]
    owners = [-1 if s else o for s, o in zip(sharded, a.owners)]
    unit_bytes = [int(u.nbytes) for u in units]
    per_elem = 2 + int(masters)
    whole_state = [0] * n
    for i, u in enumerate(units):
        if not sharded[i]:
            whole_state[owners[i]] += state_numel(u, masters)
    total = sum(u.numel for u, s in zip(units, sharded) if s)
    mean = (sum(whole_state) + per_elem * total) / n
    room = [max(0, int((1 + STATE_SLACK) * mean - w) // per_elem) for w in whole_state]
    if sum(room) >= total:
        quota = water_fill([0] * n, room, total)
    else:
        quota = water_fill([w // per_elem for w in whole_state], [total] * n, total)
    split: list[list[int]] = []
    itemsize: list[int] = []
    for bucket in a.buckets:
        region = [i for i in bucket if sharded[i]]
        size = sum(units[i].numel for i in region)
        if not size:
            split.append([])
            itemsize.append(0)
            continue
        item = max(1, unit_bytes[region[0]] // max(1, units[region[0]].numel))
        shard = [0] * n
        for i in bucket:
            if not sharded[i]:
                shard[owners[i]] += unit_bytes[i]
        x = water_fill([s // item for s in shard], quota, size)
        if align is not None:
            x = aligned_split(x, [units[i].numel for i in region], align)
        quota = settled([q - y for q, y in zip(quota, x)])
        split.append(x)
        itemsize.append(item)
    # rank_cost: the whole units' cost (that of sharded units taken out) + AdamW elements
    held_before = [sum(s[r] for s in a.adamw_split if s) for r in range(n)]
    held = [sum(s[r] for s in split if s) for r in range(n)]
    whole_cost = list(a.rank_cost)
    for i, o in enumerate(a.owners):
        if sharded[i] and o >= 0:
            whole_cost[o] -= unit_cost(units[i].shape, units[i].kind)
    rank_cost = [c - hb + h for c, hb, h in zip(whole_cost, held_before, held)]
    rank_bytes = [0] * n
    for i, o in enumerate(owners):
        if o >= 0:
            rank_bytes[o] += unit_bytes[i]
    for s, item in zip(split, itemsize):
        for r, x in enumerate(s):
            rank_bytes[r] += x * item
    return dataclasses.replace(
        a,
        owners=owners,
        rank_cost=rank_cost,
        rank_bytes=rank_bytes,
        unit_bytes=unit_bytes,
        adamw_split=split,
        adamw_itemsize=itemsize,
    )
