"""Who owns which matrix: the cost model and the deterministic balancing of the layer-wise
distributed optimizer.

A model's trainable parameters become `Unit`s (a matrix, a vector, or a slice of the experts
of a 3-D parameter), listed in backward order. `assign` gives every unit one owner rank and
cuts the list into communication buckets (`make_buckets`). It is a pure function of its inputs, so
every rank (and the planner, for models nobody can run here) computes the same assignment.
"""

from __future__ import annotations

import bisect
import dataclasses
import functools
import heapq
import itertools
import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal, get_args

import torch
from torch import Tensor, nn

from orthoptim import collectives as C
from orthoptim import kernels
from orthoptim.newton_schulz import GRAM_FORM_RESTART
from orthoptim.optim.registry import (
    ELEMENTWISE_OPTIMIZERS,
    ELEMENTWISE_STATE,
    MATRIX_OPTIMIZERS,
    ElementwiseOptimizerName,
    OptimizerName,
    is_elementwise,
)
from orthoptim.optim.shapes import stack_shape

if TYPE_CHECKING:
    from orthoptim.optim.routing import RoutePredicate

KINDS = (*MATRIX_OPTIMIZERS, *ELEMENTWISE_OPTIMIZERS)
Balance = Literal["cost", "round_robin", "capped"]
BALANCES: tuple[Balance, ...] = get_args(Balance)
CAPPED_FACTOR = 1.3
SPREAD = 2.0
NS_STEPS = 5
# Local search after the greedy: how many of the lightest ranks a swap may pair the busiest
# rank with, and at most how many moves or swaps it makes (each lowers the sum of squared
# loads, so it ends anyway).
SWAP_PARTNERS = 32
MAX_IMPROVEMENTS = 20_000
KINDS_PER_COST = 8  # units of one cost in different shared buckets a rank offers per step
# Freeing units pinned by even bucket shards (`_release`): stop within this much of the bound,
# and only keep a layout that lowers the busiest rank by at least RELEASE_GAIN.
RELEASE_SLACK = 0.01
RELEASE_GAIN = 0.001
# Padding (padded / unpadded bytes) make_buckets sizes buckets for: "about 1 + 1/spread"
PAD_ALLOWANCE = 1 + 1 / SPREAD
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


_DTYPES = {
    "bf16": torch.bfloat16,
    "bfloat16": torch.bfloat16,
    "fp16": torch.float16,
    "float16": torch.float16,
    "fp32": torch.float32,
    "float32": torch.float32,
    "fp64": torch.float64,
    "float64": torch.float64,
}
_SYRK_DTYPES = {
    "cpu": (torch.float32, torch.float64),
    "cuda": (torch.float16, torch.bfloat16, torch.float32),
}
_GRAM_DTYPES = (torch.float32, torch.float64)


@functools.lru_cache(maxsize=4096)
def ns_path(
    rows: int,
    cols: int,
    device: str = "cuda",
    dtype: torch.dtype | str = "auto",
    triton: bool = True,
    kernel_mode: str = "auto",
) -> tuple[str, str]:
    """(form, backend) that `newton_schulz` takes for one rows×cols matrix, from its shape.

    form: "step" (the plain iteration) or "gram" (`newton_schulz_gram_form`, for wide
    float32/float64 matrices); backend: "matmul", "cpu_syrk" or "triton", as
    `kernels.backend_for` / `kernels.gram_form_pays` decide on a tensor (tested equal).
    `dtype` is the iteration's dtype ("auto": bf16 on CUDA, fp32 elsewhere, Muon's default);
    `triton`: whether Triton is installed on a CUDA device; `kernel_mode` "matmul" is
    `ORTHOPTIM_KERNELS=matmul` (plain matmul everywhere).
    """
    m, n = sorted((int(rows), int(cols)))
    dev = torch.device(device).type
    if dtype == "auto":
        dt = torch.bfloat16 if dev == "cuda" else torch.float32
    else:
        dt = _DTYPES[dtype] if isinstance(dtype, str) else dtype
    if kernel_mode == "matmul":
        return "step", "matmul"
    backend = "matmul"
    if dev == "cuda" and triton and dt in _SYRK_DTYPES["cuda"]:
        backend = "triton"
    elif dev == "cpu" and dt in _SYRK_DTYPES["cpu"] and m >= kernels.CPU_SYRK_MIN_ROWS:
        backend = "cpu_syrk"
    gram = dt in _GRAM_DTYPES and n >= kernels.GRAM_FORM_ASPECT * m
    if gram and dev == "cpu" and m < kernels.CPU_SYRK_MIN_ROWS:
        gram = m >= kernels.GRAM_FORM_MIN_ROWS_CPU and n >= kernels.GRAM_FORM_ASPECT_SMALL * m
    return ("gram" if gram else "step"), backend


