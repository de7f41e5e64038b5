"""`orthoptim compare`: train the same model on the same batches with AdamW and with Muon,
then report what Muon buys (steps to AdamW's final validation loss) and what it costs
(throughput, optimizer share of step time, memory, communication).

Writes `report.md`, `loss.png` and `summary.json` under the output folder; each run's own
files (metrics.jsonl, logs, checkpoints) are in a subfolder named after it.

Defaults depend on the machine (`device_defaults`): on CPU the tiny model on 2 gloo ranks, on
CUDA the GPU-sized `base` model on one rank per GPU in bf16.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from orthoptim.train import devices
from orthoptim.train.args import DEFAULT_LR, TrainArgs
from orthoptim.train.devices import plan_ranks
from orthoptim.train.launcher import check_out, launch
from orthoptim.train.runfolder import read_metrics

COMPARED = ("adamw", "muon")
# --sweep: the matrix optimizer's LR grid (AdamW: every parameter; Muon: hidden matrices).
SWEEP_GRID = {"adamw": (1.5e-3, 3e-3, 6e-3), "muon": (0.02, 0.05, 0.1)}
TARGET_STEPS_FRACTION = 0.70
TARGET_THROUGHPUT_RATIO = 0.98


def device_defaults(device_type: str) -> dict[str, Any]:
    """The comparison's default model, batch per rank, steps and evaluation interval on a
    machine whose ranks run on `device_type` ("cpu" or "cuda").

    Newton-Schulz costs ~3·d/B of a step's flops (d: width, B: tokens per step). CPU: the tiny
    model (d = 128) at 64 sequences of 128 per rank (16k tokens a step at 2 ranks) keeps it to
    ~2 %, and 100 steps take minutes. CUDA: the base model (126M parameters, d = 1024, context
    1024) at 32 sequences per rank (32k tokens per rank per step; by estimate, not yet
    measured, ~20 GiB of activations in bf16 with some fp32 ones: far inside one H200); 500
    steps are 16M tokens per GPU, about half an epoch of the stdlib corpus on one GPU.
    Newton-Schulz is then ~9 % of the flops on one GPU and ~1 % at 8, where each rank
    orthogonalizes an eighth of the matrices."""
    if device_type == "cuda":
        return dict(config="base", batch=32, steps=500, eval_every=25)
    return dict(config="tiny", batch=64, steps=100, eval_every=10)


@dataclass
class CompareArgs:
    """Options of one comparison; every run shares everything except the optimizer and LR.

    None (nproc, steps, batch, config, eval_every): the machine's default, filled in by
    `resolve` (`plan_ranks` and `device_defaults`)."""

    nproc: int | None = None
    steps: int | None = None
    batch: int | None = None
    config: str | None = None
    out: str = "runs/compare"
    sweep: bool = False
    data: str | None = None
    seed: int = 0
    eval_every: int | None = None
    adamw_lr: float | None = None
    muon_lr: float | None = None
    precision: str = "auto"
    compile: bool = False
    shared_gpu: bool = False
    progress: bool = True
    # The runs take turns in this many segments (at most one per step), each resuming from
    # its own checkpoint (bitwise the same run), so drifts in the machine's load over minutes
    # hit every run alike: the throughput ratio is measured side by side.
    segments: int = 5

    def resolve(self, gpus: int) -> CompareArgs:
        """A copy with every None replaced by the default of a machine with `gpus` visible GPUs
        (refusing more ranks than GPUs, as `plan_ranks` does)."""
        plan = plan_ranks(self.nproc, gpus, self.shared_gpu)
        defaults = device_defaults(plan.device_type)
        chosen = {k: v for k, v in defaults.items() if getattr(self, k) is None}
        return replace(self, nproc=plan.nproc, **chosen)

    def validate(self) -> None:
        """Refuse option values the comparison cannot honour, naming the flag."""
        if self.segments < 1:
            raise ValueError(f"--segments must be at least 1, got {self.segments}")
        for flag, lr in (("--adamw-lr", self.adamw_lr), ("--muon-lr", self.muon_lr)):
            if lr is not None and not (math.isfinite(lr) and lr > 0):
                raise ValueError(f"{flag} must be a finite number > 0, got {lr}")
        for name in ("adamw", "muon"):
            self.train_args(name, DEFAULT_LR[name], Path(self.out)).validate()

    def train_args(self, optimizer: str, lr: float, out: Path) -> TrainArgs:
        """The run of `optimizer` at `lr` writing to `out` (call `resolve` first)."""
        if None in (self.steps, self.batch, self.config, self.eval_every):
            raise ValueError("CompareArgs.train_args: call resolve() first")
        return TrainArgs(
            optimizer=optimizer,
            config=self.config,
            steps=self.steps,
            batch=self.batch,
            lr=lr,
            eval_every=self.eval_every,
            ckpt_every=self.steps,
            out=str(out),
            seed=self.seed,
            data=self.data,
            precision=self.precision,
            compile=self.compile,
            shared_gpu=self.shared_gpu,
            progress=self.progress,
        )


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
            args.overwrite = i == 0  # compare's own subfolder: a rerun replaces it
            results[k] = launch(args, opts.nproc)
    for result, (_, _, out) in zip(results, runs):
        result["metrics"] = read_metrics(out / "metrics.jsonl")
    return results


def _record(result: dict[str, Any]) -> dict[str, Any]:
    """The summary.json entry of one run."""
    rows = result["metrics"]
    return dict(
        lr=result["args"]["lr"],
        final_val_loss=result["final_val_loss"],
        tokens_per_s=result.get("tokens_per_s"),
        median_step_time_s=result.get("median_step_time_s"),
        median_optimizer_time_s=result.get("median_optimizer_time_s"),
        optimizer_share_of_step_time=result.get("optimizer_share"),
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
    )


def summarize(opts: CompareArgs, results: dict[str, dict[str, Any]], sweep: dict) -> dict[str, Any]:
    """summary.json: both runs, Muon's steps to AdamW's final loss, the throughput ratio."""
    adamw, muon = results["adamw"], results["muon"]
    target = adamw["final_val_loss"]
    reach = steps_to_reach(muon["metrics"], target)
    ratio = (
        muon["tokens_per_s"] / adamw["tokens_per_s"]
        if muon.get("tokens_per_s") and adamw.get("tokens_per_s")
        else None
    )
    fraction = reach / opts.steps if reach is not None else None
    return dict(
        config=opts.config,
        nproc=opts.nproc,
        steps=opts.steps,
        batch_per_rank=opts.batch,
        tokens_per_step=adamw["tokens_per_step"],
        eval_every=opts.eval_every,
        segments=len(segment_ends(opts.steps, opts.segments)),
        device=adamw["device"],
        precision=adamw.get("precision"),
        compiled=adamw.get("compiled", False),
        threads_per_rank=adamw["threads_per_rank"],
        data=opts.data or "python stdlib",
        runs={name: _record(r) for name, r in results.items()},
        adamw_final_val_loss=target,
        muon_final_val_loss=muon["final_val_loss"],
        muon_steps_to_adamw_final_val_loss=reach,
        muon_steps_fraction=fraction,
        tokens_per_s_ratio_muon_over_adamw=ratio,
        targets=dict(
            steps_fraction_at_most=TARGET_STEPS_FRACTION,
            steps_fraction_met=fraction is not None and fraction <= TARGET_STEPS_FRACTION,
            throughput_ratio_at_least=TARGET_THROUGHPUT_RATIO,
            throughput_ratio_met=ratio is not None and ratio >= TARGET_THROUGHPUT_RATIO,
        ),
        sweep=sweep,
    )


def plot(summary: dict[str, Any], path: Path) -> None:
    """Validation loss vs step and vs training wall-clock, one line per optimizer."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_step, ax_time) = plt.subplots(1, 2, figsize=(10, 4), constrained_layout=True)
    for name, run in summary["runs"].items():
        steps, times, losses = zip(*run["val_curve"])
        label = f"{name} (lr {run['lr']:g})"
        ax_step.plot(steps, losses, marker=".", label=label)
        ax_time.plot(times, losses, marker=".", label=label)
    ax_step.axhline(summary["adamw_final_val_loss"], color="gray", lw=0.8, ls="--")
    ax_time.axhline(summary["adamw_final_val_loss"], color="gray", lw=0.8, ls="--")
    ax_step.set_xlabel("step")
    ax_time.set_xlabel("training wall-clock (s, evaluation excluded)")
    for ax in (ax_step, ax_time):
        ax.set_ylabel("validation loss (nats/byte)")
        ax.grid(alpha=0.3)
        ax.legend()
    fig.suptitle(
        f"{summary['config']} GPT, {summary['nproc']} ranks, "
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


def table(summary: dict[str, Any]) -> str:
    """The headline table (markdown)."""
    lines = [
        "| | AdamW | Muon |",
        "| --- | --- | --- |",
    ]
    a, m = summary["runs"]["adamw"], summary["runs"]["muon"]

    def row(label: str, fn: Any) -> None:
        lines.append(f"| {label} | {fn(a)} | {fn(m)} |")

    row("learning rate", lambda r: f"{r['lr']:g}")
    row("final validation loss", lambda r: f"{r['final_val_loss']:.4f}")
    reach = summary["muon_steps_to_adamw_final_val_loss"]
    frac = summary["muon_steps_fraction"]
    lines.append(
        f"| steps to AdamW's final val loss | {summary['steps']} | "
        + (f"{reach} ({frac:.0%})" if reach is not None else "not reached")
        + " |"
    )
    row("tokens/s (median step)", lambda r: f"{r['tokens_per_s']:,.0f}")
    row("optimizer share of step time", lambda r: f"{r['optimizer_share_of_step_time']:.1%}")
    row(
        "peak memory per rank",
        lambda r: " / ".join(_fmt_bytes(b) for b in r["peak_memory_bytes_per_rank"]),
    )
    row(
        "bytes sent per step per rank",
        lambda r: " / ".join(_fmt_bytes(c["sent"]) for c in r["comm_bytes_per_step_per_rank"]),
    )
    ratio = summary["tokens_per_s_ratio_muon_over_adamw"]
    lines.append(f"| tokens/s ratio Muon / AdamW | | {ratio:.3f} |")
    return "\n".join(lines)


def report(summary: dict[str, Any]) -> str:
    """report.md: the table, the targets and what exactly was measured."""
    t = summary["targets"]
    ok = {True: "met", False: "not met"}
    precision = {"bf16": "bf16 autocast", "fp32": "fp32"}.get(summary["precision"], "fp32")
    precision += ", blocks compiled" if summary["compiled"] else ""
    return f"""# orthoptim compare: Muon vs AdamW

{summary["config"]} GPT on {summary["data"]}, {summary["nproc"]} ranks ({summary["device"]},
{summary["threads_per_rank"]} thread(s) per rank, {precision}), {summary["steps"]} steps of
{summary["tokens_per_step"]} tokens (batch {summary["batch_per_rank"]} per rank), the same
batches for both optimizers; validation every {summary["eval_every"]} steps on a fixed set.

{table(summary)}

![validation loss](loss.png)

Targets: Muon reaches AdamW's final validation loss in ≤ {t["steps_fraction_at_most"]:.0%} of
the steps — **{ok[t["steps_fraction_met"]]}**; Muon's tokens/s ≥ {t["throughput_ratio_at_least"]}×
AdamW's — **{ok[t["throughput_ratio_met"]]}**.

What was measured: "steps to AdamW's final val loss" is the first evaluation step (a
multiple of {summary["eval_every"]}) at which Muon's validation loss is at or below AdamW's
final one. Tokens/s is tokens per step over the median step time on rank 0 (forward,
backward and optimizer step, evaluation and checkpoints excluded);
the optimizer share is the summed `optimizer.step()` time (gradient reduction, the update
and the parameter gather) over the summed step time. Peak memory is each rank's maximum
resident set (CPU) or CUDA allocator peak (GPU). Bytes are those counted by
`orthoptim.parallel.collectives` in the last step. The runs took turns in
{summary["segments"]} segment(s), each resumed from its checkpoint, so changes in other load
on the machine over time hit both alike; the first two steps after each start are left out
of the throughput.
"""


def run_compare(opts: CompareArgs) -> dict[str, Any]:
    """Train both optimizers (with --sweep: each over its LR grid, keeping the best final
    validation loss) and write report.md, loss.png and summary.json."""
    opts = opts.resolve(devices.visible_gpus())
    opts.validate()
    out = Path(opts.out)
    check_out(out)
    chosen = {"adamw": opts.adamw_lr, "muon": opts.muon_lr}
    swept = {name for name in COMPARED if opts.sweep and chosen[name] is None}
    runs: list[tuple[str, float, Path]] = []
    for name in COMPARED:
        if name in swept:
            runs += [(name, lr, out / "sweep" / f"{name}_lr{lr:g}") for lr in SWEEP_GRID[name]]
        else:
            lr = chosen[name] if chosen[name] is not None else DEFAULT_LR[name]
            runs.append((name, lr, out / name))
    results: dict[str, dict[str, Any]] = {}
    sweep: dict[str, dict[str, float]] = {}
    for (name, lr, _), r in zip(runs, _run_interleaved(opts, runs)):
        if name in swept:
            sweep.setdefault(name, {})[f"{lr:g}"] = r["final_val_loss"]
        if name not in results or r["final_val_loss"] < results[name]["final_val_loss"]:
            results[name] = r
    summary = summarize(opts, results, sweep)
    (out / "summary.json").write_text(json.dumps(summary, indent=1))
    plot(summary, out / "loss.png")
    (out / "report.md").write_text(report(summary))
    return summary
