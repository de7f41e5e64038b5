"""What every collective moves, per rank: the byte accounting `orthoptim.collectives` records.

Byte accounting: for each collective kind we record, per rank, the bytes it sends and the
bytes it receives under the bandwidth-optimal algorithm NCCL uses for it, on a ring of the N
group ranks in rank order (r → r+1 mod N). S = the tensor's bytes, c_r = rank r's chunk:

    all_reduce       ring reduce-scatter then ring all-gather over N equal chunks of S/N:
                     every rank sends 2·(N−1)/N · S and receives the same
                     (exact when N divides the elements; else the mean over ranks)
    reduce_scatter   rank r ends with chunk r; it forwards every chunk but its own and
                     receives every chunk but c_{r−1}: sends S − c_r, receives S − c_{r−1}
                     ((N−1)/N · S_in each way: torch's chunks are equal)
    all_gather       rank r starts with chunk r; it forwards every chunk but c_{r+1} and
                     receives every chunk but its own: sends S − c_{r+1}, receives S − c_r
                     ((N−1)/N · S_out each way; gloo's padding to the largest chunk counts)
    reduce           pipelined chain dst+1 → dst+2 → … → dst: every rank but dst sends S,
                     every rank but dst+1 receives S
    broadcast        pipelined chain src → src+1 → … → src−1: every rank but src−1 sends S,
                     every rank but src receives S
    all_to_all       sends what leaves this rank, receives what arrives
    gather           (gather_object) point to point: each rank sends its size (8 bytes) and
                     payload to dst, which receives them

So summed over the ranks of a group, sent = received for every kind: (N−1)·S each way for
reduce and broadcast — the same 2·(N−1)·S in total as reduce-scatter + all-gather of S.
Reduce and broadcast are the reduce-scatter and all-gather with only one non-empty chunk
(dst's / src's). The helpers here (`ring_all_reduce_bytes`, `ring_reduce_scatter_bytes`,
`ring_all_gather_bytes`, `reduce_bytes`, `broadcast_bytes`) are the only place these
formulas live: `orthoptim.collectives`' wrappers record them, `expected_comm_bytes()` and
`orthoptim plan` use them. They are what the algorithm moves, not what gloo's own
implementation does on loopback.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, field


@dataclass
class CommStats:
    """Bytes sent / received and call counts per collective kind since the last `reset()`."""

    sent: dict[str, float] = field(default_factory=lambda: defaultdict(float))
    received: dict[str, float] = field(default_factory=lambda: defaultdict(float))
    calls: dict[str, int] = field(default_factory=lambda: defaultdict(int))

    def record(self, kind: str, sent: float, received: float) -> None:
        """Add one call of `kind`."""
        self.sent[kind] += sent
        self.received[kind] += received
        self.calls[kind] += 1

    def reset(self) -> None:
        """Forget everything recorded so far (called at the start of each step)."""
        self.sent.clear()
        self.received.clear()
        self.calls.clear()

    def copy(self) -> CommStats:
        """A copy of what was recorded so far (the driver keeps its last step's)."""
        out = CommStats()
        out.sent.update(self.sent)
        out.received.update(self.received)
        out.calls.update(self.calls)
        return out

    def without(self, *kinds: str) -> CommStats:
        """A copy without the calls of `kinds` (e.g. a check priced apart from the work)."""
        out = self.copy()
        for table in (out.sent, out.received, out.calls):
            for kind in kinds:
                table.pop(kind, None)
        return out

    def as_dict(self) -> dict[str, dict[str, float]]:
        """{kind: {"sent": bytes, "received": bytes, "calls": n}} plus a "total" entry."""
        out: dict[str, dict[str, float]] = {
            k: {"sent": self.sent[k], "received": self.received[k], "calls": self.calls[k]}
            for k in sorted(self.calls)
        }
        out["total"] = {
            "sent": sum(self.sent.values()),
            "received": sum(self.received.values()),
            "calls": sum(self.calls.values()),
        }
        return out


# -- byte accounting (see the module docstring): [(sent, received)] of every group rank -----


def ring_all_reduce_bytes(nbytes: float, n: int) -> float:
    """Bytes every rank sends, and receives, in a ring all-reduce of `nbytes` over `n` ranks."""
    return 2 * (n - 1) / n * nbytes if n > 1 else 0.0


def ring_reduce_scatter_bytes(chunks: list[float]) -> list[tuple[float, float]]:
    """(sent, received) of every rank in a ring reduce-scatter that leaves chunk r
    (`chunks[r]` bytes) on rank r: rank r forwards every chunk but its own and receives
    every chunk but rank r−1's."""
    n = len(chunks)
    if n <= 1:
        return [(0.0, 0.0)] * n
    total = sum(chunks)
    return [(total - chunks[r], total - chunks[r - 1]) for r in range(n)]


def ring_all_gather_bytes(chunks: list[float]) -> list[tuple[float, float]]:
    """(sent, received) of every rank in a ring all-gather of chunk r (`chunks[r]` bytes)
    from every rank r: rank r forwards every chunk but rank r+1's, receives all but its own."""
    n = len(chunks)
    if n <= 1:
        return [(0.0, 0.0)] * n
    total = sum(chunks)
    return [(total - chunks[(r + 1) % n], total - chunks[r]) for r in range(n)]


def reduce_bytes(nbytes: float, n: int, dst: int) -> list[tuple[float, float]]:
    """(sent, received) of every group rank in a pipelined chain reduce of `nbytes` to group
    rank `dst` (dst+1 → dst+2 → … → dst): all but dst send it, all but dst+1 receive it."""
    if n <= 1:
        return [(0.0, 0.0)] * n
    return [(0.0 if r == dst else nbytes, 0.0 if r == (dst + 1) % n else nbytes) for r in range(n)]


def broadcast_bytes(nbytes: float, n: int, src: int) -> list[tuple[float, float]]:
    """(sent, received) of every group rank in a pipelined chain broadcast of `nbytes` from
    group rank `src` (src → src+1 → … → src−1): all but src−1 send it, all but src receive it."""
    if n <= 1:
        return [(0.0, 0.0)] * n
    return [(0.0 if r == (src - 1) % n else nbytes, 0.0 if r == src else nbytes) for r in range(n)]


def ordered_reduce_bytes(share: Sequence[int], nbytes: int) -> list[tuple[float, float]]:
    """(sent, received) of every rank in one all-to-all of the ordered reduction
    (`OrderedReduction`): rank r sends every other rank o its copy of o's `share[o]`
    elements of `nbytes` bytes and receives N − 1 copies of its own."""
    n, total = len(share), sum(share)
    return [((total - x) * nbytes, (n - 1) * x * nbytes) for x in share]
