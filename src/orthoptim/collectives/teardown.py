"""The end of the process: at interpreter exit every collective still in flight is landed and
the process group ended while the interpreter still serves gloo's threads (`finish_at_exit`
names the drivers whose parameter gathers may be in flight). Importing this module also
releases the default groups torch.distributed.nn bound at its import
(`unbind_world_defaults`)."""

from __future__ import annotations

import contextlib
import weakref
from typing import Any

import torch.distributed as dist

from orthoptim._torch_compat import unbind_world_defaults

if dist.is_available():
    unbind_world_defaults()

# Drivers whose parameter gathers may still be in flight when the program ends (weakly held).
_PENDING_AT_EXIT: weakref.WeakSet[Any] = weakref.WeakSet()


def finish_at_exit(driver: Any) -> None:
    """Have `driver.wait_for_params()` called when the interpreter exits (`end_at_exit`),
    so that no collective it launched is still in flight then; `driver` is held weakly."""
    _PENDING_AT_EXIT.add(driver)


def end_at_exit() -> None:
    """At interpreter exit, after the program's own exit handlers (`orthoptim` registers this
    when it is imported, and they run last-registered first), end every process group
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
