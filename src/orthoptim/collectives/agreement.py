"""What every rank must agree on before it acts: whether each item has a gradient and whether
any is non-finite (`agree`, `agree_nonfinite` and its `Verdict`), and the small host-side
numbers a training loop sums or gathers (`sum_floats`, `gather_floats`)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, NamedTuple

import torch
from torch import Tensor

from orthoptim import host
from orthoptim.collectives.devices import device_for, to_backend
from orthoptim.collectives.errors import phase
from orthoptim.collectives.groups import world
from orthoptim.collectives.ops import all_gather, all_reduce

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

    from orthoptim.comm_bytes import CommStats


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
