"""`orthoptim compare`: train the same model on the same batches with several optimizers
(default AdamW and Muon; `--optimizers adamw,muon,normuon,adamuon` any of `train`'s), then
report what each buys against the baseline (AdamW when compared, else the first): steps to
the baseline's final validation loss, and what it costs (throughput, optimizer share of step
time, memory, communication).

Writes `report.md`, `loss.png`, `telemetry.png` (update/weight RMS per parameter class over
the steps, where the runs logged the loop's telemetry) and `summary.json` under the output
folder; each run's own files (metrics.jsonl, logs, checkpoints) are in a subfolder named after
it.

Defaults depend on the machine (`device_defaults`): on CPU the tiny model on 2 gloo ranks, on
CUDA the GPU-sized `base` model on one rank per GPU in bf16.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Literal

import torch

from orthoptim.optim.registry import MATRIX_OPTIMIZERS
from orthoptim.train import devices
from orthoptim.train.args import DEFAULT_LR, TrainArgs
from orthoptim.train.compare_args import COMPARED as COMPARED
from orthoptim.train.compare_args import CompareArgs as CompareArgs
from orthoptim.train.compare_args import device_defaults as device_defaults
from orthoptim.train.compare_telemetry import (
    plot_telemetry,
    styles,
    telemetry_section,
    telemetry_series,
)
from orthoptim.train.launcher import check_out, launch
from orthoptim.train.loop import COLD_STEPS, peak_memory_bytes, timed_rows, upper_median
from orthoptim.train.runfolder import read_metrics

# --sweep: the matrix optimizer's LR grid (AdamW: every parameter; the others: hidden
# matrices); an optimizer without one here sweeps its default LR × (0.4, 1, 2.5).
SWEEP_GRID = {"adamw": (1.5e-3, 3e-3, 6e-3), "muon": (0.02, 0.05, 0.1)}


def sweep_grid(name: str) -> tuple[float, ...]:
    """The LRs `--sweep` tries for optimizer `name`."""
    lr = DEFAULT_LR[name]
    return SWEEP_GRID.get(name, (0.4 * lr, lr, 2.5 * lr))


# A run's forward/backward part (its step time less the optimizer's part) computes the same
# model on the same batches whatever the optimizer: medians further apart than this fraction
# of the baseline's say that the machine's load, not the optimizer, made that part of the gap.
LOAD_GAP = 0.05

LRSource = Literal["default", "given", "swept"]


def steps_to_reach(rows: list[dict[str, Any]], target: float) -> int | None:
    """First evaluated step whose validation loss is ≤ target (None if never)."""
    for r in rows:
        if "val_loss" in r and r["val_loss"] <= target:
            return int(r["step"])
    return None


def segment_ends(steps: int, segments: int) -> list[int]:
    """The last step of each of `segments` near-equal segments of 1..steps (at most `steps`)."""
    segments = min(segments, steps)
    return [steps * (i + 1) // segments for i in range(segments)]


def _run_interleaved(
    opts: CompareArgs, runs: list[tuple[str, float, Path]]
) -> list[dict[str, Any]]:
    """Train every (optimizer, lr, out) run, taking turns segment by segment (each segment
    after the first resumes from the run's checkpoint; the first replaces a previous
    compare's run in that folder). Returns each run's final result."""
    results: list[dict[str, Any]] = [{} for _ in runs]
    for i, end in enumerate(segment_ends(opts.steps, opts.segments)):
        for k, (optimizer, lr, out) in enumerate(runs):
            args = opts.train_args(optimizer, lr, out)
            args.stop_after = end if end < opts.steps else None
            args.resume = i > 0
            args.announce = i == 0  # the routing table once per run, no "resuming from"
            args.overwrite = i == 0  # compare's own subfolder: a rerun replaces it
            results[k] = launch(args, opts.nproc)
    for result, (_, _, out) in zip(results, runs):
        result["metrics"] = read_metrics(out / "metrics.jsonl")
    return results


def step_ranges(steps: list[int]) -> list[list[int]]:
    """[first, last] of each stretch of consecutive step numbers."""
    ranges: list[list[int]] = []
    for s in sorted(steps):
        if ranges and s == ranges[-1][1] + 1:
            ranges[-1][1] = s
        else:
            ranges.append([s, s])
    return ranges


def _record(result: dict[str, Any], lr_source: LRSource) -> dict[str, Any]:
    """The summary.json entry of one run; `lr_source` says how its LR was chosen."""
    rows = result["metrics"]
    timed = timed_rows(rows)
    args = TrainArgs.from_dict(result["args"])
    return dict(
        lr=result["args"]["lr"],
        lr_source=lr_source,
        # the LR of embeddings, head and gains next to a matrix optimizer (never swept)
        adamw_part_lr=None if args.optimizer == "adamw" else args.embed_lr,
        final_val_loss=result["final_val_loss"],
        tokens_per_s=result.get("tokens_per_s"),
        median_step_time_s=result.get("median_step_time_s"),
        median_optimizer_time_s=result.get("median_optimizer_time_s"),
        median_forward_backward_time_s=upper_median(
            [r["step_time_s"] - r["opt_time_s"] for r in timed]
        ),
        optimizer_share_of_step_time=result.get("optimizer_share"),
        timed_steps=step_ranges([int(r["step"]) for r in timed]),
        train_time_s=rows[-1]["train_time_s"] if rows else None,
        peak_memory_bytes_per_rank=result["peak_memory_bytes_per_rank"],
        comm_bytes_per_step_per_rank=[
            dict(sent=s, received=r)
            for s, r in zip(
                result["comm_sent_bytes_per_step_per_rank"],
                result["comm_received_bytes_per_step_per_rank"],
            )
        ],
        optimizer_class=result["optimizer_class"],
        val_curve=[(r["step"], r["train_time_s"], r["val_loss"]) for r in rows if "val_loss" in r],
        # {class: [[step, update RMS / weight RMS], ...]} of the rows with telemetry
        telemetry=telemetry_series(rows),
    )


def _versus(
    run: dict[str, Any],
    base: dict[str, Any],
    steps: int,
    target: float,
    rows: list[dict[str, Any]],
) -> dict[str, Any]:
    """One run against the baseline: steps to the baseline's final validation loss, the
    tokens/s ratio, and how far apart their forward/backward parts are (`machine_load`: further
    than LOAD_GAP, which the optimizer cannot explain)."""
    reach = steps_to_reach(rows, target)
    ratio = (
        run["tokens_per_s"] / base["tokens_per_s"]
        if run.get("tokens_per_s") and base.get("tokens_per_s")
        else None
    )
    fb, fb_base = run["median_forward_backward_time_s"], base["median_forward_backward_time_s"]
    opt, opt_base = run["median_optimizer_time_s"], base["median_optimizer_time_s"]
    fb_ratio = fb / fb_base if fb and fb_base else None
    load = fb_ratio is not None and abs(fb_ratio - 1) > LOAD_GAP
    return dict(
        steps_to_baseline_final_val_loss=reach,
        steps_fraction=reach / steps if reach is not None else None,
        tokens_per_s_ratio=ratio,
        forward_backward_time_ratio=fb_ratio,
        machine_load=load,
        # the tokens/s ratio had this run's forward/backward taken the baseline's time
        tokens_per_s_ratio_at_baseline_forward_backward=(
            (fb_base + opt_base) / (fb_base + opt) if load and None not in (opt, opt_base) else None
        ),
        same_comm_bytes=run["comm_bytes_per_step_per_rank"] == base["comm_bytes_per_step_per_rank"],
    )


def _layout_words(layout: dict[str, int]) -> str:
    """ " as PP 2 × DP 2, EP 2" of a pipelined or expert-parallel layout, else nothing."""
    if layout["pp"] == 1 and layout["ep"] == 1:
        return ""
    stages = f"PP {layout['pp']} × " if layout["pp"] > 1 else ""
    return f" as {stages}DP {layout['dp']}" + (f", EP {layout['ep']}" if layout["ep"] > 1 else "")


def summarize(
    opts: CompareArgs,
    results: dict[str, dict[str, Any]],
    sweep: dict[str, dict[str, float]],
    launcher_peak_rss_bytes: int | None = None,
) -> dict[str, Any]:
    """summary.json: every run (its LR and how it was chosen, its measured figures), and each
    optimizer against the baseline (steps to its final validation loss, throughput ratio,
    whether machine load shows in the wall-clock gap); Muon against AdamW under the earlier
    key names. `sweep`: {optimizer: {lr: final validation loss}} of the swept ones;
    `launcher_peak_rss_bytes`: this compare process's own peak RSS, where the ranks' peaks
    start on Linux."""
    base_name = opts.baseline
    base = results[base_name]
    target = base["final_val_loss"]
    runs = {}
    for name, r in results.items():
        source: LRSource = (
            "swept" if name in sweep else "given" if opts.chosen_lr(name) is not None else "default"
        )
        runs[name] = _record(r, source)
    versus = {
        name: _versus(runs[name], runs[base_name], opts.steps, target, r["metrics"])
        for name, r in results.items()
        if name != base_name
    }
    ends = segment_ends(opts.steps, opts.segments)
    layout = opts.layout()
    cuda = str(base["device"]).startswith("cuda")
    eval_batches = base["args"]["eval_batches"]
    summary = dict(
        config=opts.config,
        nproc=opts.nproc,
        layout=layout,
        steps=opts.steps,
        batch_per_rank=opts.batch,
        tokens_per_step=base["tokens_per_step"],
        eval_every=opts.eval_every,
        eval_batches=eval_batches,
        # one evaluation batch per data-parallel rank (a pipeline's stages share it)
        eval_tokens=eval_batches * base["tokens_per_step"] // layout["dp"],
        segments=len(ends),
        # each segment starts the ranks afresh: the memory peaks are the last segment's
        last_segment_steps=[ends[-2] + 1 if len(ends) > 1 else 1, ends[-1]],
        device=base["device"],
        precision=base.get("precision"),
        state_dtype=opts.state_dtype,
        compiled=base.get("compiled", False),
        threads_per_rank=base["threads_per_rank"],
        data=opts.data or "python stdlib",
        optimizers=list(opts.optimizers),
        baseline=base_name,
        baseline_final_val_loss=target,
        peak_memory_measure="cuda_max_memory_allocated" if cuda else "max_rss",
        launcher_peak_rss_bytes=launcher_peak_rss_bytes,
        load_gap=LOAD_GAP,
        runs=runs,
        versus_baseline=versus,
        sweep=sweep,
    )
    if base_name == "adamw" and "muon" in versus:
        muon = versus["muon"]
        summary.update(
            adamw_final_val_loss=target,
            muon_final_val_loss=results["muon"]["final_val_loss"],
            muon_steps_to_adamw_final_val_loss=muon["steps_to_baseline_final_val_loss"],
            muon_steps_fraction=muon["steps_fraction"],
            tokens_per_s_ratio_muon_over_adamw=muon["tokens_per_s_ratio"],
        )
    return summary


def plot(summary: dict[str, Any], path: Path) -> None:
    """Validation loss vs step and vs training wall-clock, one line per optimizer."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_step, ax_time) = plt.subplots(1, 2, figsize=(10, 4), constrained_layout=True)
    style = styles(summary)
    for name, run in summary["runs"].items():
        steps, times, losses = zip(*run["val_curve"])
        label = f"{name} (lr {run['lr']:g})"
        ax_step.plot(steps, losses, ms=4, label=label, **style[name])
        ax_time.plot(times, losses, ms=4, label=label, **style[name])
    ax_step.axhline(summary["baseline_final_val_loss"], color="gray", lw=0.8, ls="--")
    ax_time.axhline(summary["baseline_final_val_loss"], color="gray", lw=0.8, ls="--")
    ax_step.set_xlabel("step")
    ax_time.set_xlabel("training wall-clock on rank 0 (s, evaluation excluded)")
    for ax in (ax_step, ax_time):
        ax.set_ylabel("validation loss (nats/byte)")
        ax.grid(alpha=0.3)
        ax.legend()
    fig.suptitle(
        f"{summary['config']} GPT, {summary['nproc']} ranks{_layout_words(summary['layout'])}, "
        f"{summary['tokens_per_step']} tokens/step, {summary['data']}"
    )
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _fmt_bytes(b: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(b) < 1024 or unit == "GiB":
            return f"{b:.1f} {unit}" if unit != "B" else f"{b:.0f} B"
        b /= 1024
    return f"{b:.1f} GiB"


def _fmt_s(seconds: float | None) -> str:
    return f"{seconds:.3g} s" if seconds is not None else "n/a"


# each optimizer as the report writes it: its class's name (a newly registered one too)
NAMES = {"adamw": "AdamW", **{n: cls.__name__ for n, cls in MATRIX_OPTIMIZERS.items()}}


def _name(n: str) -> str:
    return NAMES.get(n, n)


def _order(summary: dict[str, Any]) -> list[str]:
    """The runs' names, the baseline first."""
    base = summary["baseline"]
    return [base, *(n for n in summary["runs"] if n != base)]


def _ranks(nproc: int) -> str:
    """Which rank each figure of a per-rank cell is."""
    return " / ".join(f"rank {r}" for r in range(nproc)) if nproc <= 4 else f"ranks 0…{nproc - 1}"


def memory_label(summary: dict[str, Any]) -> str:
    """The table's memory row: what is measured, and for which rank(s)."""
    what = (
        "peak CUDA memory allocated" if summary["peak_memory_measure"] != "max_rss" else "peak RSS"
    )
    if summary["nproc"] == 1:
        return f"{what} of the compare process (its 1 rank)"
    return f"{what} of each rank's process ({_ranks(summary['nproc'])})"


def table(summary: dict[str, Any]) -> str:
    """The headline table (markdown): one column per optimizer, the baseline first."""
    base = summary["baseline"]
    names = _order(summary)
    runs = [summary["runs"][n] for n in names]
    versus = summary["versus_baseline"]
    lines = [
        "| | " + " | ".join(_name(n) for n in names) + " |",
        "| --- |" + " --- |" * len(names),
    ]

    def row(label: str, cells: list[str]) -> None:
        lines.append(f"| {label} | " + " | ".join(cells) + " |")

    def each(fn: Any) -> list[str]:
        return [fn(r) for r in runs]

    def reached(n: str) -> str:
        v = versus[n]
        reach, frac = v["steps_to_baseline_final_val_loss"], v["steps_fraction"]
        return f"{reach} ({frac:.0%})" if reach is not None else "not reached"

    row("learning rate (how chosen)", each(lambda r: f"{r['lr']:g} ({r['lr_source']})"))
    row("final validation loss (nats/byte)", each(lambda r: f"{r['final_val_loss']:.4f}"))
    row(
        f"steps to {_name(base)}'s final val loss",
        [str(summary["steps"]), *(reached(n) for n in names[1:])],
    )
    row("tokens/s (rank 0's median step)", each(lambda r: f"{r['tokens_per_s']:,.0f}"))
    row(
        "median step: forward/backward + optimizer (rank 0)",
        each(
            lambda r: (
                f"{_fmt_s(r['median_forward_backward_time_s'])} + "
                f"{_fmt_s(r['median_optimizer_time_s'])}"
            )
        ),
    )
    row(
        "optimizer share of step time (rank 0)",
        each(lambda r: f"{r['optimizer_share_of_step_time']:.1%}"),
    )
    row("training wall-clock (rank 0)", each(lambda r: _fmt_s(r["train_time_s"])))
    row(
        memory_label(summary),
        each(lambda r: " / ".join(_fmt_bytes(b) for b in r["peak_memory_bytes_per_rank"])),
    )
    row(
        f"bytes the optimizer sent in the last step ({_ranks(summary['nproc'])})",
        each(
            lambda r: " / ".join(_fmt_bytes(c["sent"]) for c in r["comm_bytes_per_step_per_rank"])
        ),
    )
    row(
        f"tokens/s ratio to {_name(base)}",
        ["1", *(_ratio(versus[n]["tokens_per_s_ratio"]) for n in names[1:])],
    )
    return "\n".join(lines)


def _ratio(value: float | None) -> str:
    return f"{value:.3f}" if value is not None else "n/a"


def lr_lines(summary: dict[str, Any]) -> str:
    """Which LR(s) each optimizer ran at and how they were chosen (default, given, or the
    best of a sweep, whose grid and losses are listed), and whether any sweep ran."""
    lines = []
    for name in _order(summary):
        run = summary["runs"][name]
        if name == "adamw":
            lrs = f"lr {run['lr']:g} for every parameter"
        else:
            lrs = (
                f"lr {run['lr']:g} for the hidden matrices, AdamW at lr "
                f"{run['adamw_part_lr']:g} for embeddings, head and gains (not swept)"
            )
        if run["lr_source"] == "swept":
            grid = summary["sweep"][name]
            tried = ", ".join(f"{lr} → {grid[lr]:.4f}" for lr in sorted(grid, key=float))
            how = (
                f"the best of a sweep over {len(grid)} LRs (final validation loss: {tried}); "
                f"the table's column is the lr {run['lr']:g} run"
            )
            if run["lr"] in (min(map(float, grid)), max(map(float, grid))):
                how += "; the best is at the grid's edge, so a wider grid may find a better one"
        elif run["lr_source"] == "given":
            how = "as given on the command line, one run, not swept"
        else:
            how = "its default, one run, not swept nor tuned for this run"
        lines.append(f"- **{_name(name)}**: {lrs}; {how}.")
    if not summary["sweep"]:
        lines.append(
            "\nEach optimizer ran at a single LR and none was swept, so part of a gap between "
            "them may be an LR that suits one better. `orthoptim compare --sweep` first runs "
            "every optimizer not given an LR over a small grid and keeps its best. (The defaults "
            "come from short sweeps on the tiny config: `orthoptim.train.args.DEFAULT_LR`.)"
        )
    else:
        lines.append(
            "\nA sweep keeps the LR with the lowest final validation loss on the same validation "
            "batches the table reports, so a swept run's loss is a little optimistic next to a "
            "single run's. The runs of every LR are under `sweep/`."
        )
    return "\n".join(lines)


def load_notes(summary: dict[str, Any]) -> str:
    """A note for each run whose forward/backward time, the same computation whatever the
    optimizer, differs from the baseline's by more than LOAD_GAP: that part of the wall-clock
    gap is the machine's load. Without any, one line saying they agree."""
    base = summary["baseline"]
    b = summary["runs"][base]
    if summary["segments"] > 1:
        how = (
            f"took turns in {summary['segments']} segments (which evens out drifts in load "
            "over minutes, but not load that comes and goes within a segment)"
        )
    else:
        how = "ran one after the other (`--segments 1`)"
    notes = []
    for name, v in summary["versus_baseline"].items():
        if not v["machine_load"]:
            continue
        r, fb_ratio = summary["runs"][name], v["forward_backward_time_ratio"]
        longer = f"{fb_ratio - 1:.0%} longer" if fb_ratio > 1 else f"{1 - fb_ratio:.0%} less"
        same = (
            "and the optimizer sent the same bytes"
            if v["same_comm_bytes"]
            else "(their optimizers sent different bytes, and the wait for the parameter "
            "gathers falls in the forward, so a part of it may be that)"
        )
        est = v["tokens_per_s_ratio_at_baseline_forward_backward"]
        notes.append(
            f"**Machine load:** {_name(name)}'s forward/backward took {longer} than "
            f"{_name(base)}'s (median {_fmt_s(r['median_forward_backward_time_s'])} against "
            f"{_fmt_s(b['median_forward_backward_time_s'])} a step), although both compute the "
            f"same model on the same batches {same}. That difference is other load on the "
            f"machine while the runs {how}, not the optimizer: it is in {_name(name)}'s "
            f"tokens/s ratio ({_ratio(v['tokens_per_s_ratio'])}) and its curve in the "
            "wall-clock panel."
            + (
                f" With {_name(base)}'s forward/backward time and its own optimizer part it "
                f"would run at about {est:.3f}× {_name(base)}'s tokens/s."
                if est is not None
                else ""
            )
        )
    if notes:
        return "\n\n".join(notes)
    if not summary["versus_baseline"] or b["median_forward_backward_time_s"] is None:
        return ""
    return (
        f"The forward/backward times of the runs agree within {summary['load_gap']:.0%} (the "
        "same model on the same batches), so the machine's load did not separate them: the "
        "wall-clock panel's gaps come from the optimizers' parts of the step and the steps "
        "each needs."
    )


def verdicts(summary: dict[str, Any]) -> str:
    """One line per optimizer: how it did against the baseline, in measured figures."""
    base = _name(summary["baseline"])
    lines = []
    for name, v in summary["versus_baseline"].items():
        run = summary["runs"][name]
        if v["steps_to_baseline_final_val_loss"] is None:
            speed = f"did not reach {base}'s final validation loss in {summary['steps']} steps"
        else:
            speed = (
                f"reached {base}'s final validation loss at step "
                f"{v['steps_to_baseline_final_val_loss']} ({v['steps_fraction']:.0%} of the "
                f"{summary['steps']} steps)"
            )
        ratio = v["tokens_per_s_ratio"]
        cost = (
            f"at {ratio:.3f}× {base}'s tokens/s" if ratio is not None else "throughput not measured"
        )
        lines.append(
            f"- **{_name(name)}** (lr {run['lr']:g}, final validation loss "
            f"{run['final_val_loss']:.4f}) {speed}, {cost}."
        )
    return "\n".join(lines)


def _memory_definition(summary: dict[str, Any]) -> tuple[str, str]:
    """The peak-memory figure's definition: what it measures, and over which process and
    steps (with the launcher's high-water mark where it may show)."""
    if summary["peak_memory_measure"] == "max_rss":
        memory = (
            "the high-water mark of the process's resident set (`getrusage` `ru_maxrss`): "
            "everything the process held in RAM at its peak: Python and torch themselves, the "
            "model, gradients, optimizer state, activations, communication buffers and the "
            "checkpoint being written"
        )
    else:
        memory = (
            "`torch.cuda.max_memory_allocated`: the peak of the bytes held by tensors on the "
            "rank's GPU (parameters, gradients, optimizer state, activations, communication "
            "buffers), not what the caching allocator reserved beyond them nor the CUDA context"
        )
    nproc = summary["nproc"]
    first, last = summary["last_segment_steps"]
    if nproc == 1:
        memory_scope = (
            "With one rank the run executes inside the `orthoptim compare` process itself, so "
            "this is that process's peak over this run and every run before it: a later "
            "column cannot read lower than an earlier one."
        )
    else:
        memory_scope = (
            f"One figure per rank ({_ranks(nproc)}), not summed. Each segment starts the ranks "
            f"afresh, so it is the peak of the last segment (steps {first}–{last}, the final "
            "evaluation and checkpoint included)."
        )
        launcher = summary.get("launcher_peak_rss_bytes")
        if summary["peak_memory_measure"] == "max_rss" and launcher is not None:
            peaks = [
                b for n in summary["runs"] for b in summary["runs"][n]["peak_memory_bytes_per_rank"]
            ]
            memory_scope += (
                " On Linux a started process's high-water mark begins at its launcher's (this "
                f"compare process peaked at {_fmt_bytes(launcher)}), so a figure at or below "
                "that may be the launcher's, not the rank's: "
                + (
                    "here every figure is above it, so they are the ranks' own."
                    if min(peaks) > launcher
                    else "here some are, so read those as at most that."
                )
            )
    return memory, memory_scope


def definitions(summary: dict[str, Any]) -> str:
    """What each figure of the table means and how the code measured it."""
    base = _name(summary["baseline"])
    nproc, steps = summary["nproc"], summary["steps"]
    timed = ", ".join(
        f"{a}–{b}" if a != b else f"{a}"
        for a, b in summary["runs"][summary["baseline"]]["timed_steps"]
    )
    comm = (
        " (it waits there for the gradient reductions that backward launched)" if nproc > 1 else ""
    )
    gather = ", which launches the all-gather of the updated parameters" if nproc > 1 else ""
    gather_wait = (
        ", including the wait at the start of forward for the previous step's parameter gathers"
        if nproc > 1
        else ""
    )
    memory, memory_scope = _memory_definition(summary)
    if summary["segments"] > 1:
        turns = (
            f"The runs took turns in {summary['segments']} segments, each resuming from its "
            "checkpoint (bit-identical to an uninterrupted run), so slow drifts in other load "
            "on the machine hit every run alike."
        )
    else:
        turns = "The runs ran one after the other (`--segments 1`)."
    warm = "first allocations and collectives" + (
        ", and compilation" if summary["compiled"] else ""
    )
    items = [
        f"**final validation loss**: the mean cross-entropy of the next byte, in nats per byte, "
        f"over {summary['eval_batches']} fixed batches of the held-out validation split "
        f"({summary['eval_tokens']:,} bytes, split across the ranks), evaluated after the last "
        "step; the same batches at every evaluation and for every optimizer.",
        f"**steps to {base}'s final val loss**: the first evaluation (every "
        f"{summary['eval_every']} steps) at which the validation loss is at or below {base}'s "
        f'final one, and its share of the {steps} steps; "not reached" if no evaluation got '
        "there.",
        "**step time**: on rank 0, from the start of forward to the end of the optimizer's "
        "part; fetching the batch, evaluation and checkpoints are not in it. The *optimizer "
        f"part* runs from the end of backward: gradient clipping{comm}, `optimizer.step()`"
        f"{gather}, `zero_grad`, and QK-clip where the model has it. The *forward/backward* "
        f"part is the rest{gather_wait}.",
        f"**tokens/s**: the {summary['tokens_per_step']:,} tokens of a step (all ranks "
        f"together) over rank 0's median step time, taken over steps {timed}: the first "
        f"{COLD_STEPS} steps after each start of the ranks are left out as warm-up ({warm}). "
        "The median step row gives the medians of its two parts over the same steps "
        "(medians, so they need not add up to the step's).",
        "**optimizer share of step time**: the optimizer part's summed time over the summed "
        "step time, over the same steps, on rank 0.",
        f"**training wall-clock**: the sum of rank 0's step times over all {steps} steps "
        "(warm-up included, evaluation and checkpoints not): the x-axis of the right-hand "
        "panel.",
        f"**{memory_label(summary)}**: {memory}. {memory_scope} The optimizer state alone is "
        "not measured here (`orthoptim plan` estimates it per rank).",
        "**bytes the optimizer sent**: what each rank's optimizer sent in the last step "
        "through `orthoptim.collectives` (gradient reduction, parameter gather, the clipping "
        "and agreement all-reduces); the loop's own metric reductions are not counted.",
        f"**tokens/s ratio**: a run's tokens/s over {base}'s.",
    ]
    return "\n".join(f"- {item}" for item in items) + f"\n\n{turns}"


def report(summary: dict[str, Any]) -> str:
    """report.md: the setup, each optimizer's LRs, the table and figure (with a note where
    machine load shows in the wall-clock gap), how each did, and what each figure means."""
    precision = {"bf16": "bf16 autocast", "fp32": "fp32"}.get(summary["precision"], "fp32")
    precision += ", blocks compiled" if summary["compiled"] else ""
    precision += ", bf16 optimizer state" if summary.get("state_dtype") == "bf16" else ""
    names = [_name(n) for n in summary["optimizers"]]
    base = _name(summary["baseline"])
    notes = load_notes(summary)
    return f"""# orthoptim compare: {" vs ".join(names)}

{summary["config"]} GPT on {summary["data"]}, {summary["nproc"]} ranks\
{_layout_words(summary["layout"])} ({summary["device"]}, \
{summary["threads_per_rank"]} thread(s) per rank, {precision}), {summary["steps"]} steps of \
{summary["tokens_per_step"]:,} tokens (batch {summary["batch_per_rank"]} per rank), the same \
batches for every optimizer; validation every {summary["eval_every"]} steps on a fixed set.

## Learning rates

{lr_lines(summary)}

## Results

{table(summary)}

![validation loss](loss.png)
{f"{chr(10)}{notes}{chr(10)}" if notes else ""}
How each did against {base} (its final validation loss {summary["baseline_final_val_loss"]:.4f}):

{verdicts(summary)}

## Update size per parameter class

{telemetry_section(summary, {n: _name(n) for n in _order(summary)})}

## What the figures are

{definitions(summary)}
"""


def written(out: Path) -> list[str]:
    """The files a compare wrote under `out` (telemetry.png only where a run logged
    telemetry), in the order its last line names them."""
    names = ("report.md", "loss.png", "telemetry.png", "summary.json")
    return [name for name in names if (out / name).exists()]


def run_compare(opts: CompareArgs) -> dict[str, Any]:
    """Train every compared optimizer (with --sweep: each over its LR grid, keeping the best
    final validation loss) and write report.md, loss.png, telemetry.png (where the runs
    logged telemetry) and summary.json."""
    opts = opts.resolve(devices.visible_gpus())
    opts.validate()
    out = Path(opts.out)
    check_out(out)
    swept = {n for n in opts.optimizers if opts.sweep and opts.chosen_lr(n) is None}
    runs: list[tuple[str, float, Path]] = []
    for name in opts.optimizers:
        if name in swept:
            runs += [(name, lr, out / "sweep" / f"{name}_lr{lr:g}") for lr in sweep_grid(name)]
        else:
            lr = opts.chosen_lr(name)
            runs.append((name, lr if lr is not None else DEFAULT_LR[name], out / name))
    results: dict[str, dict[str, Any]] = {}
    sweep: dict[str, dict[str, float]] = {}
    for (name, lr, _), r in zip(runs, _run_interleaved(opts, runs)):
        if name in swept:
            sweep.setdefault(name, {})[f"{lr:g}"] = r["final_val_loss"]
        if name not in results or r["final_val_loss"] < results[name]["final_val_loss"]:
            results[name] = r
    summary = summarize(opts, results, sweep, peak_memory_bytes(torch.device("cpu")))
    (out / "summary.json").write_text(json.dumps(summary, indent=1))
    plot(summary, out / "loss.png")
    if not plot_telemetry(summary, out / "telemetry.png"):
        # a previous compare's figure in this folder would not be this one's
        (out / "telemetry.png").unlink(missing_ok=True)
    (out / "report.md").write_text(report(summary))
    return summary
