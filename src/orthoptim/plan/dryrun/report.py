"""The dry run's report: `run_rank` for a few ranks beside the plan's figures, the
cross-rank collective check and the memory verdict (`dry_run`), and its text
(`format_dry_run`)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from orthoptim.plan.baseline import adamw_baseline, adamw_layout, versus
from orthoptim.plan.dryrun.rank import (
    CATEGORIES,
    Parallel,
    RankResult,
    group_mismatches,
    host_syncs_per_step,
    run_isolated,
    run_rank,
)
from orthoptim.plan.hardware import memory_verdict
from orthoptim.plan.layouts import Layout
from orthoptim.plan.model import ModelDescription

COVERAGE = {
    "covered": [
        "every tensor on a non-CPU device: a CPU tensor handed to a collective is refused as "
        "NCCL refuses it; a CPU tensor mixed into a device op raises",
        "bf16 Newton-Schulz (ns_dtype bfloat16, what 'auto' picks on CUDA)",
        "AdamW's foreach step (torch's choice for CUDA parameters; not under TP)",
        "the ownership assignment priced as on CUDA with Triton SYRK (the GPU's owners)",
        "host reads (.item(), .tolist(), bool(), .cpu()) counted where the library makes them",
        "FSDP2 fully_shard and DTensor tensor parallelism on a device mesh",
    ],
    "not covered": [
        "the Triton kernels themselves (on meta Newton-Schulz takes the matmul path)",
        "CUDA streams and events (FSDP2's copy streams run as on CPU), the caching "
        "allocator's fragmentation, NCCL's own buffers and timeouts",
        "activations at a real batch size (the forward touches each parameter once: the "
        "verdict adds the plan's estimate, `orthoptim.plan.activations`)",
    ],
}


def plan_figures(plan: dict[str, Any], index: int) -> dict[str, float | None]:
    """`make_plan`'s figures for plan slot `index` (stage × dp rank) in the dry run's
    categories: its per-category memory (`memory_per_rank`) where the plan has it, else only
    the optimizer state; bytes per step of the bucket collectives (in the layout's gather
    dtype)."""
    keys = (*CATEGORIES, "transient", "peak", "construction", "needs")
    out: dict[str, float | None] = dict.fromkeys(keys)
    per = plan.get("memory_per_rank")
    if per:
        row = per["per_rank"][index]
        for k in out:
            out[k] = row.get(k)
        out["needs"] = per["peak_with_activations_per_rank"][index]
        out["transient"] = row["peak"] - row["steady"]  # as the dry run's: step or backward
    else:
        out["state"] = plan["memory"]["layerwise_state_bytes_per_rank"][index]
    c = plan["comm"][f"{plan['layout']['gather_dtype']}_gather"]
    out["bytes"] = (
        None  # the plan's bytes are the layer-wise buckets'
        if plan["layout"].get("fsdp")
        else max(c["layerwise_sent_per_rank"][index], c["layerwise_received_per_rank"][index])
    )
    return out


def dry_run(
    desc: ModelDescription,
    layout: Layout,
    hardware: Any,
    ranks: list[int] | None = None,
    stage: int = 0,
    progress: Callable[[Any], Any] | None = None,
    adamw: bool = True,
) -> dict[str, Any]:
    """`run_rank` for each of `ranks` (default 0 and the last of the stage), the plan's
    figures beside each, the cross-rank collective check, and whether the peak fits
    `hardware.memory_gb`; with `adamw` (and another optimizer, at --tp 1) the same ranks
    under AdamW at the same layout too, measured beside the plan's (`_adamw_rows`); as a
    JSON-ready dict (`format_dry_run` prints it)."""
    from orthoptim.plan.planner import make_plan

    optimizer, tp_mode = layout.optimizer, layout.tp_mode
    parallel: Parallel = "fsdp" if layout.fsdp else "layerwise"
    n = layout.dp * layout.tp
    ranks = sorted(set(ranks if ranks else [0, n - 1]))
    plan = make_plan(desc, hardware, layout)
    results = []
    run = run_isolated if layout.tp > 1 else run_rank
    for r in progress(ranks) if progress is not None else ranks:
        results.append(run(desc, layout, r, stage))
    mismatches = [
        m for a in results for b in results if a.rank < b.rank for m in group_mismatches(a, b)
    ]
    versus = _adamw_rows(desc, layout, hardware, plan, (ranks, results), stage, progress, adamw)
    mismatches += versus.pop("mismatches", [])
    capacity = hardware.memory_gb * 1e9
    # the dry run's forward touches each parameter once: the activations of a real
    # micro-batch are the plan's estimate (`orthoptim.plan.activations`) for the stage
    acts = plan["memory_per_rank"]["activations"] if "memory_per_rank" in plan else None
    activations = acts["bytes_per_stage"][stage] if acts else 0
    rows = [
        _rank_row(
            r, plan, activations, capacity, versus["ranks"][i] if versus.get("ranks") else None
        )
        for i, r in enumerate(results)
    ]
    worst = max(rows, key=lambda x: x["needs"])
    over = sum(not x["fits"] for x in rows)
    return {
        "model": desc.name,
        "hardware": hardware.name,
        "memory_bytes": capacity,
        "layout": {**layout.__dict__, "stage": stage, "world": results[0].world},
        "optimizer": optimizer,
        "parallel": parallel,
        "tp_mode": tp_mode if layout.tp > 1 else None,
        "ranks": rows,
        "group_mismatches": mismatches,
        "fits": all(x["fits"] for x in rows),
        "verdict": memory_verdict(worst["needs"], capacity, hardware.name, over, len(rows)),
        "to_fit": [] if worst["fits"] else _to_fit(worst, layout, parallel, desc),
        "adamw": versus,
        "coverage": COVERAGE,
    }


def _rank_row(
    r: RankResult,
    plan: dict[str, Any],
    activations: int,
    capacity: float,
    adamw: dict[str, Any] | None,
) -> dict[str, Any]:
    """One simulated rank's row of `dry_run`: what it held, sent and read, the plan's figures
    beside them, and whether it fits `capacity` bytes: the larger of its measured step peak
    with the plan's `activations` and the peak of building the optimizer."""
    needs = max(r.peak + activations, r.construction)
    return {
        "rank": r.rank,
        "memory": r.memory,
        "steady": r.steady,
        "peak": r.peak,
        "transient": r.peak - r.steady,
        "construction": r.construction,
        "activations": activations,
        "needs": needs,
        "bytes_per_step": r.bytes_per_step,
        "comm_stats": r.comm,
        "expected_comm_bytes": r.expected,
        "comm_matches_expected": r.comm_matches,
        "collectives_per_step": len(r.collectives[-1]),
        "host_syncs_per_step": host_syncs_per_step(r),
        "host_sync_sites": r.host_syncs[-1],
        "stepped_tensors": r.stepped,
        "seconds": r.seconds,
        "plan": plan_figures(plan, r.plan_index),
        "fits": needs <= capacity,
        "notes": r.notes,
        "adamw": adamw,
    }