@functools.lru_cache(maxsize=4096)
def ns_flops(
    rows: int, cols: int, steps: int = NS_STEPS, path: tuple[str, str] = ("step", "matmul")
) -> float:
    """Flops of `steps` Newton-Schulz iterations on one rows×cols matrix along `path`
    (`ns_path`), with m ≤ n its short and long side:

    - plain matmul: steps·(4m²n + 2m³);
    - SYRK backends compute one triangle of X·Xᵀ and of b·A + c·A·A: steps·(3m²n + m³);
    - Gram form, per run of r ≤ GRAM_FORM_RESTART steps: the Gram of X, r polynomials
      Q = b·A + c·A·A (+a·I), 3(r−1) products of m×m polynomials in A, and X ← R·X. The
      Gram and Q are half on a SYRK backend, the m×m products half on "cpu_syrk" only (on
      CUDA they are plain matmuls): 5 CPU steps ≈ 6m²n + 14m³.
    """
    form, backend = path
    m, n = sorted((int(rows), int(cols)))
    half = 1 if backend != "matmul" else 2
    gram, poly = half * m * m * n, half * m**3
    if form == "step":
        return float(steps * (gram + poly + 2 * m * m * n))
    product = (1 if backend == "cpu_syrk" else 2) * m**3
    total = 0
    for start in range(0, steps, GRAM_FORM_RESTART):
        r = min(GRAM_FORM_RESTART, steps - start)
        total += gram + 2 * m * m * n + r * poly + 3 * (r - 1) * product
    return float(total)


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

    def path(self, rows: int, cols: int) -> tuple[str, str]:
        """`ns_path` of one rows×cols matrix on this device."""
        return ns_path(rows, cols, self.device, self.dtype, self.triton, self.kernel_mode)

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
    # some rank has room for them without padding the bucket further (`_movable`)
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
        optimizer, under collectives.py's ring accounting, for one parameter dtype.

        A rank-major bucket moves its padded flat once by reduce-scatter and once by
        all-gather; any other is reduced to and broadcast from each owner, region by region
        (pipelined chains, so every rank but the owner sends it, every rank but the owner's
        successor receives it, and the reverse for the broadcast). `gather_ratio` is gather bytes /
        parameter bytes (0.5 for a bf16 gather of fp32).
        The optimizer adds one all-reduce of an int32 flag per unit and one count of
        non-finite buckets (`all_reduce`).
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
                    add("reduce", *C.reduce_bytes(shard[o], n, o)[rank])
                    add("broadcast", *C.broadcast_bytes(shard[o] * gather_ratio, n, o)[rank])
            else:
                add("reduce_scatter", *C.ring_reduce_scatter_bytes([max(shard)] * n)[rank])
                g = max(shard) * gather_ratio
                add("all_gather", *C.ring_all_gather_bytes([g] * n)[rank])
        flags = C.ring_all_reduce_bytes((len(self.owners) + 1) * 4, n)
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
    costs: Sequence[float],
    nbytes: Sequence[int],
    buckets: list[list[int]],
    world_size: int,
    base: Sequence[float] | None = None,
) -> list[int]:
    """Cost balancing that keeps every bucket's shards even.

    First the buckets of several units, in order: inside one, units go largest cost first,
    each to the least-loaded rank (total cost so far, then bytes, then rank) among those
    whose shard in this bucket stays within the bucket's current largest shard, or, when none
    can, to the rank with the smallest shard. Then the one-unit buckets (one owner, nothing
    to pad) fill the gaps longest-processing-time first. Loads start at `base`.
    Deterministic: every rank computes the same owners.
    """
    owners = [0] * len(costs)
    load = [float(b) for b in base] if base else [0.0] * world_size
    used = [0] * world_size

    def give(i: int, r: int) -> None:
        owners[i] = r
        load[r] += costs[i]
        used[r] += nbytes[i]

    for bucket in buckets:
        if len(bucket) == 1:
            continue
        # ranks by their shard of this bucket: shard → heap of (load, bytes, rank)
        by_shard = {0: [(load[r], used[r], r) for r in range(world_size)]}
        heapq.heapify(by_shard[0])
        shards, top = [0], 0  # the distinct shards, ascending; the largest
        for i in sorted(bucket, key=lambda i: (-costs[i], -nbytes[i], i)):
            fitting = shards[: bisect.bisect_right(shards, top - nbytes[i])]
            v = min(fitting, key=lambda v: by_shard[v][0]) if fitting else shards[0]
            _, _, r = heapq.heappop(by_shard[v])
            if not by_shard[v]:
                del by_shard[v]
                shards.remove(v)
            give(i, r)
            v += nbytes[i]
            if v not in by_shard:
                by_shard[v] = []
                bisect.insort(shards, v)
            heapq.heappush(by_shard[v], (load[r], used[r], r))
            top = max(top, v)
    solo = sorted((b[0] for b in buckets if len(b) == 1), key=lambda i: (-costs[i], -nbytes[i], i))
    heap = [(load[r], used[r], r) for r in range(world_size)]
    heapq.heapify(heap)
    for i in solo:
        _, _, r = heapq.heappop(heap)
        give(i, r)
        heapq.heappush(heap, (load[r], used[r], r))
    return owners


