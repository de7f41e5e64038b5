"""Writes under --out that fail: a full disk said in one line naming the path and the bytes
free (`no_space`, `disk_full_error`), a checkpoint that could not be saved
(`CheckpointSaveError`), and a log file that, its disk full, says so once and drops its lines
(`RunLogHandler`)."""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import shutil
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import ClassVar

# Below this much free space a failed write is reported as the disk being full.
FULL_BELOW_BYTES = 16 * 2**20


class CheckpointSaveError(OSError):
    """A checkpoint could not be written (no space left, an unwritable folder). The step folder
    being written is removed; the last committed checkpoint is intact. `knock_on` is True on
    a rank whose own part was written but another rank's failed: that rank's error is the
    cause, this one only its echo."""

    knock_on = False


def free_bytes(path: Path) -> int:
    """The bytes free on the disk of `path` (or of its nearest folder that exists); 0 if none."""
    for p in (path, *path.parents):
        with contextlib.suppress(OSError):
            return shutil.disk_usage(p).free
    return 0


def no_space(path: Path) -> str:
    """What a write that ran out of space says: the path and the bytes still free on its disk."""
    return f"no space left on {path} ({free_bytes(path)} bytes free)"


def raised_from(exc: BaseException) -> Iterator[BaseException]:
    """`exc`, the exception it was raised from (or while handling), that one's, and so on."""
    seen: set[int] = set()
    at: BaseException | None = exc
    while at is not None and id(at) not in seen:
        seen.add(id(at))
        yield at
        at = at.__cause__ or at.__context__


def is_disk_full(exc: BaseException) -> bool:
    """Whether `exc`, or an exception it was raised from, is the OS saying the disk (or the
    user's quota) is full."""
    return any(
        isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT) for e in raised_from(exc)
    )


class DiskFullError(OSError):
    """A run's write under --out failed for want of space; the message names the path, the
    bytes free and what to do."""


def disk_full_error(exc: BaseException, out: Path) -> DiskFullError | None:
    """`exc` as a `DiskFullError` when it is a write under `out` that ran out of space (the
    file the OS names, else `out`), None otherwise. A `CheckpointSaveError` already says so."""
    if isinstance(exc, CheckpointSaveError) or not is_disk_full(exc):
        return None
    name = getattr(exc, "filename", None)
    path = Path(name) if isinstance(name, str | os.PathLike) else out
    return DiskFullError(
        f"{no_space(path)}; free space on that disk, then run again (--resume continues "
        "from the last checkpoint)"
    )


class RunLogHandler(logging.FileHandler):
    """A log file under --out that, once a write to it fails (its disk full), says so in one
    line on stderr (once per file and process) and drops its further records, instead of
    logging's traceback per record."""

    _told: ClassVar[set[str]] = set()  # the files this process said it cannot write

    def __init__(self, path: Path) -> None:
        super().__init__(path)
        self.failed = False

    def emit(self, record: logging.LogRecord) -> None:
        if not self.failed:
            super().emit(record)

    def handleError(self, record: logging.LogRecord) -> None:
        exc = sys.exc_info()[1]
        if not isinstance(exc, OSError):
            super().handleError(record)
            return
        self.failed = True
        path = Path(self.baseFilename)
        if self.baseFilename not in self._told:
            self._told.add(self.baseFilename)
            why = no_space(path) if is_disk_full(exc) else f"cannot write {path} ({exc})"
            print(f"orthoptim: {why}; its log lines are dropped from here on", file=sys.stderr)
        with contextlib.suppress(OSError):  # its buffer cannot be written either
            self.close()

    def close(self) -> None:
        with contextlib.suppress(OSError):
            super().close()
