"""Predicted seconds per training step, per rank and for the busiest one, from a plan's figures.

The model reads what `make_plan` already counted (the figures the dry run checks) and prices
them on a `Hardware`:

* forward and backward (`forward_backward`), one third forward and two thirds backward:
  on a calibrated profile with a measured `activation_gb_per_s`, the 6·active·tokens and
  attention flops per GPU (`overhead`, `work`) at the measured linear-layer matmul rate plus
  the saved activations' bytes at that rate; else the 6·active·tokens flops at the compute rate
  (`compute_flops_per_s`: the datasheet peak × `model_mfu`, which stands for the rest);
* tensor and expert parallelism's activation collectives (`work`: the all-reduces of the
  split layers, the experts' all-to-alls), each over its group's link, none hidden;
* the gradient reduction and the parameter gather: each rank's bytes (`comm`, the larger of
  sent and received, split between the two in the ratio of the gradient and gather dtypes,
  exact for the reduce-scatter / all-gather buckets) over the data-parallel link
  (`Hardware.collective`, else `Hardware.link` of the group's span), plus one latency per
  bucket;
* the optimizer: Newton-Schulz flops per rank on each matrix's path (`balancing`, owner
  imbalance included) at the Newton-Schulz matmul rate; under tensor parallelism each rank's
  bytes and collective rounds of the layout's mode (`tp`, from `tp_ns_cost`/`pick_auto`) over
  the TP group (its measured all-reduce, else the link), and a fixed mode's flops; the
  elementwise part as memory traffic (every owned element's gradient read and parameter read
  and written, the state and master copies read and written: `step_traffic`) ÷
  `optimizer_bytes_per_s()`; and
  each tensor the rank steps
  (`owned_tensors_per_rank`) × the profile's measured `optimizer_us_per_tensor` of its kind
  (a split matrix's under tensor parallelism; none where the profile has no such figure).

Overlap rule (`OVERLAP_RULE`): the reduction runs under the backward and the gather under the
next forward, bucket by bucket, as much of it hidden as the profile's `comm_overlap` says
(a CPU's cores do both the compute and gloo's copies); the phases end in a collective wait,
so the step is the sum of each phase's busiest rank.

Not modelled: pipeline bubbles and stages of uneven length, any overlap of the activation
collectives with compute, DTensor's per-operation dispatch, recomputation, and the optimizer
step's temporaries.
"""

from __future__ import annotations

import dataclasses
import math
import textwrap
from collections.abc import Sequence
from typing import Any, Literal

from orthoptim.parallel.tensor_parallel import CostModel
from orthoptim.plan.hardware import PUBLISHED_GB300, CollectiveKind, Hardware, load_hardware
from orthoptim.plan.layouts import DTYPE_BYTES, Layout
from orthoptim.plan.model import ModelDescription, load_model
from orthoptim.plan.planner import make_plan

# the phases of a step, in order, as the `step_time` JSON names their seconds
PHASES = (
    "forward", "backward", "activation_collectives", "reduce_exposed", "ns", "tp",
    "elementwise", "per_tensor", "gather_exposed",
)  # fmt: skip
# each (model, layout) the GB300 publication ran (`PUBLISHED_GB300`)
PUBLISHED_LAYOUTS = {
    "kimi-k2": Layout(dp=64, ep=64, pp=4),
    "qwen3-30b-a3b": Layout(dp=8, ep=8),
}
Source = Literal["measured", "datasheet"]
OVERLAP_RULE = (
    "the gradient reduction is hidden under the backward and the parameter gather under the "
    "next forward up to that pass's time × the profile's comm_overlap (1 where not given), "
    "less their last (reduction) or first (gather) bucket, which has no compute to hide under"
)


def compute_flops_per_s(hw: Hardware, param_dtype: str) -> tuple[float, Source]:
    """The forward/backward flop rate: a calibrated profile's measured square-matmul rate in
    the parameter dtype, else the dense bf16 peak × `model_mfu` (the plan's model time)."""
    dtype = "bf16" if DTYPE_BYTES[param_dtype] <= 2 else "fp32"
    measured = hw.matmul_tflops.get(dtype, {}).get("square")
    if measured is not None:
        return measured * 1e12, "measured"
    return hw.bf16_tflops * 1e12 * hw.model_mfu, "datasheet"