def _rank_loads(
    costs: Sequence[float], owners: Sequence[int], world_size: int, base: Sequence[float] | None
) -> list[float]:
    load = [float(b) for b in base] if base else [0.0] * world_size
    for i, r in enumerate(owners):
        load[r] += costs[i]
    return load


def _take(heaps: dict, key: object, i: int) -> None:
    """Remove unit i from the heap `heaps[key]` (dropping the key once it is empty)."""
    heap = heaps[key]
    if heap[0] == i:
        heapq.heappop(heap)
    else:
        heap.remove(i)
        heapq.heapify(heap)
    if not heap:
        del heaps[key]


def _local_search(
    costs: Sequence[float],
    nbytes: Sequence[int],
    buckets: list[list[int]],
    owners: Sequence[int],
    world_size: int,
    base: Sequence[float] | None = None,
) -> list[int]:
    """Relieve the busiest rank by moves and swaps that never grow a bucket's padding.

    Repeatedly takes the busiest rank r (the lowest index among equals) and applies the best
    of: moving one of its units to the lightest rank that may take it, or swapping one of its
    units for a cheaper one of one of the SWAP_PARTNERS lightest ranks; best is the smallest
    max(load of r, load of the partner) afterwards, which must be below r's load now (so the
    sum of squared loads falls and the search ends). A unit of a bucket of several units may
    go to a rank only while that rank's shard of the bucket stays within the bucket's largest
    shard when the search began, so every bucket pads to at most what it did; one-unit
    buckets move freely. Units of a rank that are interchangeable (same cost, and the same
    bucket and size when the bucket is shared) are tried once, the lowest index. Stops when
    the busiest rank cannot be relieved or after MAX_IMPROVEMENTS steps. Deterministic.
    """
    n = world_size
    owners = list(owners)
    if n == 1 or not owners:
        return owners
    load = _rank_loads(costs, owners, n, base)
    bucket_of = [-1] * len(costs)
    shard: dict[int, list[int]] = {}
    cap: dict[int, int] = {}
    for b, bucket in enumerate(buckets):
        if len(bucket) > 1:
            sh = [0] * n
            for i in bucket:
                bucket_of[i] = b
                sh[owners[i]] += nbytes[i]
            shard[b], cap[b] = sh, max(sh)
    # the most bytes some rank can still take in a shared bucket
    spare = {b: cap[b] - min(sh) for b, sh in shard.items()}
    # per rank, interchangeable units: free ones by cost, shared ones by bucket, (cost, size)
    free: list[dict[float, list[int]]] = [{} for _ in range(n)]
    shared: list[dict[int, dict[tuple[float, int], list[int]]]] = [{} for _ in range(n)]
    for i, r in enumerate(owners):  # ascending indices: every list is a heap
        b = bucket_of[i]
        if b < 0:
            free[r].setdefault(costs[i], []).append(i)
        else:
            shared[r].setdefault(b, {}).setdefault((costs[i], nbytes[i]), []).append(i)

    def fits(i: int, s: int, leaving: int = -1) -> bool:
        """Unit i may join rank s (while unit `leaving` leaves s)."""
        b = bucket_of[i]
        if b < 0:
            return True
        freed = nbytes[leaving] if leaving >= 0 and bucket_of[leaving] == b else 0
        return shard[b][s] + nbytes[i] - freed <= cap[b]

    def give(i: int, s: int) -> None:
        r, b, c = owners[i], bucket_of[i], costs[i]
        if b < 0:
            _take(free[r], c, i)
            heapq.heappush(free[s].setdefault(c, []), i)
        else:
            _take(shared[r][b], (c, nbytes[i]), i)
            if not shared[r][b]:
                del shared[r][b]
            heapq.heappush(shared[s].setdefault(b, {}).setdefault((c, nbytes[i]), []), i)
            shard[b][r] -= nbytes[i]
            shard[b][s] += nbytes[i]
            spare[b] = cap[b] - min(shard[b])
        load[r] -= c
        load[s] += c
        owners[i] = s
        offers.pop(r, None)
        offers.pop(s, None)

    # shared buckets whose units differ in cost: swaps inside them can shift load
    mixed = {b for b in shard if len({costs[i] for i in buckets[b]}) > 1}

    offers: dict[int, dict[float, list[int]]] = {}  # movable(r), until r's units change

    def movable(r: int) -> dict[float, list[int]]:
        """Cost → units of r that some other rank might take: one free unit per cost, and
        up to KINDS_PER_COST units of that cost from different shared buckets with room (the
        room may have shrunk since: `fits` decides)."""
        if r in offers:
            return offers[r]
        out = {c: [units[0]] for c, units in free[r].items()}
        for b, kinds in shared[r].items():
            if spare[b] > 0:
                for (c, size), units in kinds.items():
                    if size <= spare[b] and len(out.setdefault(c, [])) < KINDS_PER_COST:
                        out[c].append(units[0])
        offers[r] = out
        return out

    Move = tuple[float, int, int, int]  # (busiest load afterwards, unit, partner, its unit)

    def offer(
        best: Move | None, r: int, s: int, d: float, pairs: Iterable[tuple[int, int]]
    ) -> Move | None:
        """`best`, or the first feasible (unit of r, unit of s or -1) of `pairs`, which shift
        d from r to s, if that leaves the busier of the two lighter than r is now."""
        top = load[r]
        if d <= 0 or load[s] + d >= top - 1e-12 * abs(top):
            return best
        value = max(top - d, load[s] + d)
        if best is not None and value > best[0]:
            return best
        for i, j in pairs:
            if fits(i, s, j) and (j < 0 or fits(j, r, i)):
                cand = (value, i, s, j)
                return cand if best is None or cand < best else best
        return best

    for _ in range(MAX_IMPROVEMENTS):
        r = min(range(n), key=lambda x: (-load[x], x))
        limit = load[r] - 1e-12 * abs(load[r])  # an improvement must land below this
        ranked = sorted(range(n), key=lambda x: (load[x], x))
        mine = movable(r)
        best: Move | None = None
        for c, units in mine.items():  # moves: the lightest rank that takes one
            for s in ranked:
                if load[s] + c >= limit:
                    break
                if s != r and any(fits(i, s) for i in units):
                    best = offer(best, r, s, c, ((i, -1) for i in units))
                    break
        mixed_r = [b for b in shared[r] if b in mixed]
        for s in [x for x in ranked[: SWAP_PARTNERS + 1] if x != r][:SWAP_PARTNERS]:
            if load[s] >= limit:
                break
            theirs = movable(s).items()
            for ci, units_i in mine.items():
                for cj, units_j in theirs:
                    if ci - cj <= 0 or load[s] + (ci - cj) >= limit:
                        continue  # (what `offer` would refuse first, without the call)
                    pairs = ((i, j) for i in units_i for j in units_j)
                    best = offer(best, r, s, ci - cj, pairs)
            for b in mixed_r:  # swaps inside one bucket leave its shards' sizes alone
                if b in shared[s]:
                    for (cj, _), units_j in shared[s][b].items():
                        for (ci, _), units_i in shared[r][b].items():
                            best = offer(best, r, s, ci - cj, [(units_i[0], units_j[0])])
        if best is None:
            break
        _, i, s, j = best
        give(i, s)
        if j >= 0:
            give(j, r)
    return owners


