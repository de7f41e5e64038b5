"""Meeting the other ranks through the default process group's key-value store, with no
collective of its own: `rendezvous` before a collective some ranks may enter alone (a
trainer that saves on rank 0 only), so that it fails within `RENDEZVOUS_TIMEOUT_S` with the
fix instead of hanging until the process group's timeout."""

from __future__ import annotations

import datetime
import hashlib
from collections import defaultdict
from typing import TYPE_CHECKING, Any

import torch.distributed as dist

from orthoptim._torch_compat import default_store
from orthoptim.collectives.errors import collective_error
from orthoptim.collectives.groups import world

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup


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
        err = collective_error("rendezvous", RuntimeError(late), group, name)
        err.args = (
            f"rank {rank} of {n}: {name} (rendezvous) failed: {late}. Another rank probably "
            f"died or stalled, or the program calls it on some ranks only: {fix}",
        )
        raise err  # noqa: B904 (its cause is set: the count that fell short)