def _adamw_rows(
    desc: ModelDescription,
    layout: Layout,
    hardware: Any,
    plan: dict[str, Any],
    ran: tuple[list[int], list[RankResult]],
    stage: int,
    progress: Callable[[Any], Any] | None,
    measure: bool,
) -> dict[str, Any]:
    """AdamW at the layout beside the dry run's ranks (`ran`: the ranks of the stage and what
    each did): its planned peak per rank (`adamw_baseline`) and, when `measure`, its peak
    measured on the same ranks (`run_rank` under --optimizer adamw: a few seconds a rank
    where Muon's dry run of a large model takes a minute), with the ratios of the peaks
    (the busiest ranks' at the top); the AdamW runs' collective mismatches under
    "mismatches". Nothing to compare under --optimizer adamw."""
    if layout.optimizer == "adamw":
        return {"measured": False, "why": "this run is AdamW's"}
    ranks, results = ran
    base = adamw_baseline(desc, hardware, layout, plan)
    if not base["planned"]:
        return {"measured": False, "why": base["why"]}
    out: dict[str, Any] = {
        "measured": measure,
        "plan_ratio": base["ratio"],  # over every rank of the layout
        "ratio": None,
        "ranks": [
            {
                "plan_peak": base["adamw_peak_per_rank"][r.plan_index],
                "plan_ratio": base["ratio_per_rank"][r.plan_index],
                "peak": None,
                "ratio": None,
            }
            for r in results
        ],
    }
    if not measure:
        return out
    lay = adamw_layout(layout)  # --tp 1 here: no spawned process needed
    measured = [run_rank(desc, lay, r, stage) for r in (progress(ranks) if progress else ranks)]
    for row, r, m in zip(out["ranks"], results, measured, strict=True):
        row.update(
            peak=m.peak, memory=m.memory, ratio=r.peak / m.peak,
            comm_matches_expected=m.comm_matches,
        )  # fmt: skip
    out["ratio"] = max(r.peak for r in results) / max(m.peak for m in measured)
    out["mismatches"] = [
        f"adamw: {x}" for a in measured for b in measured if a.rank < b.rank
        for x in group_mismatches(a, b)
    ]  # fmt: skip
    return out