def _padded(
    nbytes: Sequence[int], buckets: Sequence[Sequence[int]], owners: Sequence[int], n: int
) -> int:
    """Bytes the buckets take on the wire under `owners` (as `Assignment.padded_bytes`): a
    shared bucket is N shards padded to its largest, a one-owner bucket just its units."""
    total = 0
    for bucket in buckets:
        shard: dict[int, int] = {}
        for i in bucket:
            if nbytes[i] > 0:
                shard[owners[i]] = shard.get(owners[i], 0) + nbytes[i]
        if shard:
            total += max(shard.values()) * (n if len(shard) > 1 else 1)
    return total


def _lower_bound(
    costs: Sequence[float],
    world_size: int,
    base: Sequence[float] | None,
    buckets: Sequence[Sequence[int]] = (),
    nbytes: Sequence[int] = (),
    owners: Sequence[int] = (),
) -> float:
    """A load some rank reaches under any assignment of `costs` whose buckets pad no more than
    `owners`' do: the mean, the largest base, the largest unit on the lightest base, and
    (pigeonhole) the N-th and (N+1)-th largest units together.

    A shared bucket of S bytes padded to w bytes per rank leaves every rank at least
    S − (N−1)·w of its bytes, at no less than the bucket's cheapest cost per byte (equal units
    filling N shards exactly: the same units on every rank). That floor F is on every rank,
    so the largest unit outside such buckets lands on at least min(base) + F.
    """
    n = world_size
    b = [float(x) for x in base] if base else [0.0] * n
    bound = max((sum(costs) + sum(b)) / n, max(b))
    if not costs:
        return bound
    top = heapq.nlargest(n + 1, costs)
    bound = max(bound, min(b) + top[0])
    if len(top) > n:
        bound = max(bound, min(b) + top[-2] + top[-1])
    floor, pinned = 0.0, set()
    for bucket in buckets:
        held = [i for i in bucket if nbytes[i] > 0]  # (units of no bytes pad nothing)
        if len(bucket) < 2 or not held or not owners:
            continue
        shard = [0] * n
        for i in held:
            shard[owners[i]] += nbytes[i]
        least = sum(shard) - (n - 1) * max(shard)
        if least > 0:
            floor += least * min(costs[i] / nbytes[i] for i in held)
            pinned.update(held)
    rest = [c for i, c in enumerate(costs) if i not in pinned]
    if floor and rest:
        bound = max(bound, min(b) + floor + max(rest))
    return bound


