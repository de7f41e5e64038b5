"""Every collective orthoptim issues goes through here, so bytes can be counted per step.

Byte accounting: every wrapper records in a `CommStats` the bytes each rank sends and
receives under the bandwidth-optimal ring or chain algorithm of its kind
(`orthoptim.comm_bytes`, where the formulas live and are explained).

Devices: a tensor handed to a collective must live on a device the group's backend serves —
CUDA for NCCL (and "cuda:gloo"), CPU or CUDA for plain gloo, both for "cpu:gloo,cuda:nccl".
`device_for(group)` names the device for tensors made for a collective (flags, sizes,
serialised objects, metrics), and every wrapper here refuses a tensor on another device with a
`CollectiveDeviceError` naming both, before the backend sees it.

Failures: every torch.distributed call is made inside `issuing`, which turns what the call
(or the wait of its work) raises into a `CollectiveError` ("another rank probably died or
stalled"): that is how a rank learns a peer died (gloo: connection closed) or stalled (the
process-group timeout; NCCL's watchdog, `dist.DistError`). Out-of-memory and a device the
backend does not serve are local and stay what they are. `phase(name)` names the step a
failure happened in: a `CollectiveError` gets the name in its message, any other exception
(a local bug, an out-of-memory while packing a buffer) is re-raised as itself with a note
naming the phase, so it is not blamed on another rank.
"""

from __future__ import annotations

import atexit
import contextlib
import contextvars
import datetime
import hashlib
import io
import math
import sys
import weakref
from collections import defaultdict
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Any, NamedTuple

import torch
import torch.distributed as dist
from torch import Tensor

from orthoptim import host
from orthoptim._torch_compat import default_store, unbind_world_defaults
from orthoptim.comm_bytes import (
    CommStats,
    broadcast_bytes,
    reduce_bytes,
    ring_all_gather_bytes,
    ring_all_reduce_bytes,
    ring_reduce_scatter_bytes,
)

# the shard and packing helpers, importable from here as before
from orthoptim.shards import cut_like as cut_like
from orthoptim.shards import is_dtensor, pack_upper, unpack_upper
from orthoptim.shards import local_shard as local_shard
from orthoptim.shards import packed_triangle_size as packed_triangle_size
from orthoptim.shards import shard_sizes as shard_sizes
from orthoptim.shards import wrap_local as wrap_local

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup


if dist.is_available():
    unbind_world_defaults()

# Drivers whose parameter gathers may still be in flight when the program ends (weakly held).
_PENDING_AT_EXIT: weakref.WeakSet[Any] = weakref.WeakSet()


def finish_at_exit(driver: Any) -> None:
    """Have `driver.wait_for_params()` called when the interpreter exits (`_end_at_exit`),
    so that no collective it launched is still in flight then; `driver` is held weakly."""
    _PENDING_AT_EXIT.add(driver)


@atexit.register
def _end_at_exit() -> None:
    """At interpreter exit, after the program's own exit handlers (this one is registered
    when orthoptim is imported, and they run last-registered first), end every process group
    while the interpreter still serves gloo's worker threads (one that releases a finished
    collective needs the interpreter, and aborts the process once its teardown has begun):
    release a group torch.distributed.nn bound after it started (`unbind_world_defaults`),
    land every collective a live driver still has in flight, and destroy the default group if
    the program left it, which joins gloo's threads. A failure here (a peer already gone) is
    no failure of the program's: it is left unsaid."""
    if not dist.is_available():
        return
    with contextlib.suppress(Exception):
        unbind_world_defaults()
    if not dist.is_initialized():
        return
    for driver in list(_PENDING_AT_EXIT):
        with contextlib.suppress(Exception):
            driver.wait_for_params()
    with contextlib.suppress(Exception):
        dist.destroy_process_group()


def _nbytes(t: Tensor) -> int:
    return t.numel() * t.element_size()


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


# -- devices ---------------------------------------------------------------------------------


class CollectiveDeviceError(ValueError):
    """A tensor handed to a collective lives on a device the group's backend does not serve."""


