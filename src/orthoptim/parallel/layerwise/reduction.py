"""How a bucket's gradients reach their owners: the gradient sync's pluggable reduction
(`Reduction`, after FSDP2's reduce-scatter seam and DDP's comm hooks).

- `RingReduction` (the default): one reduce-scatter of a rank-major bucket, or one reduce of
  each owner's region of a natural one. The backend chooses the order of the sum (a ring's
  depends on the group's size), so the bits depend on the data-parallel size.
- `OrderedReduction` (`reproducible=True`): each rank sends every owner its slice by
  all-to-all (one per rank-major bucket, the bytes of its ring reduce-scatter; one per
  region of a natural bucket, the ring's one reduce per region), and
  the owner sums the slices of ranks 0..N-1 in a fixed binary tree (`tree_sum_`). With each
  rank's contiguous block of micro-batches summed in the same tree (`accumulation`), the
  whole sum is one tree over the global micro-batch index, the same at every
  power-of-two data-parallel size.

Both turn the owner's summed regions into averages (divided by the bucket's `divisor`) in
`finish`; the reduction of a bucket in flight is the reduction's to hold (`pending`), not the
bucket's.
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch
from torch import Tensor

from orthoptim import collectives as C
from orthoptim.comm_bytes import (
    CommStats,
    ordered_reduce_bytes,
    reduce_bytes,
    ring_reduce_scatter_bytes,
)
from orthoptim.parallel.base import add_bytes
from orthoptim.parallel.layerwise.buffers import Bucket
from orthoptim.parallel.ordered import tree_sum_


class Reduction:
    """The seam: how a bucket's reduction is launched, finished and counted."""

    #: the name `comm_stats()` files this reduction's bytes under
    kind: ClassVar[str]

    def __init__(self) -> None:
        self.pending: dict[Bucket, list[tuple[Any, str]]] = {}

    def phase(self, bucket: Bucket) -> str:
        """The name of the step a failure of `bucket`'s reduction happened in."""
        return f"gradient {self.kind} of {bucket.label}"

    def launch(self, bucket: Bucket, stats: CommStats, async_op: bool) -> None:
        """Start `bucket`'s reduction (nothing moves in a group of one rank)."""
        if bucket.n > 1:
            with C.phase(self.phase(bucket), bucket.group):
                self.pending[bucket] = self._launch(bucket, stats, async_op)

    def _launch(self, bucket: Bucket, stats: CommStats, async_op: bool) -> list[Any]:
        raise NotImplementedError

    def _wait(self, bucket: Bucket) -> None:
        for work, name in self.pending.pop(bucket, []):
            if work is not None:
                C.wait(work, name)

    def finish(self, bucket: Bucket) -> None:
        """Wait for `bucket`'s reduction and leave the owner's regions holding the averaged
        gradients (the sums divided by `bucket.divisor`)."""
        self._wait(bucket)
        assert bucket.grads is not None
        for start, stop, _ in bucket.mine_regions():
            bucket.grads[start:stop].div_(bucket.divisor)

    def expected_bytes(self, bucket: Bucket, out: dict[str, dict[str, float]]) -> None:
        """Add what one step's reduction of `bucket` moves to `out`, from its layout alone
        (nothing in a group of one rank)."""
        if bucket.n > 1:
            size = torch.empty(0, dtype=bucket.grad_dtype).element_size()
            self._expected(bucket, out, size)

    def _expected(self, bucket: Bucket, out: dict[str, dict[str, float]], size: int) -> None:
        raise NotImplementedError


