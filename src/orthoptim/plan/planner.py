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
  among them. Rank r's load is its dense share plus its expert-group share.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from orthoptim.parallel.assignment import Assignment, Unit, assign
from orthoptim.parallel.tensor_parallel import CostModel, TPCost
from orthoptim.plan.costs import (
    TP_MODES,
    layerwise_bytes,
    layerwise_unpadded_bytes,
    ns_flops,
    tp_ns_cost,
    zero1_bytes,
)
from orthoptim.plan.hardware import Hardware
from orthoptim.plan.model import Matrix, ModelDescription, expand, param_counts

BALANCES = ("cost", "round_robin", "capped")
DTYPE_BYTES = {"fp32": 4, "bf16": 2}

# Published Muon vs AdamW throughput on GB300 NVL72 (NVIDIA technical blog "Advancing
# Emerging Optimizers for Accelerated LLM Training with NVIDIA Megatron", Megatron Bridge
# 26.02, MXFP8). Muon's TFLOP/s count the Newton-Schulz matmuls: model + Muon.
PUBLISHED_GB300 = {
    "kimi-k2": {
        "layout": "PP4 DP64 EP64, 256 GB300",
        "adamw_tflops": 1051,
        "muon_tflops": 1080,
        "muon_model_tflops": 1029,
        "muon_ns_tflops": 51,
    },
    "qwen3-30b-a3b": {
        "layout": "DP8 EP8, 8 GB300",
        "adamw_tflops": 713,
        "muon_tflops": 721,
        "muon_model_tflops": 686,
        "muon_ns_tflops": 35,
    },
}


@dataclass(frozen=True)
class Layout:
    """Parallel sizes and numeric choices of one plan."""

    dp: int
    tp: int = 1
    ep: int = 1
    pp: int = 1
    tokens_per_step: int = 0
    ns_steps: int = 5
    ns_dtype: str = "bf16"
    grad_dtype: str = "fp32"
    bucket_mb: float = 25.0
    master_weights: bool = True

    @property
    def gpus(self) -> int:
        return self.dp * self.tp * self.pp

    @property
    def expert_dp(self) -> int:
        return self.dp // self.ep


def check_layout(desc: ModelDescription, layout: Layout) -> None:
    """Raise a ValueError naming the flag when the layout does not fit the model."""
    for flag, v in (
        ("--dp", layout.dp),
        ("--tp", layout.tp),
        ("--ep", layout.ep),
        ("--pp", layout.pp),
    ):
        if not isinstance(v, int) or v < 1:
            raise ValueError(f"{flag} must be a positive integer, got {v!r}")
    if layout.pp > desc.num_hidden_layers:
        raise ValueError(
            f"--pp {layout.pp} exceeds the {desc.num_hidden_layers} layers of {desc.name!r}"
        )
    if layout.dp % layout.ep:
        raise ValueError(
            f"--ep {layout.ep} must divide --dp {layout.dp} (expert parallelism runs inside "
            "the data-parallel group)"
        )
    if layout.ep > 1 and not desc.is_moe:
        raise ValueError(f"--ep {layout.ep}: model {desc.name!r} has no routed experts; use --ep 1")
    if desc.is_moe and desc.n_routed_experts % layout.ep:
        raise ValueError(
            f"--ep {layout.ep} must divide the {desc.n_routed_experts} routed experts of "
            f"{desc.name!r}"
        )
    for flag, v in (("--ns-dtype", layout.ns_dtype), ("--grad-dtype", layout.grad_dtype)):
        if v not in DTYPE_BYTES:
            raise ValueError(f"{flag} must be one of {sorted(DTYPE_BYTES)}, got {v!r}")
    if layout.ns_steps < 1:
        raise ValueError(f"--ns-steps must be >= 1, got {layout.ns_steps}")
    if layout.bucket_mb <= 0:
        raise ValueError(f"--bucket-mb must be > 0, got {layout.bucket_mb}")
    if layout.tokens_per_step < 0:
        raise ValueError(f"--tokens-per-step must be >= 0, got {layout.tokens_per_step}")


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


