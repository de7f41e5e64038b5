"""Ownership: the record of each group of units the optimizer assigns over one process group,
and the checks and loads that place the groups."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from torch import Tensor, nn
from torch.distributed import ProcessGroup

from orthoptim import collectives as C
from orthoptim.optim.hybrid import HybridOptimizer
from orthoptim.parallel.assignment import Assignment, Unit
from orthoptim.parallel.layerwise.slots import Slot, unit_label
from orthoptim.shards import is_dtensor


@dataclass
class UnitGroup:
    """The units data-parallel over one process group: `group` (None: the default group),
    `units` (indices into the optimizer's `units`), their `assignment` over the group's
    ranks, and `divisor`, what their summed gradients are divided by (the group's size, or
    for expert weights under expert parallelism `layout.expert_gradient_divisor`'s)."""

    group: ProcessGroup | None
    units: list[int]
    assignment: Assignment
    divisor: int
    expert: bool = False


def make_slots(
    units: list[Unit], named: dict[str, nn.Parameter], groups: list[UnitGroup]
) -> tuple[list[Slot], list[list[Slot]], dict[str, int]]:
    """One slot per unit owned whole and one per rank's run of a sharded AdamW unit
    (`Assignment.adamw_runs`, bucket by bucket), in unit order; the slots by unit; and the
    owner rank of every unit within its group by label (-1: AdamW, sharded over the group)."""
    owners = [0] * len(units)
    runs: dict[int, list[tuple[int, int, int]]] = {}
    for g in groups:
        for i, r in zip(g.units, g.assignment.owners):
            owners[i] = r
        for b in range(len(g.assignment.buckets)):
            runs.update((g.units[j], rs) for j, rs in g.assignment.adamw_runs(b).items())
    slots: list[Slot] = []
    for i, u in enumerate(units):
        p = named[u.name]
        if owners[i] >= 0:
            slots.append(Slot(u.name, p, i, owners[i], u.part))
            continue
        for r, lo, hi in runs.get(i, []):  # a run of the whole parameter is the parameter
            flat = None if (lo, hi) == (0, p.numel()) else (lo, hi)
            slots.append(Slot(u.name, p, i, r, flat=flat))
    by_unit: list[list[Slot]] = [[] for _ in units]
    for s in slots:
        by_unit[s.unit].append(s)
    for g in groups:
        rank = C.world(g.group)[0]
        for i in g.units:
            for s in by_unit[i]:
                s.mine = s.owner == rank
    owner_of = {unit_label(u.name, u.part): o for u, o in zip(units, owners)}
    return slots, by_unit, owner_of


def inner_parts(opt: Any) -> list[Any]:
    """The optimizers a built optimizer steps with: a hybrid's inner ones, else itself."""
    if opt is None:
        return []
    return list(opt.inner.values()) if isinstance(opt, HybridOptimizer) else [opt]


def carried_load(
    dense: Assignment, dense_group: ProcessGroup | None, group: ProcessGroup | None
) -> list[float]:
    """The load each rank of `group` carries from `dense` (an assignment over `dense_group`);
    0 for a rank outside `dense_group`. Read from the groups' members, so every rank of
    `group` gets the same list."""
    loads = dense.loads
    out = []
    for j in range(C.world(group)[1]):
        try:
            k = C.group_rank(dense_group, C.global_rank(group, j))
        except (ValueError, RuntimeError):
            k = -1
        out.append(loads[k] if 0 <= k < len(loads) else 0.0)
    return out


def check_tensor_parallel_layout(found: list[ProcessGroup | None], want: list[int]) -> None:
    """Refuse DTensor parameters whose mesh groups (`found`) are not the layout's tp group
    (of ranks `want`)."""
    import torch.distributed as dist

    for g in found:
        if C.world(g)[1] > 1 and dist.get_process_group_ranks(g) != want:
            raise ValueError(
                f"the model's tensor-parallel parameters are DTensors over ranks "
                f"{dist.get_process_group_ranks(g)}, but the layout's tp group is {want}: "
                "parallelize the model over layout.tp_mesh"
            )


def tensor_parallel_groups(
    params: dict[str, Tensor], process_group: ProcessGroup | None
) -> list[ProcessGroup | None]:
    """The process groups of the device meshes of the DTensor (tensor-parallel) parameters,
    one per mesh dimension, in first-seen order; each must meet the data-parallel group
    `process_group` in this rank only (the TP ranks of a data-parallel rank own the same
    matrices and run the orthogonalizer together)."""
    import torch.distributed as dist

    groups: list[ProcessGroup | None] = []
    for name, p in params.items():
        if not is_dtensor(p):
            continue
        mesh = p.device_mesh
        for d in range(mesh.ndim):
            g = mesh.get_group(d)
            if any(g is h for h in groups):
                continue
            if C.world(g)[1] > 1 and dist.is_initialized():
                dp = set(dist.get_process_group_ranks(process_group or dist.group.WORLD))
                shared = dp & set(dist.get_process_group_ranks(g))
                if len(shared) > 1:
                    raise ValueError(
                        f"{name} is a DTensor over ranks {sorted(dist.get_process_group_ranks(g))}"
                        f" (mesh dim {d}), which overlap the data-parallel process_group in "
                        f"{sorted(shared)}: pass the data-parallel group of a (dp, tp) mesh, "
                        "e.g. process_group=mesh['dp'].get_group(), and parallelize the model "
                        "over mesh['tp']"
                    )
            groups.append(g)
    return groups


def counted_here(s: Slot, tp_groups: list[ProcessGroup | None]) -> bool:
    """Whether this rank counts owned slot `s` in the gradient norm: always without
    tensor parallelism; under it, a DTensor's local shard unless the tensor is replicated
    over a mesh dimension where this rank's coordinate is not 0, a plain tensor on the
    first rank of every TP group only."""
    if not tp_groups:
        return True
    if not is_dtensor(s.param):
        return all(C.world(g)[0] == 0 for g in tp_groups)
    placements = s.param.placements
    coord = s.param.device_mesh.get_coordinate() or [0] * len(placements)
    return all(c == 0 for c, pl in zip(coord, placements) if pl.is_replicate())


def check_reproducible(world_size: int, tensor_parallel: bool, experts: bool, stages: int) -> None:
    """`reproducible=True` covers data parallelism over a power-of-two group: refuse the rest
    in one line that says what the guarantee covers."""
    covers = (
        "reproducible=True covers data parallelism alone over 1, 2, 4, 8, ... ranks "
        "(the layer-wise driver, no tensor, expert or pipeline parallelism)"
    )
    if world_size & (world_size - 1):
        raise ValueError(f"{covers}; this process group has {world_size} ranks")
    for what, there in (
        ("tensor-parallel (DTensor) parameters", tensor_parallel),
        ("an expert group", experts),
        ("pipeline stages", stages > 1),
    ):
        if there:
            raise ValueError(f"{covers}; this model/layout has {what}")
