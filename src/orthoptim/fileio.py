"""Files replaced at once, the library's one writer of them: checkpoint files, run records and
the kernel decisions file are written aside to a temporary file in the same folder, flushed to
disk, renamed over the old file, and the folder flushed after the rename, so a crash or a
power loss leaves the old content or the new, never a partial file. A write that fails
removes its temporary file and raises the OS's error (naming the file where the OS does).
"""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Callable
from typing import IO, Any

PathLike = str | os.PathLike[str]


def fsync_dir(path: PathLike) -> None:
    """Flush folder `path`'s entries (a rename into it) to disk. A folder that cannot be opened
    or synced (some file systems refuse) is passed over: the rename itself has happened."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def atomic_write(
    path: PathLike,
    fill: Callable[[IO[bytes]], None],
    *,
    durable: bool = True,
    tmp: PathLike | None = None,
    before_rename: Callable[[str], None] | None = None,
) -> None:
    """Replace `path` at once with what `fill` writes into the open (binary) temporary file
    `tmp` (default `<path>.tmp.<pid>`), renamed over `path` when `fill` returns. With `durable`
    the file is flushed to disk before the rename and its folder after it; without it (files
    rewritten every second, such as heartbeats) nothing waits for the disk. `before_rename`
    is called with the temporary file's path just before the rename. On any failure (an
    interrupt too) the temporary file is removed and the error raised; `path` is untouched."""
    path = os.fspath(path)
    tmp = os.fspath(tmp) if tmp is not None else f"{path}.tmp.{os.getpid()}"
    try:
        with open(tmp, "wb") as f:
            fill(f)
            if durable:
                f.flush()
                os.fsync(f.fileno())
        if before_rename is not None:
            before_rename(tmp)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.remove(tmp)
        raise
    if durable:
        fsync_dir(os.path.dirname(os.path.abspath(path)))


def atomic_write_bytes(
    data: bytes, path: PathLike, *, durable: bool = True, tmp: PathLike | None = None
) -> None:
    """`atomic_write` of `data`."""
    atomic_write(path, lambda f: f.write(data), durable=durable, tmp=tmp)


def atomic_write_text(
    text: str, path: PathLike, *, durable: bool = True, tmp: PathLike | None = None
) -> None:
    """`atomic_write` of `text`, UTF-8 encoded."""
    atomic_write_bytes(text.encode(), path, durable=durable, tmp=tmp)


def atomic_write_json(
    obj: Any, path: PathLike, *, durable: bool = True, tmp: PathLike | None = None, **dump: Any
) -> None:
    """`atomic_write` of `obj` as JSON (`json.dumps(obj, **dump)`), ending in a newline."""
    atomic_write_text(json.dumps(obj, **dump) + "\n", path, durable=durable, tmp=tmp)
