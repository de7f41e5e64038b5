"""The counted tensor collectives: each wrapper checks its tensors' device
(`devices.check_device`), records in a `CommStats` the bytes each rank sends and receives
under the bandwidth-optimal ring or chain algorithm of its kind (`orthoptim.comm_bytes`,
where the formulas live and are explained) and issues the torch.distributed call under
`errors.issue`, so a failure is a `CollectiveError`. Alone (world size 1) each is a local copy
or nothing."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import Tensor

from orthoptim.collectives.devices import check_device, device_for, to_backend
from orthoptim.collectives.errors import issue, issuing, phase
from orthoptim.collectives.groups import group_rank, world
from orthoptim.comm_bytes import (
    broadcast_bytes,
    reduce_bytes,
    ring_all_gather_bytes,
    ring_all_reduce_bytes,
    ring_reduce_scatter_bytes,
)
from orthoptim.shards import is_dtensor, pack_upper, unpack_upper

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

    from orthoptim.comm_bytes import CommStats


def _nbytes(t: Tensor) -> int:
    return t.numel() * t.element_size()


def _ranks(kind: str, group: ProcessGroup | None, *tensors: Tensor) -> tuple[int, int]:
    """(rank, world size) in `group`; with peers, each of `tensors` checked to live on a
    device the backend serves (`check_device`, naming `kind`)."""
    rank, n = world(group)
    if n > 1:
        for t in tensors:
            check_device(t, kind, group)
    return rank, n


def all_reduce_max(
    t: Tensor, group: ProcessGroup | None = None, what: str = "max all-reduce"
) -> Tensor:
    """The elementwise max of `t` over `group` (a new CPU tensor; `t` itself alone), one
    all-reduce on the backend's device, named `what` in errors."""
    if world(group)[1] == 1:
        return t
    out = to_backend(t.clone(), group)
    with phase(what, group):
        all_reduce(out, op=dist.ReduceOp.MAX, group=group)
    return out.cpu()


def all_reduce(
    t: Tensor,
    op: Any = None,
    group: ProcessGroup | None = None,
    stats: CommStats | None = None,
    async_op: bool = False,
    kind: str = "all_reduce",
) -> Any:
    """In-place all-reduce (sum by default) of `t`; `kind` is the name `stats` files it under."""
    _, n = _ranks(kind, group, t)
    if n == 1:
        return None
    if stats is not None:
        b = ring_all_reduce_bytes(_nbytes(t), n)
        stats.record(kind, b, b)
    return issue(kind, group, dist.all_reduce, t, op=op or dist.ReduceOp.SUM, async_op=async_op)


# torch 2.13 renamed the flat collectives (the old names now warn on every call); older
# releases have only the old ones.
_REDUCE_SCATTER = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
_ALL_GATHER = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def reduce_scatter(
    out: Tensor,
    inp: Tensor,
    op: Any = None,
    group: ProcessGroup | None = None,
    stats: CommStats | None = None,
    async_op: bool = False,
    kind: str = "reduce_scatter",
) -> Any:
    """`out` ← this rank's 1/N chunk of the sum over ranks of `inp` (flat, equal chunks);
    `kind` is the name `stats` files it under."""
    rank, n = _ranks(kind, group, inp, out)
    if n == 1:
        out.copy_(inp)
        return None
    if stats is not None:
        stats.record(kind, *ring_reduce_scatter_bytes([_nbytes(inp) / n] * n)[rank])
    op = op or dist.ReduceOp.SUM
    return issue(kind, group, _REDUCE_SCATTER, out, inp, op=op, async_op=async_op)


def all_gather(
    out: Tensor,
    inp: Tensor,
    group: ProcessGroup | None = None,
    stats: CommStats | None = None,
    async_op: bool = False,
    kind: str = "all_gather",
) -> Any:
    """`out` (N × inp elements, rank-major) ← every rank's `inp`."""
    rank, n = _ranks(kind, group, inp, out)
    if n == 1:
        out.copy_(inp.reshape(out.shape))
        return None
    if stats is not None:
        stats.record(kind, *ring_all_gather_bytes([_nbytes(out) / n] * n)[rank])
    return issue(kind, group, _ALL_GATHER, out, inp, async_op=async_op)