class CollectiveError(RuntimeError):
    """A collective failed or timed out: usually another rank died or stalled.

    `collective` is the torch.distributed operation that failed ("all_reduce", ...), `phase`
    the step that was waiting (set by `phase()`; None outside one); the original error is the
    `__cause__`."""

    collective: str
    phase: str | None


# What torch's process group says when a tensor's device has no backend in the group.
_NO_BACKEND_FOR_DEVICE = "No backend type associated with device type"


def _failure_message(exc: CollectiveError, group: ProcessGroup | None) -> str:
    rank, n = world(group)
    where = exc.collective if exc.phase is None else f"{exc.phase} ({exc.collective})"
    return (
        f"rank {rank} of {n}: {where} failed: {exc.__cause__}. Another rank probably died or "
        "stalled; the process-group timeout (init_process_group(timeout=...)) bounds this "
        "wait. Restart every rank from the last checkpoint."
    )


def _collective_error(
    collective: str, cause: BaseException, group: ProcessGroup | None, phase: str | None = None
) -> CollectiveError:
    """The `CollectiveError` for `cause`, raised by (or while waiting for) `collective`."""
    err = CollectiveError()
    err.collective, err.phase, err.__cause__ = collective, phase, cause
    err.args = (_failure_message(err, group),)
    return err


def _device_error(
    what: str, exc: BaseException, group: ProcessGroup | None
) -> CollectiveDeviceError:
    """The backend's own refusal of a tensor's device (`exc`), met in `what`."""
    rank, n = world(group)
    return CollectiveDeviceError(
        f"rank {rank} of {n}: {what}: a tensor is on a device the process group's "
        f"backend ({backend_config(group)}) does not serve: {exc}. Tensors handed to "
        f"its collectives must live on {' or '.join(backend_devices(group))}"
    )


@contextlib.contextmanager
def issuing(collective: str, group: ProcessGroup | None = None) -> Iterator[None]:
    """Around a call into torch.distributed (a collective, the wait of one, or a torch
    routine made of collectives such as a torch.distributed.checkpoint save, which reports
    its local failures as a CheckpointException): a RuntimeError it raises is the
    collective's failure, re-raised as a `CollectiveError` naming `collective`. Except
    out-of-memory and a tensor on a device the backend does not serve, which are this
    rank's own (a `CollectiveDeviceError`); other exceptions (argument checks) pass."""
    try:
        yield
    except CollectiveError:
        raise
    except torch.OutOfMemoryError:
        raise
    except RuntimeError as exc:
        if _NO_BACKEND_FOR_DEVICE in str(exc):
            raise _device_error(collective, exc, group) from exc
        raise _collective_error(collective, exc, group) from exc


