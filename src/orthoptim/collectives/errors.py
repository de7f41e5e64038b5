"""What a failed collective raises, and the named steps it fails in.

Every torch.distributed call is made inside `issuing` (through `issue`, which also files the
call under its kind for `issuing_kind`): what the call, or the wait of its work (`Work`),
raises becomes a `CollectiveError` ("another rank probably died or stalled"). Out-of-memory
and a device the backend does not serve are this rank's own and stay what they are (the
latter a `CollectiveDeviceError`). `phase(name)` names the step a failure happened in: a
`CollectiveError` gets the name in its message, any other exception is re-raised as itself
with a note naming the phase (`note`), so it is not blamed on another rank."""

from __future__ import annotations

import contextlib
import contextvars
import sys
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from orthoptim.collectives.devices import NO_BACKEND_FOR_DEVICE, device_error
from orthoptim.collectives.groups import world

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup


class CollectiveError(RuntimeError):
    """A collective failed or timed out: usually another rank died or stalled.

    `collective` is the torch.distributed operation that failed ("all_reduce", ...), `phase`
    the step that was waiting (set by `phase()`; None outside one); the original error is the
    `__cause__`."""

    collective: str
    phase: str | None


def _failure_message(exc: CollectiveError, group: ProcessGroup | None) -> str:
    rank, n = world(group)
    where = exc.collective if exc.phase is None else f"{exc.phase} ({exc.collective})"
    return (
        f"rank {rank} of {n}: {where} failed: {exc.__cause__}. Another rank probably died or "
        "stalled; the process-group timeout (init_process_group(timeout=...)) bounds this "
        "wait. Restart every rank from the last checkpoint."
    )


def collective_error(
    collective: str, cause: BaseException, group: ProcessGroup | None, phase: str | None = None
) -> CollectiveError:
    """The `CollectiveError` for `cause`, raised by (or while waiting for) `collective`."""
    err = CollectiveError()
    err.collective, err.phase, err.__cause__ = collective, phase, cause
    err.args = (_failure_message(err, group),)
    return err


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
        if NO_BACKEND_FOR_DEVICE in str(exc):
            raise device_error(collective, exc, group) from exc
        raise collective_error(collective, exc, group) from exc


class Work:
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


# The kind `issue` files the torch.distributed call it is making under, while it makes it.
_ISSUING: contextvars.ContextVar[str | None] = contextvars.ContextVar("issuing", default=None)


def issuing_kind() -> str | None:
    """The kind of the collective this library is issuing right now (its `CommStats` kind),
    or None: what an observer of torch's dispatch (the dry run's recorder) files it under."""
    return _ISSUING.get()


def issue(collective: str, group: ProcessGroup | None, call: Any, *args: Any, **kwargs: Any) -> Any:
    """`call(*args, group=group, **kwargs)` (a torch.distributed collective) under
    `issuing`; the work of an async call comes back as a `Work`."""
    token = _ISSUING.set(collective)
    try:
        with issuing(collective, group):
            work = call(*args, group=group, **kwargs)
    finally:
        _ISSUING.reset(token)
    return Work(work, collective, group) if work is not None else None


_ADD_NOTE = sys.version_info >= (3, 11)  # BaseException.add_note (PEP 678)


def note(exc: BaseException, text: str) -> None:
    """Attach `text` to `exc` (PEP 678: tracebacks print it under the message). Python 3.10
    has no `add_note`: there `__notes__` is set by hand and, as 3.10 does not print it, the
    note is also appended to a one-string message."""
    if _ADD_NOTE:
        exc.add_note(text)
        return
    exc.__notes__ = [*getattr(exc, "__notes__", ()), text]  # type: ignore[attr-defined]
    if len(exc.args) == 1 and isinstance(exc.args[0], str):
        exc.args = (f"{exc.args[0]}\n{text}",)


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
        raise collective_error(type(exc).__name__, exc, group, name) from exc
    except Exception as exc:
        if isinstance(exc, RuntimeError) and NO_BACKEND_FOR_DEVICE in str(exc):
            raise device_error(name, exc, group) from exc
        _in_phase(exc, name, group)
        raise


def _in_phase(exc: Exception, name: str, group: ProcessGroup | None) -> None:
    """Note on a local error `exc` that it was raised in phase `name` (once: the innermost)."""
    if getattr(exc, "_orthoptim_phase", None) is None:
        exc._orthoptim_phase = name  # type: ignore[attr-defined]
        rank, n = world(group)
        note(
            exc, f"rank {rank} of {n}: raised by this rank during {name} (not a failed collective)"
        )


def wait(work: Any, name: str, group: ProcessGroup | None = None) -> Any:
    """`work.wait()` (when `work` is not None) with failures reported under phase `name`."""
    if work is None:
        return None
    with phase(name, group):
        return work.wait()