def _movable(
    counted: Sequence[bool],
    nbytes: Sequence[int],
    buckets: Sequence[Sequence[int]],
    owners: Sequence[int],
    world_size: int,
) -> int:
    """How many `counted` units could change owner without padding their bucket more: those
    alone in a bucket, and those of a shared bucket where some rank's shard is at least their
    size below the largest. Equal units filling N shards exactly are pinned: every rank holds
    the same number of them, whatever the balancing."""
    if world_size == 1:
        return 0
    count = 0
    for bucket in buckets:
        if len(bucket) == 1:
            count += counted[bucket[0]]
            continue
        shard = [0] * world_size
        for i in bucket:
            shard[owners[i]] += nbytes[i]
        room = max(shard) - min(shard)
        count += sum(1 for i in bucket if counted[i] and nbytes[i] <= room)
    return count


def _balance_cost(
    costs: Sequence[float],
    nbytes: Sequence[int],
    buckets: list[list[int]],
    world_size: int,
    base: Sequence[float],
) -> list[int]:
    """The cost balancing of fixed buckets: `_bucketed_lpt`, then `_local_search`; round-robin's
    dealing (improved the same way) instead when its busiest rank is lighter and its buckets
    pad within what make_buckets sizes them for (or no more than the greedy's)."""
    owners = _bucketed_lpt(costs, nbytes, buckets, world_size, base)
    owners = _local_search(costs, nbytes, buckets, owners, world_size, base)
    worst = max(_rank_loads(costs, owners, world_size, base))
    dealt = _round_robin(nbytes, world_size)
    allowed = max(_padded(nbytes, buckets, owners, world_size), PAD_ALLOWANCE * sum(nbytes))
    if max(_rank_loads(costs, dealt, world_size, base)) < worst and (
        _padded(nbytes, buckets, dealt, world_size) <= allowed
    ):
        dealt = _local_search(costs, nbytes, buckets, dealt, world_size, base)
        if max(_rank_loads(costs, dealt, world_size, base)) < worst:
            owners = dealt
    return owners