class _Gathered:
    """An in-flight variable-size all-gather; `wait()` returns one tensor per rank."""

    def __init__(self, work: Any, buffer: Tensor, sizes: list[int]) -> None:
        self._work, self._buffer, self._sizes = work, buffer, sizes

    def wait(self) -> list[Tensor]:
        if self._work is not None:
            self._work.wait()
            self._work = None
        width = self._buffer.numel() // max(1, len(self._sizes))
        return [self._buffer[r * width : r * width + s] for r, s in enumerate(self._sizes)]


def all_gatherv(
    local: Tensor,
    sizes: list[int],
    group: ProcessGroup | None = None,
    stats: CommStats | None = None,
    async_op: bool = False,
    out: Tensor | None = None,
    kind: str = "all_gather",
) -> _Gathered:
    """Gather a flat tensor whose length differs by rank (`sizes[r]` elements on rank r).

    gloo has no uneven all-gather, so every rank pads to max(sizes) and one all-gather runs;
    the result is sliced back. Returns a handle whose `wait()` gives the per-rank tensors.
    `local` may already be padded to max(sizes) (its tail is then sent as is, no copy);
    `out` (N·max(sizes) elements) receives the padded result instead of a new buffer.
    """
    rank, n = world(group)
    width = max(sizes) if sizes else 0
    if local.ndim != 1 or local.numel() not in (sizes[rank], width):
        raise ValueError(
            f"all_gatherv: rank {rank} holds {local.numel()} elements (ndim {local.ndim}) "
            f"but sizes says {sizes[rank]} (or {width} when padded)"
        )
    if out is not None and (out.ndim != 1 or out.numel() != width * n or out.dtype != local.dtype):
        raise ValueError(
            f"all_gatherv: out must be a flat {local.dtype} tensor of {width * n} elements, "
            f"got {tuple(out.shape)} {out.dtype}"
        )
    buffer = out if out is not None else local.new_empty(width * n)
    if n == 1:
        buffer[: local.numel()].copy_(local)
        return _Gathered(None, buffer, sizes)
    padded = (
        local
        if local.numel() == width
        else torch.cat([local, local.new_zeros(width - local.numel())])
    )
    work = all_gather(buffer, padded, group=group, stats=stats, async_op=async_op, kind=kind)
    return _Gathered(work if async_op else None, buffer, sizes)


def reduce(
    t: Tensor,
    dst: int,
    op: Any = None,
    group: ProcessGroup | None = None,
    stats: CommStats | None = None,
    async_op: bool = False,
) -> Any:
    """Sum `t` over ranks into global rank `dst` (in place there; undefined elsewhere)."""
    rank, n = _ranks("reduce", group, t)
    if n == 1:
        return None
    if stats is not None:
        stats.record("reduce", *reduce_bytes(_nbytes(t), n, group_rank(group, dst))[rank])
    op = op or dist.ReduceOp.SUM
    return issue("reduce", group, dist.reduce, t, dst=dst, op=op, async_op=async_op)


def broadcast(
    t: Tensor,
    src: int,
    group: ProcessGroup | None = None,
    stats: CommStats | None = None,
    async_op: bool = False,
) -> Any:
    """Broadcast `t` from group rank `src` (a global rank, as torch.distributed expects)."""
    rank, n = _ranks("broadcast", group, t)
    if n == 1:
        return None
    if stats is not None:
        stats.record("broadcast", *broadcast_bytes(_nbytes(t), n, group_rank(group, src))[rank])
    return issue("broadcast", group, dist.broadcast, t, src=src, async_op=async_op)


def all_to_all(
    out: Tensor,
    inp: Tensor,
    out_splits: list[int],
    in_splits: list[int],
    group: ProcessGroup | None = None,
    stats: CommStats | None = None,
    async_op: bool = False,
    kind: str = "all_to_all",
) -> Any:
    """All-to-all of flat tensors: `in_splits[r]` elements go to rank r, `out_splits[r]` arrive;
    `kind` is the name `stats` files it under."""
    rank, n = _ranks(kind, group, inp, out)
    if n == 1:
        out.copy_(inp)
        return None
    if stats is not None:
        es = inp.element_size()
        stats.record(
            kind,
            (sum(in_splits) - in_splits[rank]) * es,
            (sum(out_splits) - out_splits[rank]) * es,
        )
    return issue(
        kind, group, dist.all_to_all_single, out, inp, out_splits, in_splits,
        async_op=async_op,
    )  # fmt: skip