def forward_backward(plan: dict[str, Any], hw: Hardware, layout: Layout) -> dict[str, Any]:
    """Forward and backward seconds of one GPU, and how they were priced. With a measured
    `activation_gb_per_s` (`orthoptim bench calibrate`): the 6·N·D and attention flops
    (`plan["work"]`) at the measured linear-layer matmul rate (the square one where there is
    none) plus the saved-activation bytes at that rate; else the 6·N·D flops at
    `compute_flops_per_s`. One third forward, two thirds backward."""
    o, work = plan["overhead"], plan["work"]
    if hw.activation_gb_per_s is not None and work["seq_len"]:
        p = DTYPE_BYTES[layout.param_dtype]
        measured = hw.matmul_tflops.get("bf16" if p <= 2 else "fp32", {})
        rate = hw.matmul_flops_per_s(p, "linear" if "linear" in measured else "square")
        flops = o["model_flops_per_gpu"] + work["attention_flops_per_gpu"]
        activations = work["activation_bytes_per_gpu"] / (hw.activation_gb_per_s * 1e9)
        total, source = flops / rate + activations, "measured, with activations"
    else:
        rate, source = compute_flops_per_s(hw, layout.param_dtype)
        total, activations = o["model_flops_per_gpu"] / rate, 0.0
    return {
        "compute_flops_per_s": rate,
        "compute_rate_source": source,
        "activation_s": activations,
        "forward_s": total / 3,
        "backward_s": 2 * total / 3,
    }


def activation_collectives(plan: dict[str, Any], hw: Hardware) -> dict[str, Any]:
    """Seconds of tensor and expert parallelism's activation collectives (`plan["work"]`),
    each call's bytes over its group's measured link (`Hardware.collective`) plus one
    latency, none of them hidden; where the profile measured a split linear layer's fixed
    cost (`tp_us_per_linear`: its dispatch and its all-reduce's latency), that per split
    layer instead of the latency. The sum, and each kind's."""
    each = {}
    for c in plan["work"]["collectives"]:
        bw, lat = hw.collective(c["kind"], c["group"])
        calls = c["forward_calls"] + c["backward_calls"]
        fixed = calls * lat
        if "split_linears" in c and hw.tp_us_per_linear is not None:
            fixed = c["split_linears"] * hw.tp_us_per_linear * 1e-6
        each[c["what"]] = calls * c["bytes_per_call"] / bw + fixed
    return {"total_s": sum(each.values()), "per_kind_s": each}


def dp_link(hw: Hardware, kind: CollectiveKind, layout: Layout) -> tuple[float, float]:
    """(bytes/s, latency s) of one `kind` over the data-parallel group: the measured entry for
    its size, else the link of the GPUs it spans (dp × tp)."""
    if str(layout.dp) in hw.collectives.get(kind, {}):
        return hw.collective(kind, layout.dp)
    return hw.link(layout.dp * layout.tp)


def _exposed(total: float, hidden_under: float, buckets: int) -> float:
    """Seconds of a bucketed collective of `total` seconds not hidden under a pass of
    `hidden_under` seconds: the excess, and never less than one bucket's share."""
    if total <= 0:
        return 0.0
    return max(total - hidden_under, total / buckets)


def comm_terms(plan: dict[str, Any], hw: Hardware, layout: Layout) -> dict[str, Any]:
    """Per rank: the reduction's and the gather's bytes (the plan's), buckets and seconds."""
    grad_b, gather_b = DTYPE_BYTES[layout.grad_dtype], DTYPE_BYTES[layout.gather]
    comm = plan["comm"]["bf16_gather" if gather_b == 2 else "fp32_gather"]
    both = [
        max(s, r)
        for s, r in zip(comm["layerwise_sent_per_rank"], comm["layerwise_received_per_rank"])
    ]
    bucket = layout.bucket_mb * 2**20
    grads = [row["grads"] for row in plan["memory_per_rank"]["per_rank"]]
    buckets = [max(1, math.ceil(g / bucket)) for g in grads]
    out: dict[str, Any] = {"buckets_per_rank": buckets}
    for name, kind, share in (
        ("reduce", "reduce_scatter", grad_b),
        ("gather", "all_gather", gather_b),
    ):
        bw, lat = dp_link(hw, kind, layout)
        moved = [b * share / (grad_b + gather_b) for b in both]
        out[f"{name}_bytes_per_rank"] = moved
        out[f"{name}_s_per_rank"] = [
            m / bw + n * lat if m else 0.0 for m, n in zip(moved, buckets, strict=True)
        ]
    return out


