"""The scale planner: a model description + a parallel layout → per-rank optimizer figures.

The ownership of every matrix comes from `orthoptim.parallel.assignment.assign`, the code
`LayerwiseDistributedOptimizer` runs, applied to the units that optimizer would see on one
rank of the layout:

* Tensor parallelism (`tp`) splits attention and dense-MLP matrices (column-parallel along
  rows, row-parallel along columns); the layer-wise optimizer of each TP rank sees its local
  shards, and all TP ranks of one data-parallel rank own the same matrices. MLA's down
  projections, the router and routed experts are not TP-split (expert TP = 1).
* Expert parallelism (`ep`, dividing `dp`) splits the routed experts of every MoE layer into
  `ep` equal groups. Data-parallel rank r holds the experts of EP rank r mod ep; those are
  replicated over the `dp/ep` ranks with the same EP rank (the expert-data-parallel group),
  among which the layer-wise optimizer assigns them. Everything else (attention, dense MLPs,
  shared experts, router, embeddings, norms) is replicated over all `dp` ranks and assigned
  among them first; each EP rank's experts are then dealt around the dense load of its
  group's ranks. Rank r's load is its dense share plus its expert-group share. Without expert
  parallelism (ep = 1) all units are one assignment over `dp`.

Every unit costs what its owner really does on its path (`unit_costs`, `MatrixCost`): the
cost the balancing balances and the per-rank Newton-Schulz figures add up.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from orthoptim.parallel.assignment import (
    Assignment,
    MatrixCost,
    Unit,
    assign,
    deal_adamw,
    state_numel,
)
from orthoptim.parallel.layout import ParallelDims
from orthoptim.parallel.ordered import NORM_BLOCK
from orthoptim.parallel.tensor_parallel import TP_MODES, CostModel, TPCost, pick_auto
from orthoptim.plan.activations import activation_figures
from orthoptim.plan.costs import (
    layerwise_bytes,
    layerwise_unpadded_bytes,
    tp_ns_cost,
    zero1_bytes,
)
from orthoptim.plan.hardware import PUBLISHED_GB300, Hardware, memory_verdict
from orthoptim.plan.layouts import (
    BALANCES,
    DTYPE_BYTES,
    Layout,
    PlanOptimizer,
    check_layout,
    keeps_masters,
)
from orthoptim.plan.memory import memory_per_rank
from orthoptim.plan.model import Matrix, ModelDescription, expand, param_counts
from orthoptim.plan.work import work_figures


def local_shape(m: Matrix, tp: int) -> tuple[int, ...]:
    """The shard of `m` one TP rank holds."""
    if m.tp_dim is None or tp == 1:
        return m.shape
    shape = list(m.shape)
    if shape[m.tp_dim] % tp:
        raise ValueError(
            f"--tp {tp} does not divide dim {m.tp_dim} of {m.name} {m.shape}; choose a --tp "
            "that divides the model's head counts and MLP sizes"
        )
    shape[m.tp_dim] //= tp
    return tuple(shape)


def backward_order(matrices: Sequence[Matrix]) -> list[Matrix]:
    """`matrices` (parameter order) in the order the layer-wise optimizer lists its units:
    parameters reversed (backward order), the experts of one parameter in ascending order."""
    runs: list[list[Matrix]] = []
    for m in matrices:
        if runs and runs[-1][0].param == m.param:
            runs[-1].append(m)
        else:
            runs.append([m])
    return [m for run in reversed(runs) for m in run]


def to_units(
    matrices: Sequence[Matrix], tp: int, grad_bytes: int, optimizer: PlanOptimizer = "muon"
) -> list[Unit]:
    """The assignment units of one TP rank, in the given order; an expert is a one-expert
    slice [1, out, in] of its stacked parameter, as `units_from_model(split_experts=True)`.
    The model's matrices ("muon") are units of the matrix `optimizer`."""
    units = []
    for m in matrices:
        shape = local_shape(m, tp)
        if m.part is not None:
            shape = (m.part[1] - m.part[0], *shape)
        kind = optimizer if m.kind == "muon" else m.kind
        units.append(Unit(m.param, shape, kind, math.prod(shape) * grad_bytes, m.part))
    return units


