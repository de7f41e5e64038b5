"""The balancing behind `assignment.assign`: owner ranks for units given only as their costs
and bytes, cut into fixed communication buckets.

Pure, deterministic functions of lists (every rank computes the same owners): a greedy that
keeps each bucket's shards even (`bucketed_lpt`), a local search that relieves the busiest
rank without growing any bucket's padding (`local_search`), their combination with the
round-robin baseline (`balance_cost`), freeing units that even shards pin (`release_pinned`),
the simple baselines (`round_robin`, `capped`), and what no assignment can beat
(`lower_bound`, `count_movable`).
"""

from __future__ import annotations

import bisect
import heapq
from collections.abc import Iterable, Sequence

CAPPED_FACTOR = 1.3
SPREAD = 2.0
# Local search after the greedy: how many of the lightest ranks a swap may pair the busiest
# rank with, and at most how many moves or swaps it makes (each lowers the sum of squared
# loads, so it ends anyway).
SWAP_PARTNERS = 32
MAX_IMPROVEMENTS = 20_000
KINDS_PER_COST = 8  # units of one cost in different shared buckets a rank offers per step
# Freeing units pinned by even bucket shards (`release_pinned`): stop within this much of the
# bound, and only keep a layout that lowers the busiest rank by at least RELEASE_GAIN.
RELEASE_SLACK = 0.01
RELEASE_GAIN = 0.001
# Padding (padded / unpadded bytes) make_buckets sizes buckets for: "about 1 + 1/spread"
PAD_ALLOWANCE = 1 + 1 / SPREAD