def to_units(matrices: Sequence[Matrix], tp: int, grad_bytes: int) -> list[Unit]:
    """The assignment units of one TP rank, in the given order; an expert is a one-expert
    slice [1, out, in] of its stacked parameter, as `units_from_model(split_experts=True)`."""
    units = []
    for m in matrices:
        shape = local_shape(m, tp)
        if m.part is not None:
            shape = (m.part[1] - m.part[0], *shape)
        units.append(Unit(m.param, shape, m.kind, math.prod(shape) * grad_bytes, m.part))
    return units


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

    def __post_init__(self) -> None:
        self._owned: list[list[int]] = [[] for _ in range(self.world)]
        for i, o in enumerate(self.assignment.owners):
            self._owned[o].append(i)

    def owned(self, rank: int) -> list[int]:
        return self._owned[rank]

    def comm(self, grad_bytes: int, gather_bytes: int) -> tuple[list[float], list[float]]:
        """(sent, received) bytes per rank of this group's world in one step."""
        a = self.assignment
        numels = [math.prod(u.shape) for u in self.units]
        return layerwise_bytes(a.owners, a.buckets, numels, self.world, grad_bytes, gather_bytes)

    def comm_unpadded(self, grad_bytes: int, gather_bytes: int) -> list[float]:
        """max(sent, received) per rank without the padding of shared buckets."""
        a = self.assignment
        numels = [math.prod(u.shape) for u in self.units]
        sent, received = layerwise_unpadded_bytes(
            a.owners, a.buckets, numels, self.world, grad_bytes, gather_bytes
        )
        return [max(s, r) for s, r in zip(sent, received, strict=True)]


def _stats(values: Sequence[float]) -> dict[str, float]:
    mean = sum(values) / len(values) if values else 0.0
    mx = max(values) if values else 0.0
    return {"max": mx, "mean": mean, "imbalance": mx / mean if mean else 1.0}


def stage_of_layers(num_layers: int, pp: int) -> list[int]:
    """Pipeline stage of every block: contiguous, the first `num_layers mod pp` stages one
    block longer."""
    base, extra = divmod(num_layers, pp)
    stages: list[int] = []
    for s in range(pp):
        stages += [s] * (base + (s < extra))
    return stages


def _stage(m: Matrix, stages: list[int], pp: int) -> int:
    if m.layer is not None:
        return stages[m.layer]
    return 0 if m.param.startswith("embed") else pp - 1


def plan_groups(
    desc: ModelDescription,
    layout: Layout,
    balance: str = "cost",
    dense: list[Matrix] | None = None,
    experts: list[Matrix] | None = None,
) -> list[list[_Group]]:
    """Per pipeline stage, the assignments the layer-wise optimizers of one TP rank make: the
    replicated units over `dp` ranks, then (MoE) EP rank 0's experts over `dp/ep` ranks.
    Each group holds its matrices and units in the optimizer's (backward) order."""
    check_layout(desc, layout)
    if dense is None or experts is None:
        dense, experts = split_matrices(expand(desc), desc, layout.ep)
    stages = stage_of_layers(desc.num_hidden_layers, layout.pp)
    grad_b = DTYPE_BYTES[layout.grad_dtype]
    bucket_bytes = int(layout.bucket_mb * 2**20)
    by_stage: list[list[_Group]] = []
    for s in range(layout.pp):
        stage_groups = []
        for mats, world in ((dense, layout.dp), (experts, layout.expert_dp)):
            ordered = backward_order([m for m in mats if _stage(m, stages, layout.pp) == s])
            if not ordered:
                continue
            units = to_units(ordered, layout.tp, grad_b)
            a = assign(units, world, balance=balance, bucket_bytes=bucket_bytes)
            stage_groups.append(_Group(ordered, units, world, a))
        by_stage.append(stage_groups)
    return by_stage


# One GPU of one TP rank: the (group, rank in that group) pairs whose units it owns.
Slot = list[tuple[_Group, int]]