def plan_matrices(
    desc: ModelDescription, layout: Layout, matrices: Sequence[Matrix] | None = None
) -> list[Matrix]:
    """The units the layout's optimizer steps (`matrices`, default `expand(desc)`): as they
    are, or under `optimizer` "adamw" every one AdamW, the routed experts of one parameter
    held by one EP rank a single unit, their stack (the optimizer splits only a matrix
    optimizer's expert stacks, `units_from_model`)."""
    matrices = list(expand(desc) if matrices is None else matrices)
    if layout.optimizer != "adamw":
        return matrices
    per_rank = desc.n_routed_experts // layout.ep if desc.is_moe else 1
    out: list[Matrix] = []
    for m in matrices:
        prev = out[-1] if out else None
        if (
            prev is not None and m.part is not None and prev.part is not None
            and (prev.param, prev.part[1]) == (m.param, m.part[0])
            and prev.part[0] // per_rank == m.part[0] // per_rank
        ):  # fmt: skip
            out[-1] = dataclasses.replace(prev, part=(prev.part[0], m.part[1]))
        else:
            out.append(dataclasses.replace(m, kind="adamw"))
    return out


def split_matrices(
    matrices: Sequence[Matrix], desc: ModelDescription, ep: int
) -> tuple[list[Matrix], list[Matrix]]:
    """(units replicated over all DP ranks, routed experts held by EP rank 0)."""
    per_rank = desc.n_routed_experts // ep if desc.is_moe else 0
    dense = [m for m in matrices if m.expert is None]
    experts = [m for m in matrices if m.expert is not None and m.expert < per_rank]
    return dense, experts


@dataclass
class _Group:
    """One assignment: matrices, their units, the world they are shared over."""

    matrices: list[Matrix]
    units: list[Unit]
    world: int
    assignment: Assignment
    masters: bool = False  # what the AdamW split was levelled for (`deal_adamw`)
    costs: list[float] = field(default_factory=list, repr=False)  # per unit (`unit_costs`)
    # An expert group: the assignment of every EP rank's experts over its expert-DP group,
    # index = EP rank (each filled around the dense load of its own ranks); [self] otherwise.
    siblings: list[_Group] = field(default_factory=list, repr=False, compare=False)
    # `reproducible`: the AdamW runs start and end on norm blocks of this many elements
    # (`assign`'s `align_adamw`), and the reduction is the ordered all-to-all
    align: int | None = None

    def __post_init__(self) -> None:
        self._owned: list[list[int]] = [[] for _ in range(self.world)]
        for i, o in enumerate(self.assignment.owners):
            if o >= 0:  # -1: AdamW, sharded element-wise over every rank
                self._owned[o].append(i)

    def owned(self, rank: int) -> list[int]:
        """The units `rank` owns whole."""
        return self._owned[rank]

    def adamw_elements(self, rank: int) -> int:
        """Elements of the sharded AdamW units `rank` holds."""
        return sum(s[rank] for s in self.assignment.adamw_split if s)

    def dealt(self, masters: bool) -> _Group:
        """This group with its AdamW elements dealt as an optimizer with (or without) master
        copies deals them; the owners of whole units are the same."""
        if masters == self.masters or not self.assignment.adamw_split:
            return self
        a = deal_adamw(self.units, self.assignment, masters, self.align)
        return _Group(self.matrices, self.units, self.world, a, masters, align=self.align)

    def comm(self, grad_bytes: int, gather_bytes: int) -> tuple[list[float], list[float]]:
        """(sent, received) bytes per rank of this group's world in one step."""
        a = self.assignment
        numels = [math.prod(u.shape) for u in self.units]
        return layerwise_bytes(
            a.owners, a.buckets, numels, self.world, grad_bytes, gather_bytes,
            split=a.adamw_split,
            rank_major=[a.rank_major(b, self.units) for b in range(len(a.buckets))],
            ordered=self.align is not None,
        )  # fmt: skip

    def comm_unpadded(self, grad_bytes: int, gather_bytes: int) -> list[float]:
        """max(sent, received) per rank without the padding of shared buckets."""
        a = self.assignment
        numels = [math.prod(u.shape) for u in self.units]
        sent, received = layerwise_unpadded_bytes(
            a.owners, a.buckets, numels, self.world, grad_bytes, gather_bytes, a.adamw_split
        )
        return [max(s, r) for s, r in zip(sent, received, strict=True)]


def _stats(values: Sequence[float]) -> dict[str, float]:
    mean = sum(values) / len(values) if values else 0.0
    mx = max(values) if values else 0.0
    return {"max": mx, "mean": mean, "imbalance": mx / mean if mean else 1.0}