def _to_fit(
    row: dict[str, Any], layout: Layout, parallel: Parallel, desc: ModelDescription
) -> list[str]:
    """Flags that shrink what dominates the peak, with the share each removes."""
    mem = row["memory"]
    out = []
    if parallel == "layerwise" and layout.tp == 1 and layout.ep == 1:
        out.append(
            f"--fsdp (parameters and gradients sharded over --dp {layout.dp}, no bucket "
            f"buffers: about {(mem['params'] + mem['grads'] + mem['buffers']) / 2**30:.1f} GiB "
            "of this rank's shrink by that factor)"
        )
    if layout.param_dtype == "fp32":
        out.append(
            f"--param-dtype bf16 (every rank's {mem['params'] / 2**30:.1f} GiB of parameters "
            "halve; fp32 master copies of the owned elements only)"
        )
    out.append(
        f"--pp {layout.pp * 2} (each stage holds half the layers: parameters, gradients, "
        "buffers and state about halve)"
    )
    if (
        desc.is_moe
        and desc.n_routed_experts % (layout.ep * 2) == 0
        and layout.dp % (layout.ep * 2) == 0
    ):
        out.append(f"--ep {layout.ep * 2} (half the experts per rank)")
    out.append(f"--tp {layout.tp * 2} (attention and dense MLP matrices split in two)")
    if row["activations"] and layout.recompute != "full":
        out.append(
            f"--recompute full (of the {row['activations'] / 2**30:.1f} GiB of activations "
            "each layer keeps its input only)"
        )
    return out


def _gib(x: float | None) -> str:
    return "-" if x is None else f"{x / 2**30:.3f}"


def _ratio(x: float | None) -> str:
    return "-" if x is None else f"{x:.3f}"