class _Work:
    """An in-flight collective (torch's Work): `wait()` reports a failure as
    `CollectiveError`; everything else is the Work's own."""

    def __init__(self, work: Any, collective: str, group: ProcessGroup | None) -> None:
        self._work, self._collective, self._group = work, collective, group

    def wait(self, *args: Any, **kwargs: Any) -> Any:
        with issuing(self._collective, self._group):
            return self._work.wait(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        if name.startswith("_"):  # not set yet (copy, pickle): not the Work's
            raise AttributeError(name)
        return getattr(self._work, name)


# The kind `_issue` files the torch.distributed call it is making under, while it makes it.
_ISSUING: contextvars.ContextVar[str | None] = contextvars.ContextVar("issuing", default=None)


def issuing_kind() -> str | None:
    """The kind of the collective this library is issuing right now (its `CommStats` kind),
    or None: what an observer of torch's dispatch (the dry run's recorder) files it under."""
    return _ISSUING.get()


def _issue(
    collective: str, group: ProcessGroup | None, call: Any, *args: Any, **kwargs: Any
) -> Any:
    """`call(*args, group=group, **kwargs)` (a torch.distributed collective) under
    `issuing`; the work of an async call comes back as a `_Work`."""
    token = _ISSUING.set(collective)
    try:
        with issuing(collective, group):
            work = call(*args, group=group, **kwargs)
    finally:
        _ISSUING.reset(token)
    return _Work(work, collective, group) if work is not None else None


def backend_config(group: ProcessGroup | None = None) -> str:
    """The group's backend as "device:backend" pairs, e.g. "cpu:gloo,cuda:gloo" for gloo,
    "cuda:nccl" for NCCL; "" when torch.distributed is not initialised."""
    if not dist.is_available() or not dist.is_initialized():
        return ""
    return str(dist.get_backend_config(group))


_DEVICES_OF = {"gloo": ("cpu", "cuda"), "nccl": ("cuda",), "mpi": ("cpu", "cuda")}


def _backends(group: ProcessGroup | None = None) -> dict[str, str]:
    """{device type: name of the backend serving it} in `group`, in the backend's order;
    {} when torch.distributed is not initialised."""
    config = backend_config(group)
    if ":" not in config:  # a bare backend name from an older torch
        return dict.fromkeys(_DEVICES_OF.get(config, ()), config)
    pairs = (part.partition(":") for part in config.split(","))
    return {kind.strip(): name.strip() for kind, _, name in pairs}


def backend_devices(group: ProcessGroup | None = None) -> tuple[str, ...]:
    """Device types ("cpu", "cuda", ...) whose tensors `group`'s collectives accept, in
    the backend's order; () when torch.distributed is not initialised (anything goes)."""
    return tuple(_backends(group))


def _default_device(kind: str) -> torch.device:
    """The device of type `kind` this process uses (CUDA: the current device)."""
    if kind == "cuda" and torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device(kind)


def device_for(
    group: ProcessGroup | None = None, like: torch.device | str | Tensor | None = None
) -> torch.device:
    """The device for a tensor made to be handed to `group`'s collectives: `like`'s device (a
    device or a tensor) when the backend serves its type, else the backend's first device type
    (CPU for gloo, the current CUDA device for NCCL). CPU without a process group."""
    if isinstance(like, Tensor):
        like = like.device
    like = torch.device(like) if like is not None else None
    served = backend_devices(group)
    if like is not None and (not served or like.type in served):
        return like
    if not served or "cpu" in served:
        return torch.device("cpu")
    return _default_device(served[0])


def check_device(t: Tensor, what: str, group: ProcessGroup | None = None) -> None:
    """Raise `CollectiveDeviceError` unless `group`'s backend serves `t`'s device."""
    served = backend_devices(group)
    if served and t.device.type not in served:
        raise CollectiveDeviceError(
            f"{what}: the tensor is on {t.device}, but the process group's backend "
            f"({backend_config(group)}) takes only {' or '.join(served)} tensors; create it on "
            f"collectives.device_for(group) ({device_for(group)}) or move it there first"
        )


def to_backend(t: Tensor, group: ProcessGroup | None = None) -> Tensor:
    """`t` itself when `group`'s backend serves its device, else a copy on `device_for(group)`."""
    return t.to(device_for(group, t))


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
    _, n = world(group)
    if n == 1:
        return None
    check_device(t, kind, group)
    if stats is not None:
        b = ring_all_reduce_bytes(_nbytes(t), n)
        stats.record(kind, b, b)
    return _issue(kind, group, dist.all_reduce, t, op=op or dist.ReduceOp.SUM, async_op=async_op)


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
    rank, n = world(group)
    if n == 1:
        out.copy_(inp)
        return None
    check_device(inp, kind, group)
    check_device(out, kind, group)
    if stats is not None:
        stats.record(kind, *ring_reduce_scatter_bytes([_nbytes(inp) / n] * n)[rank])
    op = op or dist.ReduceOp.SUM
    return _issue(kind, group, _REDUCE_SCATTER, out, inp, op=op, async_op=async_op)


def all_gather(
    out: Tensor,
    inp: Tensor,
    group: ProcessGroup | None = None,
    stats: CommStats | None = None,
    async_op: bool = False,
    kind: str = "all_gather",
) -> Any:
    """`out` (N × inp elements, rank-major) ← every rank's `inp`."""
    rank, n = world(group)
    if n == 1:
        out.copy_(inp.reshape(out.shape))
        return None
    check_device(inp, kind, group)
    check_device(out, kind, group)
    if stats is not None:
        stats.record(kind, *ring_all_gather_bytes([_nbytes(out) / n] * n)[rank])
    return _issue(kind, group, _ALL_GATHER, out, inp, async_op=async_op)


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


def global_rank(group: ProcessGroup | None, group_rank: int) -> int:
    """The global rank of `group_rank` in `group` (what broadcast / reduce take as src / dst)."""
    if group is None or not dist.is_initialized():
        return group_rank
    return dist.get_global_rank(group, group_rank)


def reduce(
    t: Tensor,
    dst: int,
    op: Any = None,
    group: ProcessGroup | None = None,
    stats: CommStats | None = None,
    async_op: bool = False,
) -> Any:
    """Sum `t` over ranks into global rank `dst` (in place there; undefined elsewhere)."""
    rank, n = world(group)
    if n == 1:
        return None
    check_device(t, "reduce", group)
    if stats is not None:
        stats.record("reduce", *reduce_bytes(_nbytes(t), n, group_rank(group, dst))[rank])
    op = op or dist.ReduceOp.SUM
    return _issue("reduce", group, dist.reduce, t, dst=dst, op=op, async_op=async_op)


def broadcast(
    t: Tensor,
    src: int,
    group: ProcessGroup | None = None,
    stats: CommStats | None = None,
    async_op: bool = False,
) -> Any:
    """Broadcast `t` from group rank `src` (a global rank, as torch.distributed expects)."""
    rank, n = world(group)
    if n == 1:
        return None
    check_device(t, "broadcast", group)
    if stats is not None:
        stats.record("broadcast", *broadcast_bytes(_nbytes(t), n, group_rank(group, src))[rank])
    return _issue("broadcast", group, dist.broadcast, t, src=src, async_op=async_op)


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
    rank, n = world(group)
    if n == 1:
        out.copy_(inp)
        return None
    check_device(inp, kind, group)
    check_device(out, kind, group)
    if stats is not None:
        es = inp.element_size()
        stats.record(
            kind,
            (sum(in_splits) - in_splits[rank]) * es,
            (sum(out_splits) - out_splits[rank]) * es,
        )
    return _issue(
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
) -> Tensor:
    """Sum symmetric [..., m, m] matrices over ranks, sending only the packed upper triangle.

    m(m+1)/2 elements cross the wire instead of m², half the bytes for large m.
    Returns a new tensor; `A` is left as it was.
    """
    _, n = world(group)
    if n == 1:
        return A.clone()
    packed = pack_upper(A).contiguous()
    all_reduce(packed, group=group, stats=stats, kind=kind)
    return unpack_upper(packed, A.shape[-1])


# -- objects, barriers and named phases -----------------------------------------------------


_ADD_NOTE = sys.version_info >= (3, 11)  # BaseException.add_note (PEP 678)


def _note(exc: BaseException, note: str) -> None:
    """Attach `note` to `exc` (PEP 678: tracebacks print it under the message). Python 3.10
    has no `add_note`: there `__notes__` is set by hand and, as 3.10 does not print it, the
    note is also appended to a one-string message."""
    if _ADD_NOTE:
        exc.add_note(note)
        return
    exc.__notes__ = [*getattr(exc, "__notes__", ()), note]  # type: ignore[attr-defined]
    if len(exc.args) == 1 and isinstance(exc.args[0], str):
        exc.args = (f"{exc.args[0]}\n{note}",)


@contextlib.contextmanager
def phase(name: str, group: ProcessGroup | None = None) -> Iterator[None]:
    """Name the step `name` in what fails inside, so a user learns where it failed and why.

    A collective that failed or timed out (`CollectiveError`, raised by the wrappers here;
    or a `dist.DistError`: NCCL's watchdog, the store) is re-raised as a `CollectiveError`
    naming `name`: another rank probably died or stalled, and the process-group timeout
    (`init_process_group(timeout=...)`) bounded the wait. Any other exception is this rank's
    own (an out-of-memory, a bug) and is re-raised as itself, same type and traceback, with
    a note naming `name` (`exc.__notes__`), not blamed on another rank. The innermost phase
    names a failure; enclosing phases leave it as it is.
    """
    try:
        yield
    except CollectiveError as exc:
        if exc.phase is None:
            exc.phase = name
            exc.args = (_failure_message(exc, group),)
        raise
    except dist.DistError as exc:
        raise _collective_error(type(exc).__name__, exc, group, name) from exc
    except Exception as exc:
        if isinstance(exc, RuntimeError) and _NO_BACKEND_FOR_DEVICE in str(exc):
            raise _device_error(name, exc, group) from exc
        _in_phase(exc, name, group)
        raise


def _in_phase(exc: Exception, name: str, group: ProcessGroup | None) -> None:
    """Note on a local error `exc` that it was raised in phase `name` (once: the innermost)."""
    if getattr(exc, "_orthoptim_phase", None) is None:
        exc._orthoptim_phase = name  # type: ignore[attr-defined]
        rank, n = world(group)
        _note(
            exc, f"rank {rank} of {n}: raised by this rank during {name} (not a failed collective)"
        )


def wait(work: Any, name: str, group: ProcessGroup | None = None) -> Any:
    """`work.wait()` (when `work` is not None) with failures reported under phase `name`."""
    if work is None:
        return None
    with phase(name, group):
        return work.wait()


def _summed(
    flags: Tensor, groups: Sequence[ProcessGroup | None], stats: CommStats | None, what: str
) -> Tensor:
    """`flags` summed over each group in turn (moved to a device each backend serves)."""
    for g in groups:
        flags = to_backend(flags, g)
        with phase(what, g):
            all_reduce(flags, group=g, stats=stats)
    return flags


def agree(
    present: Sequence[bool],
    bad: Sequence[bool] | Tensor,
    group: ProcessGroup | Sequence[ProcessGroup | None] | None = None,
    stats: CommStats | None = None,
    device: torch.device | str | None = None,
    across: Sequence[ProcessGroup | None] = (),
) -> tuple[list[bool], list[bool]]:
    """What every rank must agree on before a distributed step, in ONE small all-reduce per
    group and ONE host read: `present[i]` (item i has a gradient here) and `bad[j]` (item j's
    gradient is non-finite here: bools, or a device tensor of counts, 0 meaning finite) are
    packed as int32 counts of what is wrong (a missing gradient, a non-finite one: zero is
    the normal answer, and the one a dry run gives) on `device` when the backend serves it,
    else on `device_for(group)`; summed over `group` (or over each group of a sequence in
    turn, e.g. data-parallel then tensor-parallel) and read once, so every rank gets
    (present anywhere, non-finite anywhere) and skips, raises or steps together.

    `across`: groups whose ranks hold other items (pipeline stages), over which `bad` alone
    is summed on, in one more all-reduce per group and the same host read; the returned bad
    flags are then those of `group` followed by those of every rank."""
    groups = list(group) if isinstance(group, (list, tuple)) else [group]
    ranks = math.prod(world(g)[1] for g in groups)
    dev = device_for(groups[0], device)
    missing = torch.tensor([not p for p in present], dtype=torch.int32, device=dev)
    if not isinstance(bad, Tensor):
        bad = torch.tensor(list(bad), dtype=torch.bool, device=dev)
    flags = torch.cat([missing, bad.reshape(-1).to(device=dev, dtype=torch.int32)])
    flags = _summed(flags, groups, stats, "non-finite gradient agreement (all-reduce)")
    k = len(present)
    if across:
        what = "non-finite gradient agreement across stages (all-reduce)"
        everywhere = _summed(flags[k:].clone(), across, stats, what)
        flags = torch.cat([flags, everywhere.to(flags.device)])
    summed = host.read(flags, "non-finite agreement").tolist()
    return [v < ranks for v in summed[:k]], [v > 0 for v in summed[k:]]


class Verdict(NamedTuple):
    """What `agree_nonfinite` found: `present[i]` (item i has a gradient on some rank of the
    stage), `which[j]` (item j's gradient is non-finite on some rank of the stage; [] when
    none is), `elsewhere` (only ranks across it counted one), `refused` (some rank did)."""

    present: list[bool]
    which: list[bool]
    elsewhere: bool
    refused: bool = False


def agree_nonfinite(
    present: Sequence[bool],
    checks: Sequence[Tensor],
    per_item: Any,
    group: ProcessGroup | Sequence[ProcessGroup | None] | None = None,
    stats: CommStats | None = None,
    device: torch.device | str | None = None,
    across: Sequence[ProcessGroup | None] = (),
    refused: bool = False,
) -> Verdict:
    """`agree` for a distributed step's non-finite check, in two rounds: the `checks` (0-d
    flags, true for a local gradient that holds NaN or Inf) are summed on the device into one
    count that rides with `present` and this rank's `refused` in one all-reduce per group of
    `group` (the stage: its ranks hold the same items) and goes on, with `refused`, over each
    group of `across` (the pipeline stages, other items), read in one host read. Only when
    some rank of the stage counts one is `per_item()` (a flag per item) agreed too, to name
    them."""
    flags = [c if device is None else c.to(device) for c in checks]
    count = torch.stack(flags).sum() if flags else torch.tensor(0)
    counts = torch.stack([count, count.new_tensor(int(refused))])
    present, anywhere = agree(present, counts, group, stats, device, across=across)
    here, everywhere = anywhere[0], anywhere[-2]
    which: list[bool] = []
    if here:
        _, which = agree([], per_item(), group=group, stats=stats, device=device)
    return Verdict(present, which, everywhere and not here, anywhere[-1])


# How long a rendezvous waits for the other ranks: a collective entered by some ranks only
# (a trainer that saves on rank 0 alone) fails within this, instead of at the process group's
# timeout (30 minutes by default).
RENDEZVOUS_TIMEOUT_S = 20.0
_rendezvous_calls: defaultdict[str, int] = defaultdict(int)


def _store() -> Any:
    """The default process group's key-value store, or None (not initialised, a fake one)."""
    if not dist.is_available() or not dist.is_initialized() or dist.get_backend() == "fake":
        return None
    try:
        return default_store()
    except (RuntimeError, ValueError, AttributeError):
        return None


def rendezvous(
    name: str, fix: str, group: ProcessGroup | None = None, timeout_s: float | None = None
) -> None:
    """Return once every rank of `group` has entered the rendezvous `name` (the n-th call of
    `name` meets the n-th call on the other ranks), or raise RuntimeError after `timeout_s`
    (`RENDEZVOUS_TIMEOUT_S`) saying how many ranks came and `fix`. Called before a collective
    that some ranks may enter alone, through the default store (no collective of its own;
    works over every backend)."""
    rank, n = world(group)
    store = _store() if n > 1 else None
    if store is None:
        return
    ranks = dist.get_process_group_ranks(group) if group is not None else range(n)
    members = hashlib.sha1(",".join(map(str, ranks)).encode()).hexdigest()[:12]
    calls = f"{members}/{name}"
    _rendezvous_calls[calls] += 1
    key = f"orthoptim/rendezvous/{calls}/{_rendezvous_calls[calls]}"
    if store.add(key, 1) == n:
        store.set(f"{key}/all", "1")
        return
    timeout = RENDEZVOUS_TIMEOUT_S if timeout_s is None else timeout_s
    try:
        store.wait([f"{key}/all"], datetime.timedelta(seconds=timeout))
    except RuntimeError:
        # withdraw, so that the next call (made by every rank) meets the others' first one
        came = store.add(key, -1) + 1
        _rendezvous_calls[calls] -= 1
        late = f"only {came} of the {n} ranks entered it within {timeout:g} s"
        err = _collective_error("rendezvous", RuntimeError(late), group, name)
        err.args = (
            f"rank {rank} of {n}: {name} (rendezvous) failed: {late}. Another rank probably "
            f"died or stalled, or the program calls it on some ranks only: {fix}",
        )
        raise err  # noqa: B904 (its cause is set: the count that fell short)


def barrier(group: ProcessGroup | None = None, stats: CommStats | None = None) -> None:
    """Every rank waits for every other (a one-element all-reduce, so it is counted)."""
    all_reduce(torch.zeros(1, device=device_for(group)), group=group, stats=stats, kind="barrier")


def sum_floats(values: list[float], group: ProcessGroup | None = None) -> list[float]:
    """`values` summed over the ranks (float64, on the backend's device); unchanged without a
    process group. For the small host-side numbers a training loop agrees on."""
    if world(group)[1] == 1:
        return list(values)
    t = torch.tensor(values, dtype=torch.float64, device=device_for(group))
    all_reduce(t, group=group)
    return t.tolist()


def gather_floats(values: list[float], group: ProcessGroup | None = None) -> list[list[float]]:
    """Every rank's `values` (the same length on every rank), in rank order."""
    n = world(group)[1]
    if n == 1:
        return [list(values)]
    t = torch.tensor(values, dtype=torch.float64, device=device_for(group))
    out = t.new_empty(n * t.numel())
    all_gather(out, t, group=group)
    return out.view(n, -1).tolist()


def _to_bytes(obj: Any, device: torch.device) -> Tensor:
    """`obj` serialised with torch.save, as a uint8 tensor on `device`."""
    buf = io.BytesIO()
    torch.save(obj, buf)
    return torch.frombuffer(bytearray(buf.getvalue()), dtype=torch.uint8).to(device)


def _from_bytes(t: Tensor) -> Any:
    return torch.load(io.BytesIO(t.cpu().numpy().tobytes()), weights_only=False)


def all_gather_object(
    obj: Any, group: ProcessGroup | None = None, stats: CommStats | None = None
) -> list[Any]:
    """Every rank's `obj` (tensors included, serialised with torch.save), in rank order."""
    rank, n = world(group)
    if n == 1:
        return [obj]
    device = device_for(group)
    data = _to_bytes(obj, device)
    sizes = torch.zeros(n, dtype=torch.int64, device=device)
    sizes[rank] = data.numel()
    all_reduce(sizes, group=group, stats=stats)
    parts = all_gatherv(data, sizes.tolist(), group=group, stats=stats).wait()
    return [_from_bytes(p) for p in parts]


def gather_object(
    obj: Any, dst: int = 0, group: ProcessGroup | None = None, stats: CommStats | None = None
) -> list[Any] | None:
    """Every rank's `obj` on group rank `dst` (point to point, so only `dst` holds them all);
    None on the other ranks."""
    rank, n = world(group)
    if n == 1:
        return [obj]
    device = device_for(group)
    if device.type != "cpu" and _backends(group).get(device.type) == "gloo":
        # gloo's send/recv read host memory only: with CUDA tensors ("cuda:gloo") every rank
        # gathers everything and the others drop it.
        parts = all_gather_object(obj, group=group, stats=stats)
        return parts if rank == dst else None
    data = _to_bytes(obj, device)
    size = torch.tensor([data.numel()], dtype=torch.int64, device=device)
    if rank != dst:
        peer = global_rank(group, dst)
        _issue("gather", group, dist.send, size, peer)
        _issue("gather", group, dist.send, data, peer)
        if stats is not None:
            stats.record("gather", size.numel() * 8 + data.numel(), 0)
        return None
    out: list[Any] = []
    for r in range(n):
        if r == rank:
            out.append(obj)
            continue
        peer = global_rank(group, r)
        _issue("gather", group, dist.recv, size, peer)
        buf = torch.empty(int(size.item()), dtype=torch.uint8, device=device)
        _issue("gather", group, dist.recv, buf, peer)
        if stats is not None:
            stats.record("gather", 0, 8 + buf.numel())
        out.append(_from_bytes(buf))
    return out