def step_traffic(
    elements: float, state: float, masters: float, grad_bytes: int, param_bytes: int
) -> float:
    """Bytes the optimizer step's elementwise part moves on a rank stepping `elements`
    elements with `state` and `masters` bytes held: each gradient read, each parameter read
    and written, the state and the master copies read and written."""
    return elements * (grad_bytes + 2 * param_bytes) + 2 * (state + masters)


def optimizer_terms(plan: dict[str, Any], hw: Hardware, layout: Layout) -> dict[str, Any]:
    """Per rank: Newton-Schulz flops and seconds, tensor-parallel bytes, rounds and seconds,
    elementwise bytes and seconds. The flops are the balancing's (each matrix on its path),
    under --tp the mode's (`plan["tp"]`: auto's picks, or the fixed --tp-mode's)."""
    ns_flops = plan["balancing"]["cost"]["ns_flops_per_rank"]
    ranks = len(ns_flops)
    tp_bytes, tp_rounds = [0.0] * ranks, [0] * ranks
    if layout.tp > 1:
        row = plan["tp"][layout.tp_mode]
        tp_bytes, tp_rounds = row["bytes_per_rank"], row["rounds_per_rank"]
        ns_flops = row["flops_per_rank"]
    ns_rate = hw.matmul_flops_per_s(DTYPE_BYTES[layout.ns_dtype])
    bw, lat = hw.collective("all_reduce", layout.tp)
    mem = plan["memory_per_rank"]
    grad_b, param_b = DTYPE_BYTES[layout.grad_dtype], DTYPE_BYTES[layout.param_dtype]
    elementwise = [
        step_traffic(n, s, m, grad_b, param_b)
        for n, s, m in zip(
            plan["memory"]["owned_elements_per_rank"],
            mem["state_per_rank"],
            mem["masters_per_rank"],
            strict=True,
        )
    ]
    memory_rate = hw.optimizer_bytes_per_s()
    if memory_rate is None:  # no figure in the profile: the TP cost model's GPU default
        memory_rate = CostModel().memory_bandwidth
    tensors = plan["memory"]["owned_tensors_per_rank"]
    us = hw.optimizer_us_per_tensor
    matrix = "matrix_tp" if layout.tp > 1 and "matrix_tp" in us else "matrix"
    fixed = {"matrix": us.get(matrix, 0.0) * 1e-6, "elementwise": us.get("elementwise", 0.0) * 1e-6}
    return {
        "ns_flops_per_rank": ns_flops,
        "ns_flops_per_s": ns_rate,
        "ns_s_per_rank": [f / ns_rate for f in ns_flops],
        "tp_bytes_per_rank": tp_bytes,
        "tp_rounds_per_rank": tp_rounds,
        "tp_s_per_rank": [b / bw + n * lat for b, n in zip(tp_bytes, tp_rounds, strict=True)],
        "elementwise_bytes_per_rank": elementwise,
        "memory_bytes_per_s": memory_rate,
        "elementwise_s_per_rank": [b / memory_rate for b in elementwise],
        "tensors_per_rank": tensors,
        "per_tensor_s_per_rank": [
            m * fixed["matrix"] + e * fixed["elementwise"]
            for m, e in zip(tensors["matrix"], tensors["elementwise"], strict=True)
        ],
    }