def make_plan(desc: ModelDescription, hardware: Hardware, layout: Layout) -> dict[str, Any]:
    """Every figure `orthoptim plan` reports, as a JSON-ready dict.

    Per-rank lists hold one entry per (pipeline stage, data-parallel rank), stage-major.
    """
    check_layout(desc, layout)
    tp, dp, ep, pp = layout.tp, layout.dp, layout.ep, layout.pp
    grad_b = DTYPE_BYTES[layout.grad_dtype]
    ns_b = DTYPE_BYTES[layout.ns_dtype]
    matrices = expand(desc)
    dense, experts = split_matrices(matrices, desc, ep)
    counts = param_counts(matrices)
    tokens = layout.tokens_per_step or desc.default_tokens_per_step
    stages = stage_of_layers(desc.num_hidden_layers, pp)

    def make_slots(balance: str) -> tuple[list[Slot], list[list[_Group]]]:
        by_stage = plan_groups(desc, layout, balance, dense, experts)
        slots: list[Slot] = [[] for _ in range(pp * dp)]
        for s, stage_groups in enumerate(by_stage):
            for g in stage_groups:
                for r in range(dp):
                    slots[s * dp + r].append((g, r if g.world == dp else r // ep))
        return slots, by_stage

    steps = layout.ns_steps
    balancing: dict[str, Any] = {}
    per_balance: dict[str, tuple[list[Slot], list[list[_Group]]]] = {}
    for balance in BALANCES:
        slots, by_stage = per_balance[balance] = make_slots(balance)
        flops = [
            sum(
                ns_flops(g.matrices[i].shape, steps)
                for g, gr in slot
                for i in g.owned(gr)
                if g.matrices[i].kind == "muon"
            )
            for slot in slots
        ]
        cost = [sum(g.assignment.rank_cost[gr] for g, gr in slot) for slot in slots]
        balancing[balance] = {
            "ns_flops_per_rank": flops,
            **{f"ns_flops_{k}": v for k, v in _stats(flops).items()},
            "cost_imbalance": _stats(cost)["imbalance"],
            "matrices_per_rank_max": max(sum(len(g.owned(gr)) for g, gr in slot) for slot in slots),
        }

    slots, by_stage = per_balance["cost"]
    master = 4 if layout.master_weights else 0

    def numel(m: Matrix) -> int:
        return math.prod(local_shape(m, tp))

    state = [
        sum(
            numel(g.matrices[i]) * ((4 if g.matrices[i].kind == "muon" else 8) + master)
            for g, gr in slot
            for i in g.owned(gr)
        )
        for slot in slots
    ]
    zero1_state = max(
        sum(math.ceil(sum(numel(m) for m in g.matrices) / g.world) * (8 + master) for g in sg)
        for sg in by_stage
    )
    replicated_state = max(
        sum(numel(m) * ((4 if m.kind == "muon" else 8) + master) for g in sg for m in g.matrices)
        for sg in by_stage
    )

    comm: dict[str, Any] = {}
    bw, _ = hardware.link(dp * tp)
    for gather in ("fp32", "bf16"):
        gb = DTYPE_BYTES[gather]
        per_group = {
            id(g): (*g.comm(grad_b, gb), g.comm_unpadded(grad_b, gb)) for sg in by_stage for g in sg
        }
        sent = [sum(per_group[id(g)][0][gr] for g, gr in slot) for slot in slots]
        received = [sum(per_group[id(g)][1][gr] for g, gr in slot) for slot in slots]
        unpadded = [sum(per_group[id(g)][2][gr] for g, gr in slot) for slot in slots]
        z1 = max(
            sum(
                zero1_bytes(sum(math.prod(u.shape) for u in g.units), g.world, grad_b, gb)
                for g in sg
            )
            for sg in by_stage
        )
        lw = max(max(sent), max(received))
        comm[f"{gather}_gather"] = {
            "layerwise_sent_per_rank": sent,
            "layerwise_received_per_rank": received,
            "layerwise_muon_bytes": lw,
            "layerwise_unpadded_bytes": max(unpadded),
            "zero1_adamw_bytes": z1,
            "ratio": lw / z1 if z1 else 1.0,
            "unpadded_ratio": max(unpadded) / z1 if z1 else 1.0,
            "layerwise_time_s": lw / bw,
            "zero1_time_s": z1 / bw,
        }

    tp_section = _tp_modes(slots, by_stage, layout, hardware)
    chosen = tp_section["auto"] if tp > 1 else tp_section["duplicated"]
    model_flops = 6 * counts["matmul_active"] * tokens
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

    return {
        "model": {
            "name": desc.name,
            "source": desc.source,
            "params_total": counts["total"],
            "params_active": counts["active"],
            "params_matmul_active": counts["matmul_active"],
            "published_total": desc.published_total_params or None,
            "published_active": desc.published_active_params or None,
            "units": len(dense) + (len(experts) * ep),
            "muon_units": sum(m.kind == "muon" for m in matrices),
        },
        "layout": {
            "dp": dp,
            "tp": tp,
            "ep": ep,
            "pp": pp,
            "layers_per_stage": [stages.count(k) for k in range(pp)],
            "gpus": layout.gpus,
            "expert_dp": layout.expert_dp,
            "experts_per_ep_rank": len({m.expert for m in experts}),
            "ns_steps": steps,
            "ns_dtype": layout.ns_dtype,
            "grad_dtype": layout.grad_dtype,
            "bucket_mb": layout.bucket_mb,
            "master_weights": layout.master_weights,
        },
        "hardware": hardware.name,
        "balancing": balancing,
        "memory": {
            "layerwise_state_bytes_per_rank": state,
            "layerwise_state_bytes_max": max(state),
            "layerwise_state_bytes_mean": sum(state) / len(state),
            "zero1_adamw_state_bytes_per_rank": zero1_state,
            "replicated_muon_state_bytes": replicated_state,
        },
        "comm": comm,
        "tp": tp_section,
        "overhead": overhead,
    }


def _tp_modes(
    slots: list[Slot], by_stage: list[list[_Group]], layout: Layout, hw: Hardware
) -> dict[str, Any]:
    """Per TP mode: bytes, flops and modelled time of the busiest rank; what auto picks.

    Costs and the auto choice come from the tensor-parallel orthogonalizer's cost model
    (`tp_cost`, `CostModel.seconds`, its choice of distributed form), with the hardware's
    TP-link bandwidth and latency and its Newton-Schulz matmul rate.
    """
    tp, steps = layout.tp, layout.ns_steps
    ns_b = DTYPE_BYTES[layout.ns_dtype]
    bw, lat = hw.link(tp)
    model = CostModel(bandwidth=bw, latency=lat, throughput=hw.matmul_flops_per_s(ns_b))

    def cost(m: Matrix, mode: str) -> tuple[TPCost, str]:
        if mode != "auto":
            return tp_ns_cost(m.shape, m.tp_dim, tp, mode, steps, ns_b, model)
        options = {k: cost(m, k) for k in ("duplicated", "distributed")}
        best = min(options, key=lambda k: model.seconds(options[k][0]))
        return options[best][0], best if m.tp_dim is not None and tp > 1 else ""

    out: dict[str, Any] = {}
    picks: dict[str, int] = {}
    for mode in (*TP_MODES, "auto"):
        # (sent, flops, seconds) of every matrix, then summed per rank
        per_matrix: dict[int, list[tuple[float, float, float]]] = {}
        for sg in by_stage:
            for g in sg:
                rows = []
                for m in g.matrices:
                    if m.kind != "muon":
                        rows.append((0.0, 0.0, 0.0))
                        continue
                    c, choice = cost(m, mode)
                    rows.append((c.bytes_sent, c.flops, model.seconds(c)))
                    if mode in ("auto", "distributed") and choice:
                        key = choice if mode == "auto" else f"distributed form {choice}"
                        picks[key] = picks.get(key, 0) + 1
                per_matrix[id(g)] = rows
        per_rank = [
            tuple(
                sum(per_matrix[id(g)][i][j] for g, gr in slot for i in g.owned(gr))
                for j in range(3)
            )
            for slot in slots
        ]
        worst = max(range(len(per_rank)), key=lambda r: per_rank[r][2])
        out[mode] = {
            "bytes_max": max(p[0] for p in per_rank),
            "flops_max": max(p[1] for p in per_rank),
            "flops_mean": sum(p[1] for p in per_rank) / len(per_rank),
            "flops_imbalance": _stats([p[1] for p in per_rank])["imbalance"],
            "time_max_s": per_rank[worst][2],
            "time_per_rank_s": [p[2] for p in per_rank],
        }
    out["auto_picks"] = picks
    out["cost_model"] = "orthoptim.parallel.tensor_parallel (tp_cost, CostModel)"
    return out