def bucketed_lpt(
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


Move = tuple[float, int, int, int]  # (busiest load afterwards, unit, partner, its unit)


class _Search:
    """`local_search`'s state: the loads, each shared bucket's shards, cap (its largest shard
    when the search began) and spare room, and every rank's units in interchangeable kinds:
    free ones (one-unit buckets) by cost, shared ones by bucket and (cost, size)."""

    def __init__(
        self,
        costs: Sequence[float],
        nbytes: Sequence[int],
        buckets: list[list[int]],
        owners: list[int],
        n: int,
        base: Sequence[float] | None,
    ) -> None:
        self.costs, self.nbytes, self.buckets, self.owners, self.n = (
            costs, nbytes, buckets, owners, n,
        )  # fmt: skip
        self.load = _rank_loads(costs, owners, n, base)
        self.bucket_of = [-1] * len(costs)
        self.shard: dict[int, list[int]] = {}
        self.cap: dict[int, int] = {}
        for b, bucket in enumerate(buckets):
            if len(bucket) > 1:
                sh = [0] * n
                for i in bucket:
                    self.bucket_of[i] = b
                    sh[owners[i]] += nbytes[i]
                self.shard[b], self.cap[b] = sh, max(sh)
        # the most bytes some rank can still take in a shared bucket
        self.spare = {b: self.cap[b] - min(sh) for b, sh in self.shard.items()}
        self.free: list[dict[float, list[int]]] = [{} for _ in range(n)]
        self.shared: list[dict[int, dict[tuple[float, int], list[int]]]] = [{} for _ in range(n)]
        for i, r in enumerate(owners):  # ascending indices: every list is a heap
            b = self.bucket_of[i]
            if b < 0:
                self.free[r].setdefault(costs[i], []).append(i)
            else:
                self.shared[r].setdefault(b, {}).setdefault((costs[i], nbytes[i]), []).append(i)
        # shared buckets whose units differ in cost: swaps inside them can shift load
        self.mixed = {b for b in self.shard if len({costs[i] for i in buckets[b]}) > 1}
        self.offers: dict[int, dict[float, list[int]]] = {}  # movable(r), until r's units change

    def fits(self, i: int, s: int, leaving: int = -1) -> bool:
        """Unit i may join rank s (while unit `leaving` leaves s)."""
        b = self.bucket_of[i]
        if b < 0:
            return True
        nbytes = self.nbytes
        freed = nbytes[leaving] if leaving >= 0 and self.bucket_of[leaving] == b else 0
        return self.shard[b][s] + nbytes[i] - freed <= self.cap[b]

    def give(self, i: int, s: int) -> None:
        """Unit i moves to rank s."""
        r, b, c = self.owners[i], self.bucket_of[i], self.costs[i]
        if b < 0:
            _take(self.free[r], c, i)
            heapq.heappush(self.free[s].setdefault(c, []), i)
        else:
            size = self.nbytes[i]
            shared = self.shared
            _take(shared[r][b], (c, size), i)
            if not shared[r][b]:
                del shared[r][b]
            heapq.heappush(shared[s].setdefault(b, {}).setdefault((c, size), []), i)
            self.shard[b][r] -= size
            self.shard[b][s] += size
            self.spare[b] = self.cap[b] - min(self.shard[b])
        self.load[r] -= c
        self.load[s] += c
        self.owners[i] = s
        self.offers.pop(r, None)
        self.offers.pop(s, None)

    def movable(self, r: int) -> dict[float, list[int]]:
        """Cost → units of r that some other rank might take: one free unit per cost, and
        up to KINDS_PER_COST units of that cost from different shared buckets with room (the
        room may have shrunk since: `fits` decides)."""
        if r in self.offers:
            return self.offers[r]
        out = {c: [units[0]] for c, units in self.free[r].items()}
        for b, kinds in self.shared[r].items():
            if self.spare[b] > 0:
                for (c, size), units in kinds.items():
                    if size <= self.spare[b] and len(out.setdefault(c, [])) < KINDS_PER_COST:
                        out[c].append(units[0])
        self.offers[r] = out
        return out

    def offer(
        self, best: Move | None, r: int, s: int, d: float, pairs: Iterable[tuple[int, int]]
    ) -> Move | None:
        """`best`, or the first feasible (unit of r, unit of s or -1) of `pairs`, which shift
        d from r to s, if that leaves the busier of the two lighter than r is now."""
        load, fits = self.load, self.fits
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

    def best(self, r: int) -> Move | None:
        """The best move or swap off rank r, None when none lands below r's load."""
        load, fits = self.load, self.fits
        limit = load[r] - 1e-12 * abs(load[r])  # an improvement must land below this
        ranked = sorted(range(self.n), key=lambda x: (load[x], x))
        mine = self.movable(r)
        best: Move | None = None
        for c, units in mine.items():  # moves: the lightest rank that takes one
            for s in ranked:
                if load[s] + c >= limit:
                    break
                if s != r and any(fits(i, s) for i in units):
                    best = self.offer(best, r, s, c, ((i, -1) for i in units))
                    break
        return self.best_swap(best, r, ranked, limit, mine)

    def best_swap(
        self,
        best: Move | None,
        r: int,
        ranked: list[int],
        limit: float,
        mine: dict[float, list[int]],
    ) -> Move | None:
        """`best`, or a better swap of a unit of r for a cheaper one of the SWAP_PARTNERS
        lightest ranks (`ranked`: by load)."""
        load, shared, offer = self.load, self.shared, self.offer
        mixed_r = [b for b in shared[r] if b in self.mixed]
        for s in [x for x in ranked[: SWAP_PARTNERS + 1] if x != r][:SWAP_PARTNERS]:
            if load[s] >= limit:
                break
            theirs = self.movable(s).items()
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
        return best


def local_search(
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
    owners = list(owners)
    if world_size == 1 or not owners:
        return owners
    search = _Search(costs, nbytes, buckets, owners, world_size, base)
    for _ in range(MAX_IMPROVEMENTS):
        r = min(range(world_size), key=lambda x: (-search.load[x], x))
        best = search.best(r)
        if best is None:
            break
        _, i, s, j = best
        search.give(i, s)
        if j >= 0:
            search.give(j, r)
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


def lower_bound(
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


def count_movable(
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


def balance_cost(
    costs: Sequence[float],
    nbytes: Sequence[int],
    buckets: list[list[int]],
    world_size: int,
    base: Sequence[float],
) -> list[int]:
    """The cost balancing of fixed buckets: `bucketed_lpt`, then `local_search`; round-robin's
    dealing (improved the same way) instead when its busiest rank is lighter and its buckets
    pad within what make_buckets sizes them for (or no more than the greedy's)."""
    owners = bucketed_lpt(costs, nbytes, buckets, world_size, base)
    owners = local_search(costs, nbytes, buckets, owners, world_size, base)
    worst = max(_rank_loads(costs, owners, world_size, base))
    dealt = round_robin(nbytes, world_size)
    allowed = max(_padded(nbytes, buckets, owners, world_size), PAD_ALLOWANCE * sum(nbytes))
    if max(_rank_loads(costs, dealt, world_size, base)) < worst and (
        _padded(nbytes, buckets, dealt, world_size) <= allowed
    ):
        dealt = local_search(costs, nbytes, buckets, dealt, world_size, base)
        if max(_rank_loads(costs, dealt, world_size, base)) < worst:
            owners = dealt
    return owners


def release_pinned(
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
    of its own, and balance again (`bucketed_lpt`, `local_search`); the first candidate
    within RELEASE_SLACK of the bound without bucket constraints wins (bisected down to the
    fewest freed buckets that stay within it), else the one with the lightest busiest rank
    (a gain of at least RELEASE_GAIN). The freed units then share one-owner buckets
    (`_one_owner_buckets`): a bucket with one owner is reduced to it and broadcast from it,
    so it pads nothing.
    """
    n = world_size
    best = max(_rank_loads(costs, owners, n, base))
    target = (1 + RELEASE_SLACK) * lower_bound(costs, n, base)
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
        dealt = bucketed_lpt(costs, nbytes, trial, n, base)
        dealt = local_search(costs, nbytes, trial, dealt, n, base)
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


def round_robin(nbytes: Sequence[int], world_size: int) -> list[int]:
    """Sort by size (largest first, stable) and deal the units to ranks 0, 1, …, N−1, 0, …"""
    owners = [0] * len(nbytes)
    for k, i in enumerate(sorted(range(len(nbytes)), key=lambda i: (-nbytes[i], i))):
        owners[i] = k % world_size
    return owners


def capped(costs: Sequence[float], buckets: list[list[int]], world_size: int) -> list[int]:
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