def format_dry_run(d: dict[str, Any]) -> str:
    """The human-readable report of `dry_run`'s dict: per rank, the dry run's figures with
    `plan`'s beside them."""
    lay = d["layout"]
    head = (
        f"orthoptim plan --dry-run: {d['model']} on {d['hardware']}, {d['parallel']} "
        f"{d['optimizer']}"
        + (f" (TP mode {d['tp_mode']})" if d["tp_mode"] else "")
        + f": DP {lay['dp']} x TP {lay['tp']} (EP {lay['ep']})"
        + (f", stage {lay['stage']} of PP {lay['pp']}" if lay["pp"] > 1 else "")
        + f", {lay['world']} simulated ranks on the meta device"
    )
    lines = [
        head,
        "",
        f"{'per rank (GiB)':<22}" + "".join(f"{'rank ' + str(r['rank']):>22}" for r in d["ranks"]),
    ]
    lines.append(f"{'':<22}" + "".join(f"{'dry run':>11}{'plan':>11}" for _ in d["ranks"]))

    def row(
        label: str, dry: Callable[[dict], Any], planned: Callable[[dict], Any], fmt: Callable = _gib
    ) -> None:
        lines.append(
            f"{label:<22}" + "".join(f"{fmt(dry(r)):>11}{fmt(planned(r)):>11}" for r in d["ranks"])
        )

    for k in CATEGORIES:
        row(k, lambda r, k=k: r["memory"][k], lambda r, k=k: r["plan"][k])
    row("transient", lambda r: r["transient"], lambda r: r["plan"]["transient"])
    row("peak", lambda r: r["peak"], lambda r: r["plan"]["peak"])
    row("construction", lambda r: r["construction"], lambda r: r["plan"]["construction"])
    row("activations (plan's)", lambda r: r["activations"], lambda r: r["activations"])
    cap = d["memory_bytes"]
    row(
        "fits", lambda r: r["needs"], lambda r: r["plan"]["needs"],
        lambda x: "-" if x is None else ("yes" if x <= cap else "no"),
    )  # fmt: skip
    if d["adamw"].get("ranks"):
        row("adamw peak", lambda r: r["adamw"]["peak"], lambda r: r["adamw"]["plan_peak"])
        row(f"{d['optimizer']}/adamw", lambda r: r["adamw"]["ratio"],
            lambda r: r["adamw"]["plan_ratio"], _ratio)  # fmt: skip
    row("bytes/step (buckets)", lambda r: r["bytes_per_step"], lambda r: r["plan"]["bytes"])
    row(
        "collectives/step", lambda r: r["collectives_per_step"], lambda r: None,
        lambda x: "-" if x is None else str(x),
    )  # fmt: skip
    row(
        "host syncs/step", lambda r: r["host_syncs_per_step"], lambda r: None,
        lambda x: "-" if x is None else str(x),
    )  # fmt: skip
    lines.append(f"{'seconds':<22}" + "".join(f"{r['seconds']:>11.1f}{'':>11}" for r in d["ranks"]))
    lines.append("")
    for r in d["ranks"]:
        sites = ", ".join(
            f"{s.rsplit('.', 1)[-1]} {n}" for s, n in sorted(r["host_sync_sites"].items())
        )
        ok = "equal" if r["comm_matches_expected"] else "DIFFERENT"
        lines.append(
            f"rank {r['rank']}: comm_stats() {ok} to expected_comm_bytes(); host syncs: {sites}"
        )
    lines.append(
        "collectives: every shared group issues the same sequence on the ranks run"
        if not d["group_mismatches"]
        else "collectives MISMATCH (NCCL would hang): " + "; ".join(d["group_mismatches"])
    )
    if d["fits"]:
        lines.append(f"{d['verdict']} (measured)")
    else:
        lines.append(f"{d['verdict']} (measured); flags that shrink it:")
        lines += [f"  {x}" for x in d["to_fit"]]
    lines.append(_adamw_line(d))
    lines.append("covers: " + "; ".join(d["coverage"]["covered"]))
    lines.append("does not cover: " + "; ".join(d["coverage"]["not covered"]))
    return "\n".join(lines)


def _adamw_line(d: dict[str, Any]) -> str:
    """The busiest ranks' peaks against AdamW's at the layout: measured, or planned only."""
    a, opt = d["adamw"], d["optimizer"]
    if not a.get("ranks"):
        return f"against AdamW: {a['why']}"
    head = "against AdamW at this layout (every parameter AdamW, sharded element-wise): "
    plan = f"{opt}/adamw {a['plan_ratio']:.3f} over every rank (plan)"
    if not a["measured"]:
        return head + plan + "; AdamW not measured"
    peak = max(r["peak"] for r in d["ranks"])
    theirs = max(r["adamw"]["peak"] for r in d["ranks"])
    return (
        head + f"busiest peak {opt} {_gib(peak)} GiB, AdamW {_gib(theirs)} GiB, {opt}/adamw "
        f"{a['ratio']:.3f} ({versus(a['ratio'])}; both measured on these ranks); {plan}"
    )
