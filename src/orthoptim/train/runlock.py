"""The lock of a run folder (`acquire_lock`, `release_lock`): `out/.lock`, created atomically,
names the host, pid and start time of the run using the folder; a lock whose run is gone is
taken over, a live one refused naming it."""

from __future__ import annotations

import contextlib
import datetime
import json
import logging
import os
import socket
import time
from pathlib import Path
from typing import Any

from orthoptim.train.diskfull import is_disk_full, no_space

LOCK_FILE = ".lock"


_log = logging.getLogger(__name__)


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # alive, another user's
        return True
    return True


def _read_lock(path: Path) -> dict[str, Any] | None:
    """The lock's holder; None if the lock is gone. A holder between creating and writing the
    file is waited for (briefly, and not for a lock older than LOCK_WRITE_S); a lock that stays
    unreadable reads as {}."""
    for _ in range(20):
        try:
            holder = json.loads(path.read_text())
        except FileNotFoundError:
            return None
        except (OSError, ValueError):
            if (_age_s(path) or 0.0) > LOCK_WRITE_S:
                return {}
            time.sleep(0.05)
            continue
        return holder if isinstance(holder, dict) else {}
    return {}


# A run writes its lock's content right after creating it: a lock still without a holder
# this long after it was created was left by a process that crashed in between.
LOCK_WRITE_S = 10.0
LOCK_TIME_FORMAT = "%Y-%m-%dT%H:%M:%S%z"


def _age_s(path: Path) -> float | None:
    try:
        return time.time() - path.stat().st_mtime
    except OSError:
        return None


def _started_s(pid: int) -> float | None:
    """When process `pid` started (seconds since the epoch; Linux's /proc), or None."""
    try:
        ticks = int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19])
        boot = next(
            int(line.split()[1])
            for line in Path("/proc/stat").read_text().splitlines()
            if line.startswith("btime ")
        )
    except (OSError, ValueError, IndexError, StopIteration):
        return None
    return boot + ticks / os.sysconf("SC_CLK_TCK")


def _not_a_run(pid: int, holder: dict[str, Any]) -> str | None:
    """Why live process `pid` cannot be the run that wrote lock `holder` (it started after
    the lock was taken, or its command line is no Python's), or None when it may be."""
    with contextlib.suppress(ValueError, TypeError):
        when = datetime.datetime.strptime(str(holder.get("started")), LOCK_TIME_FORMAT)
        locked = when.timestamp()
        started = _started_s(pid)
        # Both are whole seconds (the boot time and the lock's), and the lock is taken after
        # its process starts: a process started later is another one.
        if started is not None and started > locked + 5:
            return f"it started at {time.strftime(LOCK_TIME_FORMAT, time.localtime(started))}"
    try:
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return None
    command = " ".join(a.decode(errors="replace") for a in argv if a)
    if command and not any(w in command.lower() for w in ("orthoptim", "python")):
        return f"it runs {command[:80]!r}"
    return None


def _remove_stale(path: Path, holder: dict[str, Any]) -> None:
    """Remove the stale lock `holder`, and only it: move it aside first, so that a lock
    another process has just put in its place is put back rather than removed."""
    aside = path.with_name(f"{path.name}.stale-{os.getpid()}")
    try:
        os.replace(path, aside)
    except FileNotFoundError:
        return
    if _read_lock(aside) != holder:
        with contextlib.suppress(FileExistsError):
            os.link(aside, path)
    aside.unlink()


def acquire_lock(out: Path) -> Path:
    """Take `out/.lock` (created atomically; it holds this host, pid and start time) and
    return its path. A lock left by a process of this host that is no longer running is stale:
    taken over with a logged notice, and so is one still naming no holder LOCK_WRITE_S after
    it was created (its run crashed between creating and writing it). A live holder, or one on
    another host (whose liveness cannot be checked from here), is refused with a ValueError
    naming it; a live pid that cannot be the holder (`_not_a_run`: a pid reused after a
    restart) is refused saying so. A lock whose write fails (a full disk) is removed."""
    out.mkdir(parents=True, exist_ok=True)
    path = out / LOCK_FILE
    host = socket.gethostname()
    me = dict(host=host, pid=os.getpid(), started=time.strftime(LOCK_TIME_FORMAT))
    for _ in range(5):
        try:
            fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        except FileExistsError:
            holder = _read_lock(path)
            if holder is None:  # released meanwhile
                continue
            who = (
                f"host {holder.get('host')}, pid {holder.get('pid')}, "
                f"started {holder.get('started')}"
            )
            if not {"host", "pid"} <= holder.keys():
                age = _age_s(path)
                if age is None or age < LOCK_WRITE_S:
                    raise ValueError(
                        f"--out {out} is locked ({path} unreadable); if no run is using the "
                        f"folder, remove {path}"
                    ) from None
                _log.warning(
                    "--out %s: taking over %s, empty or unreadable %.0f s after it was "
                    "created (its run crashed while taking it)", out, path, age,
                )  # fmt: skip
                _remove_stale(path, holder)
                continue
            if holder["host"] != host:
                raise ValueError(
                    f"--out {out} is in use by a run on another machine ({who}); its liveness "
                    f"cannot be checked from {host}: if that run is gone, remove {path}"
                ) from None
            if _pid_alive(int(holder["pid"])):
                other = _not_a_run(int(holder["pid"]), holder)
                if other is not None:
                    raise ValueError(
                        f"--out {out} is locked by pid {holder['pid']} ({who}), which is alive "
                        f"but is no orthoptim run: {other}. After a restart (of a container "
                        "or the machine) another process may have that pid; if no run is "
                        f"using the folder, remove {path}"
                    ) from None
                raise ValueError(
                    f"--out {out} is in use by another run ({who}); wait for it to end or "
                    "pass another --out"
                ) from None
            _log.warning("--out %s: taking over the stale lock of a run that is gone (%s)",
                         out, who)  # fmt: skip
            _remove_stale(path, holder)
            continue
        try:
            with os.fdopen(fd, "w") as f:
                json.dump(me, f)
        except OSError as e:
            path.unlink(missing_ok=True)  # never leave a lock that names no holder
            why = no_space(out) if is_disk_full(e) else e.strerror or str(e)
            raise ValueError(
                f"--out {out}: cannot write its lock {path} ({why}); free space there or pass "
                "another --out"
            ) from e
        return path
    raise ValueError(f"--out {out}: could not take {path}; other runs keep taking it")


def release_lock(path: Path) -> None:
    """Remove the lock at `path` if this process holds it."""
    holder = _read_lock(path)
    if holder and holder.get("pid") == os.getpid() and holder.get("host") == socket.gethostname():
        path.unlink(missing_ok=True)
