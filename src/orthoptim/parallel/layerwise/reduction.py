"""How a bucket's gradients reach their owners: the gradient sync's pluggable reduction
(`Reduction`, after FSDP2's reduce-scatter seam and DDP's comm hooks).

- `RingReduction` (the default): one reduce-scatter of a rank-major bucket, or one reduce of
  each owner's region of a natural one. The backend chooses the order of the sum (a ring's
  depends on the group's size), so the bits depend on the data-parallel size.
- `OrderedReduction` (`reproducible=True`): each rank sends every owner its slice (one
  all-to-all: the same bytes per rank as a ring reduce-scatter of a rank-major bucket), and
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

    def launch(self, bucket: Bucket, stats: C.CommStats, async_op: bool) -> None:
        """Start `bucket`'s reduction (nothing moves in a group of one rank)."""
        if bucket.n > 1:
            with C.phase(self.phase(bucket), bucket.group):
                self.pending[bucket] = self._launch(bucket, stats, async_op)

    def _launch(self, bucket: Bucket, stats: C.CommStats, async_op: bool) -> list[Any]:
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
        """Add what one step's reduction of `bucket` moves to `out`, from its layout alone."""
        raise NotImplementedError

    def transient_numel(self, bucket: Bucket) -> int:
        """Elements this reduction holds beside the buffers while `bucket`'s is in flight."""
        return 0


class RingReduction(Reduction):
    """The backend's reduce-scatter (rank-major buckets) or reduce to each region's owner."""

    kind = "reduce"

    def phase(self, bucket: Bucket) -> str:
        return f"gradient {'reduce-scatter' if bucket.width else 'reduce'} of {bucket.label}"

    def _launch(self, bucket: Bucket, stats: C.CommStats, async_op: bool) -> list[Any]:
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

    def expected_bytes(self, bucket: Bucket, out: dict[str, dict[str, float]]) -> None:
        if bucket.n == 1:
            return
        size = torch.empty(0, dtype=bucket.grad_dtype).element_size()
        n, rank = bucket.n, bucket.rank
        if bucket.width:
            sent = C.ring_reduce_scatter_bytes([bucket.width * size] * n)[rank]
            add_bytes(out, "reduce_scatter", *sent)
            return
        for start, stop, owner in bucket.regions:
            add_bytes(out, "reduce", *C.reduce_bytes((stop - start) * size, n, owner)[rank])


class OrderedReduction(Reduction):
    """Every owner's slices sent to it in one all-to-all, summed by the owner in the binary
    tree over the ranks' index (`tree_sum_`), then -0 made +0 so that a zero's sign does not
    depend on where a sum of zeros was formed. Needs a power-of-two group.

    The all-to-all's input is the bucket's buffer laid out owner by owner (a rank-major
    bucket as it is; a natural one's regions copied into that order), its output N rows of
    this rank's share (`transient_numel`), held until `finish`, at most `IN_FLIGHT` buckets'
    at a time."""

    kind = "ordered_reduce"

    #: buckets whose inboxes may be alive at once: launching another first finishes the
    #: oldest, so the reduction holds at most this many buckets' shares beside the buffers
    IN_FLIGHT = 2

    def __init__(self) -> None:
        super().__init__()
        self.inbox: dict[Bucket, Tensor] = {}
        self.outbox: dict[Bucket, Tensor] = {}  # a natural bucket's copy, until sent

    def launch(self, bucket: Bucket, stats: C.CommStats, async_op: bool) -> None:
        while len(self.inbox) >= self.IN_FLIGHT:
            self.finish(next(iter(self.inbox)))
        super().launch(bucket, stats, async_op)

    @staticmethod
    def owner_major(bucket: Bucket) -> list[tuple[int, int, int]]:
        """The bucket's regions (start, stop, owner) sorted by owner (stable)."""
        return sorted(bucket.regions, key=lambda r: r[2])

    @staticmethod
    def shares(bucket: Bucket) -> list[int]:
        """How many elements each rank owns in `bucket`."""
        out = [0] * bucket.n
        for start, stop, owner in bucket.regions:
            out[owner] += stop - start
        return out

    def _launch(self, bucket: Bucket, stats: C.CommStats, async_op: bool) -> list[Any]:
        assert bucket.grads is not None
        shares = self.shares(bucket)
        regions = self.owner_major(bucket)
        if regions == bucket.regions and regions[-1][1] == bucket.numel:
            send = bucket.grads
        else:
            send = torch.cat([bucket.grads[start:stop] for start, stop, _ in regions])
            self.outbox[bucket] = send
        mine = shares[bucket.rank]
        inbox = torch.empty(bucket.n * mine, dtype=send.dtype, device=send.device)
        self.inbox[bucket] = inbox
        work = C.all_to_all(
            inbox, send, [mine] * bucket.n, shares, group=bucket.group, stats=stats,
            async_op=async_op, kind=self.kind,
        )  # fmt: skip
        return [(work, self.phase(bucket))]

    def finish(self, bucket: Bucket) -> None:
        self._wait(bucket)
        self.outbox.pop(bucket, None)
        inbox = self.inbox.pop(bucket, None)
        assert bucket.grads is not None
        if inbox is None:  # finished already (`IN_FLIGHT`), or nothing was sent
            return
        total = tree_sum_(inbox.view(bucket.n, -1))
        total.div_(bucket.divisor).add_(0.0)
        at = 0
        for start, stop, _ in bucket.mine_regions():
            bucket.grads[start:stop].copy_(total[at : at + stop - start])
            at += stop - start

    def expected_bytes(self, bucket: Bucket, out: dict[str, dict[str, float]]) -> None:
        if bucket.n == 1:
            return
        size = torch.empty(0, dtype=bucket.grad_dtype).element_size()
        shares = self.shares(bucket)
        mine = shares[bucket.rank]
        sent = (sum(shares) - mine) * size
        add_bytes(out, self.kind, sent, (bucket.n - 1) * mine * size)

    def transient_numel(self, bucket: Bucket) -> int:
        if bucket.n == 1:
            return 0
        own = bucket.n * self.shares(bucket)[bucket.rank]
        copied = 0 if self.owner_major(bucket) == bucket.regions else bucket.numel
        return own + copied


def make_reduction(reproducible: bool) -> Reduction:
    """The reduction a driver's gradient sync takes: ordered under `reproducible`."""
    return OrderedReduction() if reproducible else RingReduction()