class RingReduction(Reduction):
    """The backend's reduce-scatter (rank-major buckets) or reduce to each region's owner."""

    kind = "reduce"

    def phase(self, bucket: Bucket) -> str:
        return f"gradient {'reduce-scatter' if bucket.width else 'reduce'} of {bucket.label}"

    def _launch(self, bucket: Bucket, stats: CommStats, async_op: bool) -> list[Any]:
        assert bucket.grads is not None
        name = self.phase(bucket)
        if bucket.width:
            w, rank = bucket.width, bucket.rank
            out = bucket.grads[rank * w : (rank + 1) * w]
            work = C.reduce_scatter(
                out, bucket.grads, group=bucket.group, stats=stats, async_op=async_op
            )
            return [(work, name)]
        works = []
        for start, stop, owner in bucket.regions:
            dst = C.global_rank(bucket.group, owner)
            work = C.reduce(
                bucket.grads[start:stop], dst, group=bucket.group, stats=stats, async_op=async_op
            )
            works.append((work, name))
        return works

    def _expected(self, bucket: Bucket, out: dict[str, dict[str, float]], size: int) -> None:
        n, rank = bucket.n, bucket.rank
        if bucket.width:
            sent = ring_reduce_scatter_bytes([bucket.width * size] * n)[rank]
            add_bytes(out, "reduce_scatter", *sent)
            return
        for start, stop, owner in bucket.regions:
            add_bytes(out, "reduce", *reduce_bytes((stop - start) * size, n, owner)[rank])


class OrderedReduction(Reduction):
    """Every owner's slices sent to it by all-to-all, summed by the owner in the binary tree
    over the ranks' index (`tree_sum_`), then -0 made +0 so that a zero's sign does not
    depend on where a sum of zeros was formed. Needs a power-of-two group.

    A rank-major bucket goes in one all-to-all of its buffer as it lies (shard r to rank r:
    the bytes of a ring reduce-scatter); a natural one in one per region, to its owner (as
    the ring reduction's one reduce per region), so nothing is copied to be sent. The owner
    receives N copies of its share (its inboxes), held until `finish`, at most `IN_FLIGHT`
    buckets' at a time."""

    kind = "ordered_reduce"

    #: buckets whose inboxes may be alive at once: launching another first finishes the
    #: oldest, so the reduction holds at most this many buckets' shares beside the buffers
    IN_FLIGHT = 2

    def __init__(self) -> None:
        super().__init__()
        # bucket → (start, stop, the N copies of elements start:stop this rank owns)
        self.inbox: dict[Bucket, list[tuple[int, int, Tensor]]] = {}

    def launch(self, bucket: Bucket, stats: CommStats, async_op: bool) -> None:
        while len(self.inbox) >= self.IN_FLIGHT:
            self.finish(next(iter(self.inbox)))
        super().launch(bucket, stats, async_op)

    @staticmethod
    def sends(bucket: Bucket) -> list[tuple[int, int, list[int]]]:
        """The bucket's all-to-alls: (start, stop, the elements of start:stop each rank owns),
        one for a rank-major bucket (shard r to rank r), one per region of a natural one."""
        n = bucket.n
        if bucket.width:
            return [(0, bucket.numel, [bucket.width] * n)]
        return [(a, b, [b - a if r == o else 0 for r in range(n)]) for a, b, o in bucket.regions]

    def _launch(self, bucket: Bucket, stats: CommStats, async_op: bool) -> list[Any]:
        grads, n, rank = bucket.grads, bucket.n, bucket.rank
        assert grads is not None
        works, inboxes = [], []
        for start, stop, shares in self.sends(bucket):
            mine = shares[rank]
            inbox = torch.empty(n * mine, dtype=grads.dtype, device=grads.device)
            if mine:
                lo = start + sum(shares[:rank])
                inboxes.append((lo, lo + mine, inbox))
            work = C.all_to_all(
                inbox, grads[start:stop], [mine] * n, shares, group=bucket.group, stats=stats,
                async_op=async_op, kind=self.kind,
            )  # fmt: skip
            works.append((work, self.phase(bucket)))
        self.inbox[bucket] = inboxes
        return works

    def finish(self, bucket: Bucket) -> None:
        self._wait(bucket)
        inboxes = self.inbox.pop(bucket, [])
        assert bucket.grads is not None or not inboxes
        for start, stop, inbox in inboxes:
            total = tree_sum_(inbox.view(bucket.n, -1))
            bucket.grads[start:stop].copy_(total.div_(bucket.divisor).add_(0.0))

    def _expected(self, bucket: Bucket, out: dict[str, dict[str, float]], size: int) -> None:
        for _, _, shares in self.sends(bucket):
            add_bytes(out, self.kind, *ordered_reduce_bytes(shares, size)[bucket.rank])


def make_reduction(reproducible: bool) -> Reduction:
    """The reduction a driver's gradient sync takes: ordered under `reproducible`."""
    return OrderedReduction() if reproducible else RingReduction()