def _imbalance_bound(
    slots: Sequence[Slot], by_stage: Sequence[Sequence[_Group]], cost: Sequence[float], dp: int
) -> float:
    """A max/mean of `cost` (per slot) that no balancing of these units reaches below, given
    the expert groups' loads: every assignment's own `bound` (an expert group's includes the
    dense load it was filled around), a dense group's raised by the least load any of its
    ranks carries from the other groups. Above 1 the layout is lumpy: fewer units than
    ranks, or single units heavier than the mean."""
    mean = sum(cost) / len(cost) if cost else 0.0
    if mean <= 0:
        return 1.0
    bound = 0.0
    for s, stage_groups in enumerate(by_stage):
        for g in stage_groups:
            for sibling in g.siblings or [g]:
                bound = max(bound, sibling.assignment.bound)
            if g.world == dp:
                rest = min(cost[s * dp + r] - g.assignment.rank_cost[r] for r in range(dp))
                bound = max(bound, g.assignment.bound + rest)
    return max(1.0, bound / mean)


def movable_units_per_rank(by_stage: Sequence[Sequence[_Group]], dp: int) -> float:
    """Muon units per DP rank that have a choice of owner (`Assignment.movable`: not pinned
    by a bucket's even shards, in a group of more than one rank), every EP rank's experts
    counted, averaged over the stages. Few per rank: the layout is lumpy."""
    total = 0
    for stage_groups in by_stage:
        for g in stage_groups:
            siblings = g.siblings or [g]
            # an expert group stands for dp/world EP ranks (one sibling each, or all alike)
            total += sum(x.assignment.movable for x in siblings) * (dp // g.world) // len(siblings)
    return total / (dp * len(by_stage)) if by_stage else 0.0


def stage_of_layers(num_layers: int, pp: int) -> list[int]:
    """Pipeline stage of every block: contiguous, the first `num_layers mod pp` stages one
    block longer."""
    base, extra = divmod(num_layers, pp)
    stages: list[int] = []
    for s in range(pp):
        stages += [s] * (base + (s < extra))
    return stages


def stage_of(m: Matrix, stages: list[int], pp: int) -> int:
    """The pipeline stage holding `m`, given every block's (`stage_of_layers`): its block's,
    else the first stage for the embeddings and the last for the rest (final norm, head)."""
    if m.layer is not None:
        return stages[m.layer]
    return 0 if m.param.startswith("embed") else pp - 1


def expert_groups(dims: ParallelDims) -> list[list[int]]:
    """Per EP rank, the data-parallel indices (within a stage) of the ranks holding its
    experts, in their expert-data-parallel group's order (`ParallelDims`' "edp" groups)."""
    return [
        [dims.coordinate(r).dp for r in dims.group_ranks("edp", dims.rank_of(0, e))]
        for e in range(dims.ep)
    ]


def plan_groups(
    desc: ModelDescription,
    layout: Layout,
    balance: str = "cost",
    dense: list[Matrix] | None = None,
    experts: list[Matrix] | None = None,
    masters: bool | None = None,
    matrices: list[Matrix] | None = None,
    hardware: Hardware | None = None,
) -> list[list[_Group]]:
    """Per pipeline stage, the assignments the layer-wise optimizers of one TP rank make.
    Each group holds its matrices and units in the optimizer's (backward) order.

    Without expert parallelism (ep = 1) every unit, experts included, is assigned over the
    `dp` ranks at once, as the optimizer without an `expert_group` does. With ep > 1 the
    replicated units go over `dp` ranks first; then every EP rank's experts over its
    `dp/ep` ranks, filled around the load those ranks already carry (`assign(base=...)`, as
    the optimizer with an `expert_group` does): one group per stage, its `siblings` the
    assignment of each EP rank. Costs are `unit_costs` (`hardware` prices the TP modes).

    As the optimizer does (`shard_adamw`), AdamW units are sharded element-wise over the
    group, levelling the state with master copies if `masters` (default `layout.masters`:
    the gather rounds); under tensor parallelism they stay owned whole."""
    check_layout(desc, layout)
    masters = layout.masters if masters is None else masters
    if dense is None or experts is None:
        matrices = plan_matrices(desc, layout) if matrices is None else matrices
        dense, experts = split_matrices(matrices, desc, layout.ep)
    if layout.ep == 1 and experts:
        everything = plan_matrices(desc, layout) if matrices is None else matrices
        parts = [everything]
    else:
        parts = [dense, experts]
    stages = stage_of_layers(desc.num_hidden_layers, layout.pp)
    grad_b = DTYPE_BYTES[layout.grad_dtype]
    bucket_bytes = int(layout.bucket_mb * 2**20)
    tp_model = tp_cost_model(hardware, layout) if hardware is not None else CostModel()
    align = NORM_BLOCK if layout.reproducible else None
    by_stage: list[list[_Group]] = []
    for s in range(layout.pp):
        stage_groups: list[_Group] = []
        for mats in parts:
            ordered = backward_order([m for m in mats if stage_of(m, stages, layout.pp) == s])
            if not ordered:
                continue
            units = to_units(ordered, layout.tp, grad_b, layout.optimizer)
            costs = unit_costs(ordered, units, layout, tp_model)
            world = layout.dp if mats is not experts else layout.expert_dp
            bases: list[list[float] | None] = [None]
            if mats is experts and stage_groups and balance == "cost":
                load = stage_groups[0].assignment.loads
                bases = [[load[d] for d in group] for group in expert_groups(layout.dims)]
            done: dict[tuple[float, ...], Assignment] = {}
            siblings = []
            for base in bases:
                key = tuple(base or ())
                if key not in done:
                    done[key] = assign(
                        units, world, balance=balance, bucket_bytes=bucket_bytes, cost=costs,
                        base=base, shard_adamw=layout.tp == 1, masters=masters,
                        align_adamw=align,
                    )  # fmt: skip
                group = _Group(ordered, units, world, done[key], masters, costs, align=align)
                siblings.append(group)
            for g in siblings:
                g.siblings = siblings
            stage_groups.append(siblings[0])
        by_stage.append(stage_groups)
    return by_stage


def tp_cost_model(hw: Hardware, layout: Layout) -> CostModel:
    """The tensor-parallel orthogonalizer's cost model on `hw`: its TP group's bandwidth and
    latency (the measured all-reduce of that size, else the link), its Newton-Schulz matmul
    rate and its memory bandwidth where the profile gives one; the rest (the symmetric
    products' speed-up, launch cost) the layout's device's (`CostModel.for_device`), as the
    runtime's `auto` takes them there."""
    bw, lat = hw.collective("all_reduce", layout.tp)
    ns_b = DTYPE_BYTES[layout.ns_dtype]
    base = CostModel.for_device(layout.device)
    memory = hw.memory_bytes_per_s()
    return dataclasses.replace(
        base,
        bandwidth=bw,
        latency=lat,
        throughput=hw.matmul_flops_per_s(ns_b),
        memory_bandwidth=base.memory_bandwidth if memory is None else memory,
    )


def tp_auto_cost(m: Matrix, layout: Layout, model: CostModel, k: int = 1) -> tuple[TPCost, str]:
    """Per-TP-rank cost of `m` (a stack of `k` like it) in the mode the orthogonalizer's
    `auto` picks (`pick_auto`: the cheapest under `model` of the modes it may pick), and that
    mode."""
    ns_b = DTYPE_BYTES[layout.ns_dtype]

    def cost(mode: str) -> TPCost:
        steps = layout.ns_steps
        return tp_ns_cost(m.shape, m.tp_dim, layout.tp, mode, steps, ns_b, model, k)[0]

    best, chosen = pick_auto(cost, ns_b, model)
    return chosen, best


def unit_costs(
    matrices: Sequence[Matrix], units: Sequence[Unit], layout: Layout, tp_model: CostModel
) -> list[float]:
    """What owning each unit costs its owner (one TP rank), on the path it really takes: the
    cost `assign` balances and the plan's per-rank Newton-Schulz figures add up.

    Whole matrices: `MatrixCost` on the layout's device and Newton-Schulz dtype and steps
    (default the GPU path: Triton SYRK in bf16; Gram form for wide fp32 matrices). A Muon
    matrix split by tensor parallelism: the flops per TP rank of the mode the orthogonalizer's
    `auto` picks (`tp_cost`, the TP model's count). AdamW: its elements.
    """
    price = MatrixCost(layout.device, layout.ns_dtype, layout.ns_steps)
    out = []
    for m, u in zip(matrices, units, strict=True):
        if m.kind == "muon" and layout.tp > 1 and m.tp_dim is not None:
            out.append(tp_auto_cost(m, layout, tp_model)[0].flops)
        else:
            out.append(price(u))
    return out


def all_groups(by_stage: Sequence[Sequence[_Group]]) -> list[_Group]:
    """Every assignment of `by_stage`, an expert group's siblings (one per EP rank) included."""
    return [s for stage_groups in by_stage for g in stage_groups for s in g.siblings or [g]]


# One GPU of one TP rank: the (group, rank in that group) pairs whose units it owns.
Slot = list[tuple[_Group, int]]


def plan_slots(
    desc: ModelDescription,
    layout: Layout,
    balance: str = "cost",
    hardware: Hardware | None = None,
    matrices: list[Matrix] | None = None,
) -> tuple[list[Slot], list[list[_Group]]]:
    """`plan_groups` and, per (stage, DP rank), the (group, rank in it) pairs it owns units
    of: the dense group's rank r, and EP rank r mod ep's experts at rank r // ep."""
    matrices = plan_matrices(desc, layout) if matrices is None else matrices
    dense, experts = split_matrices(matrices, desc, layout.ep)
    by_stage = plan_groups(
        desc, layout, balance, dense, experts, matrices=matrices, hardware=hardware
    )
    dims, dp = layout.dims, layout.dp
    slots: list[Slot] = [[] for _ in range(layout.pp * dp)]
    for s, stage_groups in enumerate(by_stage):
        for g in stage_groups:
            for r in range(dp):
                if g.world == dp:
                    slots[s * dp + r].append((g, r))
                else:  # its EP rank's experts, at its place in its expert-DP group
                    c = dims.coordinate(dims.rank_of(s, r))
                    sibling = g.siblings[c.ep] if len(g.siblings) > 1 else g
                    slots[s * dp + r].append((sibling, c.edp))
    return slots, by_stage


def owned_elements(slots: Sequence[Slot], masters: bool) -> list[int]:
    """Elements each (stage, DP rank) steps: the units it owns whole and its share of the
    sharded AdamW ones, dealt as an optimizer with (or without) master copies deals them
    (the elements its optimizer reads and writes, `plan.steptime`)."""
    dealt: dict[int, _Group] = {}
    out = []
    for slot in slots:
        n = 0
        for g, gr in slot:
            d = dealt.setdefault(id(g), g.dealt(masters))
            n += sum(math.prod(d.units[i].shape) for i in d.owned(gr)) + d.adamw_elements(gr)
        out.append(n)
    return out


def balancing_figures(
    slots: Sequence[Slot], by_stage: Sequence[Sequence[_Group]], dp: int
) -> dict[str, Any]:
    """Per-rank Newton-Schulz flops on each matrix's path (`unit_costs`: what the cost
    balancing balances), their max / mean / max/mean, the same for the whole optimizer cost
    (`cost_imbalance`, AdamW elements included where AdamW units are owned whole), the
    imbalance no balancing could beat (`imbalance_bound`), the most units on one rank."""
    flops = [
        sum(g.costs[i] for g, gr in slot for i in g.owned(gr) if g.matrices[i].kind == "muon")
        for slot in slots
    ]
    cost = [sum(g.assignment.rank_cost[gr] for g, gr in slot) for slot in slots]
    return {
        "ns_flops_per_rank": flops,
        **{f"ns_flops_{k}": v for k, v in _stats(flops).items()},
        "cost_imbalance": _stats(cost)["imbalance"],
        "imbalance_bound": _imbalance_bound(slots, by_stage, cost, dp),
        "matrices_per_rank_max": max(sum(len(g.owned(gr)) for g, gr in slot) for slot in slots),
    }


def _memory_figures(
    held: dict[str, Any], by_stage: Sequence[Sequence[_Group]], layout: Layout
) -> dict[str, Any]:
    """The layer-wise optimizer's state per rank beside what ZeRO-1 AdamW and a replicated
    matrix optimizer would hold on the busiest stage."""
    tp = layout.tp
    grad_b = DTYPE_BYTES[layout.grad_dtype]
    # The comparison rows hold what those optimizers would: fp32 state, and an fp32 master
    # copy of every element where this layout keeps them (as the layer-wise one).
    state_b = DTYPE_BYTES["fp32"]
    master = DTYPE_BYTES["fp32"] if layout.masters else 0

    def whole_state(m: Matrix) -> int:
        unit = to_units([m], tp, grad_b, layout.optimizer)[0]
        return state_numel(unit) * state_b + unit.numel * master

    # the layer-wise optimizer's own figure (`memory_per_rank`): state and master copies
    state = [s + m for s, m in zip(held["state_per_rank"], held["masters_per_rank"], strict=True)]
    zero1_state = max(
        sum(math.ceil(sum(u.numel for u in g.units) / g.world) * (2 * state_b + master) for g in sg)
        for sg in by_stage
    )
    replicated_state = max(sum(whole_state(m) for g in sg for m in g.matrices) for sg in by_stage)
    return {
        "layerwise_state_bytes_per_rank": state,
        "layerwise_state_bytes_max": max(state),
        "layerwise_state_bytes_mean": sum(state) / len(state),
        "zero1_adamw_state_bytes_per_rank": zero1_state,
        "replicated_muon_state_bytes": replicated_state,
    }


def _gather_comm(
    slots: Sequence[Slot],
    by_stage: Sequence[Sequence[_Group]],
    layout: Layout,
    gather: str,
    bandwidth: float,
) -> dict[str, Any]:
    """One step's bytes per rank when the parameters are gathered in `gather`, beside
    ZeRO-1 AdamW's on the busiest stage, and their times over `bandwidth`."""
    grad_b = DTYPE_BYTES[layout.grad_dtype]
    gather_b = DTYPE_BYTES[gather]
    # the optimizer keeps master copies for this gather (`keeps_masters`), and deals its
    # AdamW elements for them: that deal's padding
    masters = keeps_masters(layout.param_dtype, gather)
    dealt = {id(g): g.dealt(masters) for g in all_groups(by_stage)}
    per_group = {
        id(g): (*d.comm(grad_b, gather_b), d.comm_unpadded(grad_b, gather_b)) for g, d in
        ((g, dealt[id(g)]) for g in all_groups(by_stage))
    }  # fmt: skip
    sent = [sum(per_group[id(g)][0][gr] for g, gr in slot) for slot in slots]
    received = [sum(per_group[id(g)][1][gr] for g, gr in slot) for slot in slots]
    unpadded = [sum(per_group[id(g)][2][gr] for g, gr in slot) for slot in slots]
    z1 = max(
        sum(
            zero1_bytes(sum(math.prod(u.shape) for u in g.units), g.world, grad_b, gather_b)
            for g in sg
        )
        for sg in by_stage
    )
    lw = max(max(sent), max(received))
    return {
        "layerwise_sent_per_rank": sent,
        "layerwise_received_per_rank": received,
        "layerwise_muon_bytes": lw,
        "layerwise_unpadded_bytes": max(unpadded),
        "zero1_adamw_bytes": z1,
        "ratio": lw / z1 if z1 else 1.0,
        "unpadded_ratio": max(unpadded) / z1 if z1 else 1.0,
        "layerwise_time_s": lw / bandwidth,
        "zero1_time_s": z1 / bandwidth,
    }


def _overhead(
    desc: ModelDescription,
    hardware: Hardware,
    layout: Layout,
    chosen: dict[str, Any],
    matmul_active: int,
) -> dict[str, Any]:
    """Newton-Schulz work and time of the busiest GPU (`chosen`: its TP mode's figures)
    against the model's own per step, and the published GB300 figures where there are."""
    tokens = layout.tokens_per_step or desc.default_tokens_per_step
    ns_b = DTYPE_BYTES[layout.ns_dtype]
    model_flops = 6 * matmul_active * tokens
    per_gpu_model = model_flops / layout.gpus
    ns_rate = hardware.matmul_flops_per_s(ns_b)
    t_model = per_gpu_model / (hardware.bf16_tflops * 1e12 * hardware.model_mfu)
    overhead: dict[str, Any] = {
        "tokens_per_step": tokens,
        "model_flops_per_step": model_flops,
        "model_flops_per_gpu": per_gpu_model,
        "ns_flops_per_gpu_max": chosen["flops_max"],
        "ns_flops_per_gpu_mean": chosen["flops_mean"],
        "ns_share_of_model_flops_mean": chosen["flops_mean"] / per_gpu_model if tokens else None,
        "ns_share_of_model_flops_max": chosen["flops_max"] / per_gpu_model if tokens else None,
        "ns_time_s_max": chosen["time_max_s"],
        "model_time_s": t_model,
        "ns_share_of_step_time": chosen["time_max_s"] / t_model if tokens else None,
        "ns_matmul_flops_per_s": ns_rate,
    }
    pub = PUBLISHED_GB300.get(desc.name)
    if pub:
        share = pub["muon_ns_tflops"] / pub["muon_model_tflops"]
        overhead["published_gb300"] = {
            **pub,
            "ns_share_of_model_flops": share,
            "model_throughput_loss": 1 - pub["muon_model_tflops"] / pub["adamw_tflops"],
            "tokens_per_step_matching_share": (
                tokens * overhead["ns_share_of_model_flops_mean"] / share if tokens else None
            ),
        }
    return overhead


def _model_figures(
    desc: ModelDescription,
    matrices: Sequence[Matrix],
    counts: dict[str, int],
    dense: Sequence[Matrix],
    experts: Sequence[Matrix],
    ep: int,
) -> dict[str, Any]:
    """The model's parameter counts (computed and published) and its units."""
    return {
        "name": desc.name,
        "source": desc.source,
        "params_total": counts["total"],
        "params_active": counts["active"],
        "params_matmul_active": counts["matmul_active"],
        "published_total": desc.published_total_params or None,
        "published_active": desc.published_active_params or None,
        "units": len(dense) + (len(experts) * ep),
        "muon_units": sum(m.kind == "muon" for m in matrices),
    }


def _layout_figures(
    desc: ModelDescription,
    layout: Layout,
    dense: Sequence[Matrix],
    experts: Sequence[Matrix],
    by_stage: Sequence[Sequence[_Group]],
) -> dict[str, Any]:
    """The layout's sizes and choices, and the Muon units per rank (all and movable)."""
    dp, ep, pp = layout.dp, layout.ep, layout.pp
    stages = stage_of_layers(desc.num_hidden_layers, pp)
    return {
        "dp": dp,
        "tp": layout.tp,
        "ep": ep,
        "pp": pp,
        "layers_per_stage": [stages.count(k) for k in range(pp)],
        "gpus": layout.gpus,
        "expert_dp": layout.expert_dp,
        "experts_per_ep_rank": desc.n_routed_experts // ep if experts else 0,
        "muon_units_per_rank": (
            sum(m.kind == "muon" for m in dense) + sum(m.kind == "muon" for m in experts) * ep
        )
        / (dp * pp),
        "movable_muon_units_per_rank": movable_units_per_rank(by_stage, dp),
        "ns_steps": layout.ns_steps,
        "ns_dtype": layout.ns_dtype,
        "device": layout.device,
        "grad_dtype": layout.grad_dtype,
        "bucket_mb": layout.bucket_mb,
        "masters": layout.masters,
        "optimizer": layout.optimizer,
        "fsdp": layout.fsdp,
        "tp_mode": layout.tp_mode,
        "param_dtype": layout.param_dtype,
        "gather_dtype": layout.gather,
        "ns_batch_mb": layout.ns_batch_mb,
        "state_dtype": layout.state_dtype,
    }


def plan_activations(desc: ModelDescription, layout: Layout) -> dict[str, Any] | None:
    """`activation_figures` of the layout's stages at its micro-batch, sequence length (the
    description's where `layout.seq_len` is 0; None when neither gives one), recompute
    option and tensor-parallel size, in the parameter dtype."""
    seq_len = layout.seq_len or desc.seq_len
    if not seq_len:
        return None
    stages = stage_of_layers(desc.num_hidden_layers, layout.pp)
    layers = [[i for i, s in enumerate(stages) if s == k] for k in range(layout.pp)]
    return activation_figures(
        desc, layers, layout.micro_batch, seq_len, DTYPE_BYTES[layout.param_dtype],
        layout.recompute, layout.tp,
    )  # fmt: skip


def with_activations(
    peaks: Sequence[float], activations: dict[str, Any] | None, dp: int
) -> list[float]:
    """Each rank's peak (stage-major, `dp` per stage) plus its stage's activations."""
    if activations is None:
        return list(peaks)
    return [p + activations["bytes_per_stage"][i // dp] for i, p in enumerate(peaks)]


def make_plan(desc: ModelDescription, hardware: Hardware, layout: Layout) -> dict[str, Any]:
    """Every figure `orthoptim plan` reports, as a JSON-ready dict.

    Per-rank lists hold one entry per (pipeline stage, data-parallel rank), stage-major.
    """
    check_layout(desc, layout)
    tp, dp, ep = layout.tp, layout.dp, layout.ep
    counts = param_counts(expand(desc))
    matrices = plan_matrices(desc, layout)
    dense, experts = split_matrices(matrices, desc, ep)

    balancing: dict[str, Any] = {}
    per_balance: dict[str, tuple[list[Slot], list[list[_Group]]]] = {}
    for balance in BALANCES:
        per_balance[balance] = plan_slots(desc, layout, balance, hardware, matrices)
        balancing[balance] = balancing_figures(*per_balance[balance], dp)

    slots, by_stage = per_balance["cost"]
    held = memory_per_rank(slots, by_stage, matrices, layout, DTYPE_BYTES)
    tensors = held.pop("stepped_tensors_per_rank", None)  # a step-time input, not memory
    capacity = hardware.memory_gb * 1e9
    activations = plan_activations(desc, layout)
    # building the optimizer comes before any activation: where it is larger, it is the peak
    peaks = [
        max(peak, row.get("construction", 0))
        for peak, row in zip(
            with_activations(held["peak_per_rank"], activations, dp), held["per_rank"], strict=True
        )
    ]
    fits = [peak <= capacity for peak in peaks]
    bw, _ = hardware.link(dp * tp)
    comm = {
        f"{gather}_gather": _gather_comm(slots, by_stage, layout, gather, bw)
        for gather in ("fp32", "bf16")
    }
    tp_section = _tp_modes(slots, layout, hardware)
    chosen = tp_section["auto"] if tp > 1 else tp_section["duplicated"]
    return {
        "model": _model_figures(desc, matrices, counts, dense, experts, ep),
        "layout": _layout_figures(desc, layout, dense, experts, by_stage),
        "hardware": hardware.name,
        "balancing": balancing,
        "memory": {
            **_memory_figures(held, by_stage, layout),
            "owned_elements_per_rank": owned_elements(slots, layout.masters),
            "owned_tensors_per_rank": tensors,
        },
        "memory_per_rank": {
            **held,
            "hardware_bytes": capacity,
            "fits_per_rank": fits,
            "fits": all(fits),
            "activations": activations,
            "peak_with_activations_per_rank": peaks,
            "verdict": memory_verdict(
                max(peaks), capacity, hardware.name, fits.count(False), len(fits)
            ),
        },
        "comm": comm,
        "tp": tp_section,
        "overhead": _overhead(desc, hardware, layout, chosen, counts["matmul_active"]),
        "work": work_figures(desc, layout, layout.tokens_per_step or desc.default_tokens_per_step),
    }


def _muon_stacks(slot: Slot) -> list[tuple[Matrix, int]]:
    """The Muon matrices one rank owns as the tensor-parallel orthogonalizer is called on
    them: one stack per full shape and split dim (Muon stacks same-shape, same-placement
    matrices into one call), as (a matrix of the stack, its size)."""
    stacks: dict[tuple[tuple[int, ...], int | None], list[Any]] = {}
    for g, gr in slot:
        for i in g.owned(gr):
            m = g.matrices[i]
            if m.kind == "muon":
                stacks.setdefault((m.shape, m.tp_dim), [m, 0])[1] += 1
    return [(m, k) for m, k in stacks.values()]


def _tp_modes(slots: list[Slot], layout: Layout, hw: Hardware) -> dict[str, Any]:
    """Per TP mode (each of the orthogonalizer's TP_MODES, and auto): bytes, collective
    rounds, flops and modelled time of the busiest rank; what auto picks and the forms the
    modes take, counted over the matrices. Each rank's matrices are priced as the runtime
    calls the orthogonalizer on them, one stack per shape and split dim (`_muon_stacks`), so
    auto picks here what it picks there.

    Costs and the auto choice come from the tensor-parallel orthogonalizer's cost model
    (`mode_cost`, `CostModel.seconds`, `pick_auto`), with the hardware's TP-link bandwidth
    and latency and its Newton-Schulz matmul rate.
    """
    tp, steps = layout.tp, layout.ns_steps
    ns_b = DTYPE_BYTES[layout.ns_dtype]
    model = tp_cost_model(hw, layout)

    def cost(m: Matrix, k: int, mode: str) -> tuple[TPCost, str]:
        if mode != "auto":
            return tp_ns_cost(m.shape, m.tp_dim, tp, mode, steps, ns_b, model, k)
        chosen, best = tp_auto_cost(m, layout, model, k)
        return chosen, best if m.tp_dim is not None and tp > 1 else ""

    stacks = [_muon_stacks(slot) for slot in slots]
    out: dict[str, Any] = {}
    picks: dict[str, int] = {}
    for mode in (*TP_MODES, "auto"):
        # (sent, flops, seconds, rounds) of each rank: one call per stack it owns
        per_rank = []
        for rank_stacks in stacks:
            total = [0.0, 0.0, 0.0, 0.0]
            for m, k in rank_stacks:
                c, choice = cost(m, k, mode)
                for j, x in enumerate((c.bytes_sent, c.flops, model.seconds(c), c.rounds)):
                    total[j] += x
                if choice:  # auto's mode, or the form a mode takes
                    key = choice if mode == "auto" else f"{mode} form {choice}"
                    picks[key] = picks.get(key, 0) + k
            per_rank.append(tuple(total))
        worst = max(range(len(per_rank)), key=lambda r: per_rank[r][2])
        out[mode] = {
            "bytes_max": max(p[0] for p in per_rank),
            "flops_max": max(p[1] for p in per_rank),
            "flops_mean": sum(p[1] for p in per_rank) / len(per_rank),
            "flops_imbalance": _stats([p[1] for p in per_rank])["imbalance"],
            "time_max_s": per_rank[worst][2],
            "time_per_rank_s": [p[2] for p in per_rank],
            "rounds_max": int(max(p[3] for p in per_rank)),
            "bytes_per_rank": [p[0] for p in per_rank],
            "flops_per_rank": [p[1] for p in per_rank],
            "rounds_per_rank": [int(p[3]) for p in per_rank],
        }
    out["auto_picks"] = picks
    out["cost_model"] = "orthoptim.parallel.tensor_parallel (tp_cost, CostModel)"
    return out