def _release(
    costs: Sequence[float],
    nbytes: Sequence[int],
    bucket_bytes: int,
    buckets: list[list[int]],
    owners: list[int],
    world_size: int,
    base: Sequence[float],
) -> tuple[list[int], list[list[int]]]:
    """Free units that even bucket shards pin, when that is what keeps the busiest rank above
    the bound: (owners, buckets), the given ones if nothing better is found.

    Equal units filling every rank's shard of their buckets give each rank the same number of
    them, so they cannot even out the other units' load (qwen3-30b-a3b's experts at 256
    ranks: 1.117). Candidates free the weighted units of the last j shared buckets (j = 1, 2,
    4, …, all; whole buckets, so the others keep their even shards), each freed unit a bucket
    of its own, and balance again (`_bucketed_lpt`, `_local_search`); the first candidate
    within RELEASE_SLACK of the bound without bucket constraints wins (bisected down to the
    fewest freed buckets that stay within it), else the one with the lightest busiest rank
    (a gain of at least RELEASE_GAIN). The freed units then share one-owner buckets
    (`_one_owner_buckets`): a bucket with one owner is reduced to it and broadcast from it,
    so it pads nothing.
    """
    n = world_size
    best = max(_rank_loads(costs, owners, n, base))
    target = (1 + RELEASE_SLACK) * _lower_bound(costs, n, base)
    weighted = [[i for i in b if costs[i] > 0 and nbytes[i]] for b in buckets]
    shared = [b for b, w in enumerate(weighted) if len(buckets[b]) > 1 and w]
    if n == 1 or best <= target or not shared:
        return owners, buckets

    def attempt(j: int) -> tuple[float, list[int], list[list[int]], list[int]]:
        """(busiest load, owners, buckets, freed units) with the last j shared buckets freed."""
        freed = sorted(i for b in shared[-j:] for i in weighted[b])
        out = set(freed)
        rest = [[i for i in b if i not in out] for b in buckets]
        trial = sorted([b for b in rest if b] + [[i] for i in freed])
        dealt = _bucketed_lpt(costs, nbytes, trial, n, base)
        dealt = _local_search(costs, nbytes, trial, dealt, n, base)
        return max(_rank_loads(costs, dealt, n, base)), dealt, trial, freed

    found: tuple[float, list[int], list[list[int]], list[int]] | None = None
    lo = hi = 0  # the most buckets freed short of the target; the fewest found to reach it
    while hi < len(shared) and (found is None or found[0] > target):
        lo, hi = hi, min(len(shared), 2 * hi or 1)
        trial = attempt(hi)
        if trial[0] < (found[0] if found else best) * (1 - RELEASE_GAIN):
            found = trial
    while found is not None and found[0] <= target and hi - lo > 1:  # fewer freed buckets
        mid = (lo + hi) // 2
        trial = attempt(mid)
        lo, hi = (lo, mid) if trial[0] <= target else (mid, hi)
        found = trial if trial[0] <= target else found
    if found is None:
        return owners, buckets
    _, dealt, trial_buckets, freed = found
    return dealt, _one_owner_buckets(costs, nbytes, bucket_bytes, trial_buckets, dealt, freed)