def step_terms(plan: dict[str, Any], hw: Hardware, layout: Layout) -> dict[str, Any]:
    """Every term of one step of `plan` (its layout `layout`) on `hw`: per rank, the phases of
    the busiest rank in each (`PHASES`), the step's seconds and tokens per second."""
    o = plan["overhead"]
    fb, act = forward_backward(plan, hw, layout), activation_collectives(plan, hw)
    forward, backward = fb["forward_s"], fb["backward_s"]
    exposed = act["total_s"]
    comm, opt = comm_terms(plan, hw, layout), optimizer_terms(plan, hw, layout)
    buckets = comm["buckets_per_rank"]
    hides = 1.0 if hw.comm_overlap is None else hw.comm_overlap
    reduce = [_exposed(t, hides * backward, n) for t, n in zip(comm["reduce_s_per_rank"], buckets)]
    gather = [_exposed(t, hides * forward, n) for t, n in zip(comm["gather_s_per_rank"], buckets)]
    columns = (reduce, opt["ns_s_per_rank"], opt["tp_s_per_rank"],
               opt["elementwise_s_per_rank"], opt["per_tensor_s_per_rank"], gather)  # fmt: skip
    per_rank = [forward + backward + exposed + sum(x) for x in zip(*columns, strict=True)]
    firsts = (forward, backward, exposed)
    phases = dict(zip(PHASES, (*firsts, *(max(c) for c in columns)), strict=True))
    step = sum(phases.values())
    return {
        "optimizer": layout.optimizer,
        "tokens_per_step": o["tokens_per_step"],
        "model_flops_per_gpu": o["model_flops_per_gpu"],
        **fb,
        "activation_collectives_s": act["per_kind_s"],
        **comm,
        **opt,
        "reduce_exposed_s_per_rank": reduce,
        "gather_exposed_s_per_rank": gather,
        "step_s_per_rank": per_rank,
        "busiest_rank": max(range(len(per_rank)), key=per_rank.__getitem__),
        "phases_s": phases,
        "step_s": step,
        "tokens_per_s": o["tokens_per_step"] / step if step else 0.0,
    }


