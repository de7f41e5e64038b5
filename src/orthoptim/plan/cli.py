"""`orthoptim plan`: print (or write as JSON, or plot) a model's optimizer figures at scale."""

from __future__ import annotations

import argparse
import json
import shlex
import sys
from dataclasses import fields
from pathlib import Path
from typing import Any

from orthoptim._extras import require_extra
from orthoptim.newton_schulz import NS_BATCH_MB
from orthoptim.ns_cost import NS_STEPS
from orthoptim.parallel.layout import as_flags
from orthoptim.parallel.tensor_parallel import TP_MODES, tp_mode_names
from orthoptim.plan.activations import RECOMPUTES
from orthoptim.plan.baseline import adamw_baseline, versus
from orthoptim.plan.hardware import load_hardware, shipped_hardware
from orthoptim.plan.layouts import (
    BALANCES,
    DTYPE_BYTES,
    PLAN_OPTIMIZERS,
    Layout,
    check_layout,
    check_stage,
)
from orthoptim.plan.model import TRAIN_PREFIX, hf_model, load_model, shipped_models
from orthoptim.plan.planner import make_plan
from orthoptim.plan.steptime import step_time, step_time_lines


def _si(x: float, unit: str = "") -> str:
    for factor, prefix in ((1e15, "P"), (1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(x) >= factor:
            return f"{x / factor:.3g} {prefix}{unit}"
    return f"{x:.3g} {unit}"


def _bytes(x: float, digits: int = 3) -> str:
    for factor, prefix in ((2**40, "TiB"), (2**30, "GiB"), (2**20, "MiB"), (2**10, "KiB")):
        if abs(x) >= factor:
            return f"{x / factor:.{digits}g} {prefix}"
    return f"{x:.0f} B"


def _memory_lines(p: dict[str, Any]) -> list[str]:
    """The memory per rank by category (`memory_per_rank`) and whether the peak fits."""
    mem, lay = p["memory_per_rank"], p["layout"]
    cats = ("params", "grads", "masters", "state", "buffers", "transient", "backward", "peak")
    rows = [("rank 0", mem["rank_0"]), (f"rank {mem['rank_last']['rank']}", mem["rank_last"])]
    rows.append((f"max (peak: rank {mem['max_peak_rank']})", mem["max"]))
    where = " (stage x DP rank)" if lay["pp"] > 1 else ""
    which = "FSDPOptimizer over FSDP2" if lay["fsdp"] else "layer-wise optimizer"
    tp = f", TP {lay['tp_mode']}" if lay["tp"] > 1 else ""
    dtypes = (
        f"fp32 sharded parameters computing in {lay['param_dtype']}, {lay['grad_dtype']} "
        "gradient reduction"
        if lay["fsdp"]
        else f"{lay['param_dtype']} parameters, {lay['grad_dtype']} gradients, "
        f"{mem['gather_dtype']} gather"
    )
    dtypes += f", {lay['state_dtype']} state" if lay.get("state_dtype", "fp32") != "fp32" else ""
    lines = [
        f"memory per rank{where}, {which} ({lay['optimizer']}{tp}) as it runs ({dtypes}; "
        "peak = held + the larger of transient and backward):",
        f"{'':<26}" + "".join(f"{c:>11}" for c in cats) + f"{'fits':>6}",
    ]
    for label, row in rows:
        fits = "yes" if _row_fits(mem, row) else "no"
        lines.append(
            f"  {label:<24}" + "".join(f"{_bytes(row[c], 4):>11}" for c in cats) + f"{fits:>6}"
        )
    if not lay["fsdp"]:
        built = max(range(len(mem["per_rank"])), key=lambda r: mem["per_rank"][r]["construction"])
        lines.append(
            f"  building the optimizer: peak {_bytes(mem['per_rank'][built]['construction'], 4)} "
            f"(rank {built}: the model as built in fp32 moving into the flat buffers a segment "
            "at a time, the masters, then the flat gradients)"
        )
    lines += _activation_lines(p)
    if lay["fsdp"]:
        lines.append(
            f"  FSDP2's unsharded buffers during forward/backward (not in the peak): "
            f"{_bytes(mem['max']['fsdp_gather'], 4)} (estimate)"
        )
    return lines


def _row_fits(mem: dict[str, Any], row: dict[str, Any]) -> bool:
    """Whether a memory row's peak with its rank's activations fits (the max row: every rank)."""
    if "rank" in row:
        return mem["peak_with_activations_per_rank"][row["rank"]] <= mem["hardware_bytes"]
    return mem["fits"] if row is mem["max"] else row["peak"] <= mem["hardware_bytes"]


def _activation_lines(p: dict[str, Any]) -> list[str]:
    """The activations per rank (`orthoptim.plan.activations`) and the verdict counting them."""
    mem, lay = p["memory_per_rank"], p["layout"]
    a = mem["activations"]
    if a is None:
        return [
            f"  {mem['verdict']} (the model's activations not counted: the description has no "
            "seq_len; pass --seq-len)"
        ]
    first, last = a["per_stage"][0], a["per_stage"][-1]
    stages = (
        f"stage 0 {_bytes(first['bytes'], 4)} ({first['in_flight']} micro-batches in flight, "
        f"1F1B), last stage {_bytes(last['bytes'], 4)}"
        if lay["pp"] > 1
        else f"{_bytes(first['bytes'], 4)} per rank"
    )
    tp = f", sequence parallel over TP {lay['tp']}" if lay["tp"] > 1 else ""
    again = max(x["recompute_transient"] for x in a["per_stage"])
    extra = (
        f"; one layer recomputed at a time in backward, {_bytes(again, 4)} of it" if again else ""
    )
    return [
        f"  activations, micro-batch {a['micro_batch']} x {a['seq_len']:,} tokens, recompute "
        f"{a['recompute']}, {lay['param_dtype']}{tp}: {stages}{extra}",
        f"  {mem['verdict']} (peak + activations)",
    ]


def _baseline_lines(p: dict[str, Any]) -> list[str]:
    """The whole peak per rank against AdamW's at the same layout (`adamw_baseline`)."""
    b = p.get("adamw_baseline")
    if b is None or b["optimizer"] == "adamw":
        return []
    if not b["planned"]:
        return ["", f"against AdamW: {b['why']}"]
    opt, last = b["optimizer"], len(b["peak_per_rank"]) - 1
    lines = [
        "",
        "whole peak per rank against AdamW at this layout (AdamW for every parameter, sharded "
        "element-wise, the same dtypes; plan):",
        f"{'':<26}{opt:>11}{'adamw':>11}{opt + '/adamw':>13}",
    ]
    for label, i, j in (
        ("rank 0", 0, 0),
        (f"rank {last}", last, last),
        ("busiest rank of each", b["max_peak_rank"], b["adamw_max_peak_rank"]),
    ):
        mine, theirs = b["peak_per_rank"][i], b["adamw_peak_per_rank"][j]
        lines.append(
            f"  {label:<24}{_bytes(mine, 4):>11}{_bytes(theirs, 4):>11}{mine / theirs:>13.3f}"
        )
    lines.append(f"  {opt}'s busiest peak is {versus(b['ratio'])}")
    return lines


def _header_lines(p: dict[str, Any]) -> list[str]:
    """The layout, the model's counts and, with experts, where they are assigned."""
    m, lay = p["model"], p["layout"]
    lines = [
        f"orthoptim plan: {m['name']} on {p['hardware']}: DP {lay['dp']} x TP {lay['tp']} "
        f"x PP {lay['pp']} (EP {lay['ep']}) = {lay['gpus']} GPUs"
        + (f"; layers per stage {lay['layers_per_stage']}" if lay["pp"] > 1 else ""),
        f"model: {_si(m['params_total'])} params"
        + (f" (published {_si(m['published_total'])})" if m["published_total"] else "")
        + f", {_si(m['params_active'])} active per token"
        + (f" (published {_si(m['published_active'])})" if m["published_active"] else "")
        + f"; {m['units']:,} optimizer units, {m['muon_units']:,} of them Muon",
    ]
    if lay["ep"] > 1 or lay["experts_per_ep_rank"]:
        lines.append(
            f"experts: {lay['experts_per_ep_rank']} per layer on each EP rank, assigned over "
            f"the expert-data-parallel group of {lay['expert_dp']}; the rest over DP {lay['dp']}"
        )
    return lines


def _balancing_lines(p: dict[str, Any]) -> list[str]:
    """Newton-Schulz flops per rank under each balancing, and how lumpy the layout is."""
    lay = p["layout"]
    if lay["optimizer"] == "adamw":
        return ["", "Newton-Schulz: none (AdamW for every parameter, sharded element-wise)"]
    tp_note = ", TP-split matrices as auto mode" if lay["tp"] > 1 else ""
    lines = [
        "",
        f"Newton-Schulz per rank{' (stage x DP rank)' if lay['pp'] > 1 else ''} "
        f"({lay['ns_steps']} steps on the {lay['device']} {lay['ns_dtype']} path{tp_note})",
        f"{'':<47}max        mean   max/mean   (no balancing below)",
    ]
    for b in BALANCES:
        s = p["balancing"][b]
        label = "capped (1.3x mean/bucket)" if b == "capped" else b
        lines.append(
            f"  {label:<38}{_si(s['ns_flops_max'], 'FLOP'):>11}"
            f"{_si(s['ns_flops_mean'], 'FLOP'):>11}{s['ns_flops_imbalance']:>11.4f}"
            f"{s['imbalance_bound']:>13.4f}"
        )
    per, free = lay["muon_units_per_rank"], lay["movable_muon_units_per_rank"]
    bound = p["balancing"]["cost"]["imbalance_bound"]
    lines.append(
        f"  {per:.1f} Muon units per rank, {free:.1f} with a choice of owner (the rest "
        "pinned by even bucket shards or EP)"
    )
    if bound > 1.01 or free < 8:
        lines.append(
            "  lumpy layout: "
            + (f"no assignment of these buckets gets below {bound:.4f}" if bound > 1.01 else "")
            + ("; " if bound > 1.01 and free < 8 else "")
            + ("too few movable units per rank to even out" if free < 8 else "")
        )
    return lines


def _state_lines(p: dict[str, Any]) -> list[str]:
    """Optimizer state per rank: layer-wise beside ZeRO-1 AdamW and a replicated one."""
    lay, mem = p["layout"], p["memory"]
    extra = " + master copies" if lay["masters"] else ""
    return [
        "",
        f"optimizer state per rank ({lay['optimizer']} / AdamW state{extra}; layer-wise as "
        "memory per rank's state below):",
        f"  layer-wise (cost)          max {_bytes(mem['layerwise_state_bytes_max'])}, "
        f"mean {_bytes(mem['layerwise_state_bytes_mean'])}, max/mean "
        f"{mem['layerwise_state_bytes_max'] / mem['layerwise_state_bytes_mean']:.4f} "
        + ("(AdamW sharded over DP)" if lay["tp"] == 1 else "(AdamW owned whole under TP)"),
        f"  ZeRO-1 AdamW               {_bytes(mem['zero1_adamw_state_bytes_per_rank'])}",
        f"  replicated (no shard)      {_bytes(mem['replicated_muon_state_bytes'])}",
    ]


def _comm_lines(p: dict[str, Any]) -> list[str]:
    """Bytes per rank per step for each gather dtype, beside ZeRO-1 AdamW's."""
    lines = [
        "",
        f"bytes per rank per step ({p['layout']['grad_dtype']} grads; the larger of sent and "
        "received)",
        "                 layer-wise Muon (ratio)   unpadded v-collectives (ratio)   ZeRO-1 AdamW",
    ]
    for gather in ("fp32", "bf16"):
        c = p["comm"][f"{gather}_gather"]
        lines.append(
            f"  {gather} gather  {_bytes(c['layerwise_muon_bytes']):>12} ({c['ratio']:6.3f})"
            f"   {_bytes(c['layerwise_unpadded_bytes']):>16} ({c['unpadded_ratio']:6.3f})"
            f"   {_bytes(c['zero1_adamw_bytes']):>14}"
        )
    return lines


def _tp_lines(p: dict[str, Any]) -> list[str]:
    """Under tensor parallelism, the busiest rank's figures per TP mode and auto's picks."""
    lay, t = p["layout"], p["tp"]
    if lay["tp"] == 1:
        return []
    lines = [
        "",
        f"tensor-parallel Newton-Schulz, TP {lay['tp']} ({lay['ns_dtype']}), busiest rank:",
        "                 bytes sent  collectives       flops   flops max/mean       time",
    ]
    for mode in (*TP_MODES, "auto"):
        r = t[mode]
        lines.append(
            f"  {mode:<12}{_bytes(r['bytes_max']):>13}{r.get('rounds_max', 0):>13}"
            f"{_si(r['flops_max'], 'FLOP'):>12}"
            f"{r['flops_imbalance']:>17.4f}{r['time_max_s'] * 1e3:>9.2f} ms"
        )
    picks = t["auto_picks"]
    chosen = ", ".join(f"{k} {v}" for k, v in sorted(picks.items()))
    picked = ", ".join(m for m, s in TP_MODES.items() if s.auto)
    wide = "".join(f"{m} only in fp32, " for m, s in TP_MODES.items() if s.auto_min_bytes >= 4)
    never = ", ".join(m for m, s in TP_MODES.items() if not s.auto)
    lines.append(
        f"  TP-split Muon matrices: {chosen} (cost model: {t['cost_model']}; "
        f"auto picks among {picked}, {wide}never {never})"
    )
    return lines


def _overhead_lines(p: dict[str, Any]) -> list[str]:
    """Newton-Schulz work and time against the model's, and the published GB300 figures."""
    o = p["overhead"]
    lines = ["", f"optimizer overhead at {o['tokens_per_step']:,} tokens per step:"]
    if o["tokens_per_step"]:
        lines += [
            f"  model 6·active·tokens per GPU {_si(o['model_flops_per_gpu'], 'FLOP')}; "
            f"Newton-Schulz per GPU mean {_si(o['ns_flops_per_gpu_mean'], 'FLOP')}, "
            f"max {_si(o['ns_flops_per_gpu_max'], 'FLOP')}",
            "  (Newton-Schulz counted as plain matmuls, 4m²n + 2m³ a step, as the model's flops "
            "are; the per-rank table above counts its path's, fewer with SYRK)",
            f"  Newton-Schulz share of model flops: {o['ns_share_of_model_flops_mean']:.2%} "
            f"(mean rank), {o['ns_share_of_model_flops_max']:.2%} (busiest rank)",
            f"  modelled time: Newton-Schulz {o['ns_time_s_max'] * 1e3:.1f} ms vs model "
            f"{o['model_time_s'] * 1e3:.0f} ms → {o['ns_share_of_step_time']:.2%} of the step",
        ]
    pub = o.get("published_gb300")
    if pub:
        lines += [
            f"  published, GB300 {pub['layout']}: AdamW {pub['adamw_tflops']:,} vs Muon "
            f"{pub['muon_tflops']:,} TFLOP/s/GPU ({pub['muon_model_tflops']:,} model + "
            f"{pub['muon_ns_tflops']} Newton-Schulz)",
            f"    → Newton-Schulz {pub['ns_share_of_model_flops']:.2%} of model flops; model "
            f"throughput {pub['model_throughput_loss']:.1%} below AdamW",
        ]
        if pub["tokens_per_step_matching_share"]:
            lines.append(
                "    the modelled share equals the published one at "
                f"{pub['tokens_per_step_matching_share']:,.0f} tokens per step"
            )
    return lines


def format_report(p: dict[str, Any]) -> str:
    """The human-readable report of a plan dict (as `make_plan` returns it)."""
    return "\n".join(
        [
            *_header_lines(p),
            *_balancing_lines(p),
            *_state_lines(p),
            "",
            *_memory_lines(p),
            *_baseline_lines(p),
            *_comm_lines(p),
            *_tp_lines(p),
            *_overhead_lines(p),
            *(step_time_lines(p["step_time"]) if "step_time" in p else []),
        ]
    )


def plot_plan(p: dict[str, Any], path: str | Path) -> None:
    """Per-rank Newton-Schulz load bars, one panel per balancing, saved to `path`."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(len(BALANCES), 1, figsize=(10, 2.4 * len(BALANCES)), sharex=True)
    for ax, b in zip(axes, BALANCES):
        s = p["balancing"][b]
        mean = s["ns_flops_mean"] or 1.0
        loads = [f / mean for f in s["ns_flops_per_rank"]]
        ax.bar(range(len(loads)), loads, width=0.85, color="tab:blue")
        ax.axhline(1.0, color="k", linestyle="--", linewidth=1, label=f"mean {_si(mean, 'FLOP')}")
        ax.set_ylim(min(0.9, min(loads) - 0.01), max(1.1, max(loads) + 0.01))
        ax.set_title(f"{b}: max/mean = {s['ns_flops_imbalance']:.4f}", fontsize=10)
        ax.set_ylabel("load / mean")
        ax.legend(loc="lower right", fontsize=8)
    axes[-1].set_xlabel(
        "pipeline stage x data-parallel rank" if p["layout"]["pp"] > 1 else "data-parallel rank"
    )
    lay = p["layout"]
    fig.suptitle(
        f"{p['model']['name']}: Newton-Schulz work per rank, DP {lay['dp']} TP {lay['tp']} "
        f"PP {lay['pp']} EP {lay['ep']}"
    )
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


# The file `--plot DIR` writes inside an existing folder DIR.
PLOT_NAME = "plan.png"


def plot_path(text: str) -> Path:
    """The file `--plot` writes: PLOT_NAME inside an existing folder, a name without a suffix
    given matplotlib's .png (which it would add unasked), and one with a suffix matplotlib
    cannot write refused naming the ones it can."""
    from matplotlib.backend_bases import FigureCanvasBase

    path = Path(text)
    if path.is_dir():
        return path / PLOT_NAME
    if not path.suffix:
        return path.with_name(path.name + ".png")
    formats = FigureCanvasBase.get_supported_filetypes()
    if path.suffix[1:].lower() not in formats:
        raise ValueError(
            f"--plot {text}: matplotlib cannot write {path.suffix} files; end the name with "
            f"one of {', '.join('.' + f for f in sorted(formats))}"
        )
    return path


def _cmd(args: argparse.Namespace) -> int:
    if args.plot:
        require_extra("matplotlib", "orthoptim plan --plot")
    try:
        plot = plot_path(args.plot) if args.plot else None
        if args.tokens_per_step is not None and args.tokens_per_step < 1:
            raise ValueError(
                f"--tokens-per-step must be >= 1, got {args.tokens_per_step}; leave it off for "
                "the model file's default"
            )
        desc = hf_model(args.hf_config) if args.hf_config else load_model(args.model)
        hw = load_hardware(args.hardware)
        with as_flags():
            layout = layout_from_args(args)
            check_layout(desc, layout)
        check_stage(args.stage, layout.pp)
        if args.dry_run:
            return _dry_run_cmd(args, desc, hw, layout)
        plan = make_plan(desc, hw, layout)
        plan["adamw_baseline"] = adamw_baseline(desc, hw, layout, plan)
        plan["step_time"] = step_time(desc, hw, layout, plan)
    except (ValueError, FileNotFoundError) as exc:
        print(f"orthoptim plan: error: {exc}", file=sys.stderr)
        return 2
    if plot is not None:
        try:
            plot_plan(plan, plot)
        except OSError as exc:
            print(
                f"orthoptim plan: error: --plot {plot}: cannot write it "
                f"({exc.strerror or exc}); pass a path in a writable folder",
                file=sys.stderr,
            )
            return 2
    commands = layout_commands(args, layout)
    if args.json:
        json.dump({**plan, "commands": commands}, sys.stdout, indent=1)
        print()
    else:
        print(format_report(plan))
        print("\n" + format_commands(commands))
        if plot is not None:
            print(f"\nplot: {plot}")
    return 0


def layout_from_args(args: argparse.Namespace) -> Layout:
    """The `Layout` of `orthoptim plan`'s flags."""
    return Layout(
        dp=args.dp,
        tp=args.tp,
        ep=args.ep,
        pp=args.pp,
        tokens_per_step=args.tokens_per_step or 0,  # 0: the model file's
        ns_steps=args.ns_steps,
        ns_dtype=args.ns_dtype,
        grad_dtype=args.grad_dtype,
        bucket_mb=args.bucket_mb,
        gather_dtype=args.gather_dtype,
        param_dtype=args.param_dtype,
        device=args.device,
        optimizer=args.optimizer,
        fsdp=args.fsdp,
        tp_mode=args.tp_mode,
        ns_batch_mb=args.ns_batch_mb,
        **activation_flags(args),
        state_dtype=args.state_dtype,
        reproducible=args.reproducible,
    )


def activation_flags(args: argparse.Namespace) -> dict[str, Any]:
    """The `Layout` fields of --micro-batch, --seq-len (0: the model's) and --recompute."""
    if args.seq_len is not None and args.seq_len < 1:
        raise ValueError(
            f"--seq-len must be >= 1, got {args.seq_len}; leave it off for the model's"
        )
    return {
        "micro_batch": args.micro_batch,
        "seq_len": args.seq_len or 0,
        "recompute": args.recompute,
    }


def _flag_value(value: Any) -> str:
    return "none" if value is None else f"{value:g}" if isinstance(value, float) else str(value)


def layout_commands(args: argparse.Namespace, layout: Layout) -> dict[str, str | None]:
    """The commands that run `layout` of `args`' model: the dry run of every flag given
    (`dry_run`; with --pp, of `--stage`) and `orthoptim train` on `layout.gpus` ranks with
    its --pp, --dp, --ep and --tp (`train`, None where train does not build the model: the
    shipped descriptions and .json files; `train_flags` are then its layout flags alone)."""
    spec = shlex.quote(args.hf_config or args.model)
    model = f"--hf-config {spec}" if args.hf_config else f"--model {spec}"
    plan = [f"orthoptim plan {model}", f"--hardware {shlex.quote(args.hardware)}"]
    default = Layout(dp=layout.dp)
    for f in fields(Layout):
        value = getattr(layout, f.name)
        flag = "--" + f.name.replace("_", "-")
        if f.name == "dp":
            plan.append(f"{flag} {value}")
        elif f.name in ("fsdp", "reproducible"):
            plan += [flag] if value else []
        elif value != getattr(default, f.name) and not (
            f.name in ("tokens_per_step", "seq_len") and not value
        ):
            plan.append(f"{flag} {_flag_value(value)}")
    plan.append("--dry-run")
    if layout.pp > 1:
        plan.append(f"--stage {args.stage}")
    flags = [
        f"--nproc {layout.gpus}",
        f"--pp {layout.pp}",
        f"--dp {layout.dp}",
        f"--ep {layout.ep}",
        f"--tp {layout.tp}",
        f"--optimizer {layout.optimizer}",
        f"--param-dtype {layout.param_dtype}",
    ] + (["--fsdp"] if layout.fsdp else [])
    flags += [f"--state-dtype {layout.state_dtype}"] if layout.state_dtype != "fp32" else []
    if args.hf_config:
        train_model: str | None = f"--hf-config {spec}"
    elif args.model.startswith(TRAIN_PREFIX):
        train_model = f"--config {shlex.quote(args.model[len(TRAIN_PREFIX) :])}"
    else:
        train_model = None
    return {
        "dry_run": " ".join(plan),
        "train": f"orthoptim train {train_model} {' '.join(flags)}" if train_model else None,
        "train_flags": " ".join(flags),
    }


def format_commands(commands: dict[str, str | None]) -> str:
    """`layout_commands` as the report's closing lines."""
    train = commands["train"] or (
        "orthoptim train builds the built-in GPTs (--model train:NAME) and Hugging Face "
        f"configs (--hf-config), not this model; this layout's train flags: "
        f"{commands['train_flags']}"
    )
    return f"this layout:\n  dry run: {commands['dry_run']}\n  train:   {train}"


def _ranks(values: list[str] | None) -> list[int]:
    """--rank values, repeated or comma lists, as ints."""
    out = []
    for v in values or []:
        for part in v.split(","):
            try:
                out.append(int(part))
            except ValueError:
                raise ValueError(
                    f"--rank takes integers (repeat it or separate by commas), got {part!r}"
                ) from None
    return out


def _batch_mb(text: str) -> float | None:
    """--ns-batch-mb: a number of MiB (`check_layout` wants it > 0), or "none" for no cap."""
    if text.strip().lower() == "none":
        return None
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"takes a number of MiB or 'none', got {text!r}") from None


def _dry_run_cmd(args: argparse.Namespace, desc: Any, hw: Any, layout: Layout) -> int:
    from orthoptim._extras import optional_extra
    from orthoptim.plan.dryrun import dry_run, format_dry_run

    tqdm = (
        None if args.json else optional_extra("tqdm", "orthoptim plan --dry-run: no progress bar")
    )

    def progress(ranks: list[int]) -> Any:
        if tqdm is None:
            return ranks
        return tqdm.tqdm(ranks, desc="simulated ranks", unit="rank", file=sys.stderr)

    result = dry_run(desc, layout, hw, _ranks(args.rank), args.stage, progress)
    commands = layout_commands(args, layout)
    if args.json:
        json.dump({**result, "commands": commands}, sys.stdout, indent=1)
        print()
    else:
        print(format_dry_run(result))
        print("\n" + format_commands(commands))
    ok = not result["group_mismatches"] and all(
        r["comm_matches_expected"] and (r["adamw"] or {}).get("comm_matches_expected", True)
        for r in result["ranks"]
    )
    return 0 if ok else 1


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    """Register `orthoptim plan`."""
    p = subparsers.add_parser(
        "plan",
        help="a real model's optimizer at 8-1024 GPUs: load balance, bytes, memory, TP modes",
        description="Run the layer-wise optimizer's assignment on a real model's matrices and "
        "report per-rank Newton-Schulz work, optimizer state, communication and overhead.",
    )
    which = p.add_mutually_exclusive_group(required=True)
    which.add_argument(
        "--model",
        help=f"one of {', '.join(shipped_models())}; {TRAIN_PREFIX}NAME for `orthoptim train "
        "--config NAME`'s GPT (tiny, small, base, tiny-moe); or a path to a .json description",
    )
    which.add_argument(
        "--hf-config",
        metavar="SPEC",
        help="a Hugging Face config instead of --model: one of `orthoptim train --hf-config`'s "
        "presets (its 256-byte vocabulary), or a config.json or its folder (as written); "
        "needs pip install 'orthoptim[hf]'",
    )
    p.add_argument("--dp", type=int, required=True, help="data-parallel size")
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel size (default 1)")
    p.add_argument(
        "--ep", type=int, default=1, help="expert-parallel size, dividing --dp (default 1)"
    )
    p.add_argument(
        "--pp", type=int, default=1, help="pipeline-parallel stages (contiguous layers; default 1)"
    )
    p.add_argument(
        "--tokens-per-step",
        type=int,
        default=None,
        help="global tokens per optimizer step (default: the model file's)",
    )
    p.add_argument(
        "--micro-batch",
        type=int,
        default=1,
        help="sequences per micro-batch, for the activations (default 1)",
    )
    p.add_argument(
        "--seq-len",
        type=int,
        default=None,
        help="tokens per sequence, for the activations (default: the model file's seq_len)",
    )
    p.add_argument(
        "--recompute",
        default="none",
        choices=RECOMPUTES,
        help="activation recomputation: none, selective (the core attention) or full (each "
        "layer's input kept) (default none)",
    )
    p.add_argument(
        "--hardware",
        default="h200",
        help=f"one of {', '.join(shipped_hardware())}, or a .json file (default h200)",
    )
    p.add_argument(
        "--ns-steps",
        type=int,
        default=NS_STEPS,
        help=f"Newton-Schulz iterations (default {NS_STEPS})",
    )
    p.add_argument(
        "--ns-dtype",
        default="bf16",
        choices=sorted(DTYPE_BYTES),
        help="dtype Newton-Schulz iterates in (default bf16)",
    )
    p.add_argument(
        "--ns-batch-mb",
        type=_batch_mb,
        default=NS_BATCH_MB,
        metavar="MB|none",
        help="the most MiB of float32 matrices one stacked Newton-Schulz call takes "
        "(Muon(ns_batch_mb=...)): a stack of same-shape matrices goes in chunks of that size, "
        f"for the step's transient memory; none: one call per shape (default {NS_BATCH_MB:g})",
    )
    p.add_argument(
        "--device",
        default="cuda",
        choices=("cuda", "cpu"),
        help="where Newton-Schulz runs, for the path each matrix takes (SYRK, Gram form, "
        "plain matmul) and so its cost (default cuda: Triton SYRK)",
    )
    p.add_argument(
        "--grad-dtype",
        default="fp32",
        choices=sorted(DTYPE_BYTES),
        help="dtype gradients are reduced in (default fp32)",
    )
    p.add_argument(
        "--param-dtype",
        default="fp32",
        choices=sorted(DTYPE_BYTES),
        help="dtype every rank holds the parameters in (default fp32); bf16 keeps an fp32 "
        "master copy of what each rank owns, gradients stay --grad-dtype (fp32); with --fsdp "
        "FSDP2's compute dtype, the sharded parameters staying fp32",
    )
    p.add_argument(
        "--state-dtype",
        default="fp32",
        choices=sorted(DTYPE_BYTES),
        help="storage of Muon's momentum and AdamW's moments (default fp32); bf16 halves "
        "them (stochastic rounding, the step in fp32)",
    )
    p.add_argument(
        "--reproducible",
        action="store_true",
        help="LayerwiseDistributedOptimizer(reproducible=True): the same bits at every "
        "power-of-two --dp (ordered all-to-all reduction and its inboxes, AdamW runs on whole "
        "norm blocks, each matrix orthogonalized alone); --tp/--ep/--pp 1, no --fsdp",
    )
    p.add_argument(
        "--bucket-mb",
        type=float,
        default=25.0,
        help="gradient bucket size in MiB, which the assignment balances (default 25)",
    )
    p.add_argument(
        "--gather-dtype",
        default=None,
        choices=sorted(DTYPE_BYTES),
        help="dtype parameters are gathered in (default: --param-dtype); another one holds a "
        "gather buffer in it, and one that rounds makes the owners keep master copies",
    )
    p.add_argument(
        "--optimizer",
        default="muon",
        choices=PLAN_OPTIMIZERS,
        help="the optimizer, for its state and step memory: muon or soap for the matrices "
        "(AdamW for the rest), or adamw for every parameter, sharded element-wise, the "
        "baseline every plan sets its peak against (default muon)",
    )
    p.add_argument(
        "--fsdp",
        action="store_true",
        help="memory per rank of FSDPOptimizer over FSDP2 instead of the layer-wise optimizer",
    )
    p.add_argument(
        "--tp-mode",
        default="auto",
        choices=tp_mode_names(),
        help="the tensor-parallel orthogonalizer's mode, for its step memory (default auto)",
    )
    p.add_argument(
        "--dry-run",
        action="store_true",
        help="run the real model, optimizer, clip and two steps for --rank on fake (meta) "
        "devices under a fake process group of the layout's size: memory by category, "
        "collectives, bytes and host syncs per step, beside the plan's figures",
    )
    p.add_argument(
        "--rank",
        action="append",
        metavar="R[,R...]",
        help="with --dry-run: the ranks (of the stage's dp x tp) to simulate, repeatable or "
        "comma-separated (default 0 and the last)",
    )
    p.add_argument(
        "--stage", type=int, default=0, help="with --dry-run and --pp: the stage the ranks hold"
    )
    p.add_argument("--json", action="store_true", help="print the full plan as JSON")
    p.add_argument(
        "--plot",
        metavar="OUT.png",
        help="write per-rank load bars per balancing (its suffix sets the format; a folder: "
        f"{PLOT_NAME} in it; no suffix: .png)",
    )
    p.set_defaults(func=_cmd)