class _AllToAllRows(torch.autograd.Function):
    """`all_to_all_rows` with its backward: the gradient of what arrived goes back the way it
    came (the same all-to-all with the splits swapped)."""

    @staticmethod
    def forward(
        ctx: Any,
        inp: Tensor,
        out_rows: list[int],
        in_rows: list[int],
        group: ProcessGroup | None,
        stats: CommStats | None,
        kind: str,
    ) -> Tensor:
        ctx.rows, ctx.group, ctx.stats, ctx.kind = (out_rows, in_rows), group, stats, kind
        return _rows_to_all(inp, out_rows, in_rows, group, stats, kind)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, ...]:
        out_rows, in_rows = ctx.rows
        back = _rows_to_all(grad, in_rows, out_rows, ctx.group, ctx.stats, ctx.kind)
        return back, None, None, None, None, None


def _rows_to_all(
    inp: Tensor,
    out_rows: list[int],
    in_rows: list[int],
    group: ProcessGroup | None,
    stats: CommStats | None,
    kind: str,
) -> Tensor:
    width = math.prod(inp.shape[1:])
    out = inp.new_empty(sum(out_rows), *inp.shape[1:])
    all_to_all(
        out.view(-1), inp.contiguous().view(-1), [r * width for r in out_rows],
        [r * width for r in in_rows], group=group, stats=stats, kind=kind,
    )  # fmt: skip
    return out


def all_to_all_rows(
    inp: Tensor,
    out_rows: list[int],
    in_rows: list[int],
    group: ProcessGroup | None = None,
    stats: CommStats | None = None,
    kind: str = "all_to_all",
) -> Tensor:
    """Differentiable variable-size all-to-all of the rows (dim 0) of `inp`: its first
    `in_rows[0]` rows go to group rank 0, the next `in_rows[1]` to rank 1, …; the result holds
    the `out_rows[r]` rows rank r sent here, in rank order. The backward sends the gradient
    back with the splits swapped (so the gradient of a rank's rows sums what every rank's
    loss puts on them). Every rank's splits must agree with its peers' (rank r's `in_rows[s]`
    is rank s's `out_rows[r]`): exchange the counts first. Bytes go to `stats` under `kind`,
    forward and backward."""
    if sum(in_rows) != inp.shape[0]:
        raise ValueError(
            f"all_to_all_rows: in_rows sums to {sum(in_rows)} but inp has {inp.shape[0]} rows"
        )
    return _AllToAllRows.apply(inp, list(out_rows), list(in_rows), group, stats, kind)


def unshard(t: Tensor, stats: CommStats | None = None) -> Tensor:
    """The full (global) tensor of a DTensor, all-gathered over its sharded mesh
    dimensions; a plain tensor is returned as is. Counted as an all-gather of the result."""
    if not is_dtensor(t):
        return t
    n = 1
    for dim, placement in enumerate(t.placements):
        if placement.is_shard():
            n *= t.device_mesh.size(dim)
    if stats is not None and n > 1:
        stats.record("all_gather", *ring_all_gather_bytes([_nbytes(t) / n] * n)[0])
    with issuing("all_gather (DTensor.full_tensor)"):
        return t.full_tensor()


def all_reduce_symmetric(
    A: Tensor,
    group: ProcessGroup | None = None,
    stats: CommStats | None = None,
    kind: str = "all_reduce",
    packed: bool = True,
) -> Tensor:
    """Sum symmetric [..., m, m] matrices over ranks; returns a new tensor, `A` is left as it was.

    `packed`: send only the upper triangle (`shards.pack_upper`), m(m+1)/2 elements instead of
    m², half the bytes for large m, for a pack and an unpack of about one pass over A each:
    worth it where the link, not memory, is the bottleneck (`CostModel.packs`).
    """
    _, n = world(group)
    if n == 1:
        return A.clone()
    if not packed:
        out = A.clone(memory_format=torch.contiguous_format)
        all_reduce(out, group=group, stats=stats, kind=kind)
        return out
    flat = pack_upper(A)
    all_reduce(flat, group=group, stats=stats, kind=kind)
    return unpack_upper(flat, A.shape[-1])


def barrier(group: ProcessGroup | None = None, stats: CommStats | None = None) -> None:
    """Every rank waits for every other (a one-element all-reduce, so it is counted)."""
    all_reduce(torch.zeros(1, device=device_for(group)), group=group, stats=stats, kind="barrier")