def _one_owner_buckets(
    costs: Sequence[float],
    nbytes: Sequence[int],
    bucket_bytes: int,
    buckets: list[list[int]],
    owners: list[int],
    freed: Sequence[int],
) -> list[list[int]]:
    """`buckets` with the one-unit buckets of `freed` (ascending) merged into buckets of one
    owner each, up to `bucket_bytes`: fewer collectives, none padded.

    Freed units of equal cost and size are interchangeable, so their owners are first
    reordered (in place, loads and bytes per rank unchanged) to give each rank one run of them;
    then consecutive freed units of one owner share a bucket."""
    same: dict[tuple[float, int], list[int]] = {}
    for i in freed:
        same.setdefault((costs[i], nbytes[i]), []).append(i)
    for ids in same.values():
        for i, r in zip(ids, sorted(owners[i] for i in ids)):
            owners[i] = r
    out = set(freed)
    merged = [b for b in buckets if len(b) > 1 or b[0] not in out]
    run: list[int] = []
    size = 0
    for i in freed:
        if run and (owners[i] != owners[run[0]] or size + nbytes[i] > bucket_bytes):
            merged.append(run)
            run, size = [], 0
        run.append(i)
        size += nbytes[i]
    merged.append(run)
    return sorted(merged)


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
    balance: Balance = "cost",
    bucket_bytes: int = 25 * 2**20,
    cost: Callable[[Unit], float] | Sequence[float] | None = None,
    base: Sequence[float] | None = None,
    shard_adamw: bool = False,
    masters: bool = False,
) -> Assignment:
    """Give every unit one owner rank among `world_size` and cut the units into buckets.

    balance: "cost" minimises the busiest rank's load: `_bucketed_lpt` (largest first, each
    bucket's shards kept even), then `_local_search` (moves and swaps off the busiest rank
    that never grow a bucket's padding); round-robin's dealing, improved the same way, is
    kept instead whenever its busiest rank is lighter, so "cost" is never worse than
    "round_robin" on the cost it balances. Where even shards pin equal units (every rank
    the same number of them) and that keeps the busiest rank above the bound, `_release`
    frees some into one-owner buckets. "round_robin": size-sorted dealing, the simple
    baseline. "capped": fill ranks in order up to 1.3 × the mean cost per bucket. Buckets come
    from `make_buckets(…, bucket_bytes, world_size)` (less what `_release` frees); ownership
    inside a bucket is free because the optimizer lays each bucket out rank by rank.

    cost: a function of a unit (e.g. `MatrixCost.for_device(device)`) or the list of unit
    costs; default `unit_cost` on the GPU path. base: load every rank already carries (from
    another assignment), which the cost balancing fills around.

    shard_adamw: AdamW units get no owner (-1) but are sharded element-wise over all ranks
    (`deal_adamw`, levelling the optimizer state; `masters`: a master copy per owned element
    counts too); the balancing sees only the other units (buckets still hold every unit).
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
        owners = _balance_cost(costs, nbytes, buckets, world_size, base_load)
        owners, buckets = _release(
            costs, nbytes, bucket_bytes, buckets, owners, world_size, base_load
        )
    elif balance == "round_robin":
        owners = _round_robin(nbytes, world_size)
    else:
        owners = _capped(costs, buckets, world_size)
    rank_cost = [0.0] * world_size
    rank_bytes = [0] * world_size
    for i, r in enumerate(owners):
        rank_cost[r] += costs[i]
        rank_bytes[r] += nbytes[i]
    bound = _lower_bound(costs, world_size, base_load, buckets, nbytes, owners)
    a = Assignment(owners, rank_cost, rank_bytes, buckets, nbytes, balance, base_load, bound)
    matrix = [not is_elementwise(u.kind) and c > 0 for u, c in zip(units, costs)]
    a.movable = _movable(matrix, nbytes, buckets, owners, world_size)
    if shard_adamw:
        a.owners = [-1 if is_elementwise(u.kind) else o for u, o in zip(units, owners)]
        return deal_adamw(units, a, masters)
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
    if not C.is_dtensor(p):
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


def deal_adamw(units: Sequence[Unit], a: Assignment, masters: bool = False) -> Assignment:
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
    ones) this is ZeRO-1: ⌈S/N⌉ or ⌊S/N⌋ elements of every bucket per rank.
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
        quota = [q - y for q, y in zip(quota, x)]
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