def step_time(
    desc: ModelDescription,
    hw: Hardware,
    layout: Layout,
    plan: dict[str, Any],
    adamw_plan: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """The step-time section of `plan` (`make_plan(desc, hw, layout)`): its optimizer's terms
    beside AdamW's at the same layout (`adamw_plan`, planned here when not given) and
    `over_adamw`, the ratio of their step times; AdamW left out under tensor parallelism,
    where it is not planned. JSON-ready."""
    if layout.fsdp:
        return {"planned": False, "why": "the step time models the layer-wise optimizer"}
    mine = step_terms(plan, hw, layout)
    out: dict[str, Any] = {"planned": True, layout.optimizer: mine, "rule": OVERLAP_RULE}
    if layout.optimizer == "adamw" or layout.tp > 1:
        out["over_adamw"] = None
        return out
    base = dataclasses.replace(layout, optimizer="adamw")
    adamw = step_terms(adamw_plan or make_plan(desc, hw, base), hw, base)
    out["adamw"] = adamw
    out["over_adamw"] = mine["step_s"] / adamw["step_s"]
    return out


def _row(label: str, values: Sequence[float], unit: Literal["ms", "count"] = "ms") -> str:
    """One row of the table: seconds as ms, or whole counts."""
    cells = "".join(f"{v * 1e3:>13.3f}" if unit == "ms" else f"{v:>13,.0f}" for v in values)
    return f"  {label:<34}{cells}"


def step_time_lines(section: dict[str, Any]) -> list[str]:
    """The plan report's step-time table (ms, the busiest rank of each phase)."""
    if not section.get("planned"):
        return ["", f"step time: not planned ({section.get('why', '')})"]
    names = [k for k in ("muon", "soap", "adamw") if k in section]
    terms = [section[k] for k in names]
    first = terms[0]
    labels = {
        "forward": "forward",
        "backward": "backward",
        "reduce_exposed": "gradient reduction, exposed",
        "ns": "optimizer: SOAP's matrix work" if "soap" in names else "optimizer: Newton-Schulz",
        "tp": "optimizer: TP bytes and rounds",
        "activation_collectives": "TP/EP activation collectives",
        "elementwise": "optimizer: elementwise (memory)",
        "per_tensor": "optimizer: per-tensor fixed cost",
        "gather_exposed": "parameter gather, exposed",
    }
    lines = [
        "",
        f"step time per GPU, predicted, ms (each phase's busiest rank; "
        f"{first['tokens_per_step']:,} tokens per step; compute "
        f"{first['compute_flops_per_s'] / 1e12:.4g} TFLOP/s, {first['compute_rate_source']}):",
        f"{'':<36}" + "".join(f"{n:>13}" for n in names),
    ]
    lines += [_row(labels[p], [t["phases_s"][p] for t in terms]) for p in PHASES]
    lines.append(_row("step", [t["step_s"] for t in terms]))
    lines.append(_row("tokens/s, all GPUs", [t["tokens_per_s"] for t in terms], "count"))
    for name, label in (("reduce", "gradient reduction"), ("gather", "parameter gather")):
        whole = [max(t[f"{name}_s_per_rank"]) for t in terms]
        lines.append(_row(f"{label}, whole", whole))
    ratio = section.get("over_adamw")
    if ratio is not None:
        lines.append(f"  {names[0]}/adamw step time {ratio:.4f}")
    elif "adamw" not in names:
        lines.append("  AdamW is not planned under --tp (its units would be owned whole)")
    lines += textwrap.wrap(
        f"overlap: {section['rule']}", 96, initial_indent="  ", subsequent_indent="    "
    )
    return lines


def published_comparison(hardware: str = "gb300") -> list[dict[str, Any]]:
    """For each layout of the GB300 publication (`PUBLISHED_GB300`), the model's Muon/AdamW
    step-time ratio at the model file's tokens per step beside the published one (AdamW's
    TFLOP/s over Muon's model TFLOP/s), the Newton-Schulz share of Muon's flops in both (the
    plan's plain-matmul count, as the publication's TFLOP/s count them) and of the model's
    step time, and
    the tokens per step at which the model's ratio would equal the published one (the
    optimizer's extra time is fixed, the model's grows with the tokens). Nothing is fitted."""
    hw = load_hardware(hardware)
    rows = []
    for name, layout in PUBLISHED_LAYOUTS.items():
        desc, pub = load_model(name), PUBLISHED_GB300[name]
        plan = make_plan(desc, hw, layout)
        section = step_time(desc, hw, layout, plan)
        muon, ratio = section["muon"], section["over_adamw"]
        published = pub["adamw_tflops"] / pub["muon_model_tflops"]
        tokens = muon["tokens_per_step"]
        share = plan["overhead"]["ns_share_of_model_flops_mean"]
        rows.append(
            {
                "model": name,
                "layout": pub["layout"],
                "tokens_per_step": tokens,
                "model_ratio": ratio,
                "published_ratio": published,
                "model_ns_time_share": muon["phases_s"]["ns"] / muon["step_s"],
                "model_ns_flops_share": share / (1 + share),
                "published_ns_flops_share": pub["muon_ns_tflops"] / pub["muon_tflops"],
                "tokens_per_step_matching": (
                    tokens * (ratio - 1) / (published - 1) if ratio > 1 else None
                ),
            }
        )
    return rows


def format_published(rows: Sequence[dict[str, Any]]) -> str:
    """`published_comparison` as a Markdown table."""
    lines = [
        "| model, layout | tokens per step (model file) | Muon/AdamW step time: model | "
        "published | Newton-Schulz share of Muon's flops: model | published | of Muon's step "
        "time: model | tokens per step where the ratios meet |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in rows:
        meet = r["tokens_per_step_matching"]
        lines.append(
            f"| {r['model']}, {r['layout']} | {r['tokens_per_step']:,} | "
            f"{r['model_ratio']:.4f} | {r['published_ratio']:.4f} | "
            f"{r['model_ns_flops_share']:.2%} | {r['published_ns_flops_share']:.2%} | "
            f"{r['model_ns_time_share']:.2%} | {f'{meet:,.0f}' if meet else '—'} |"
        )
    return "\n".join(lines)
