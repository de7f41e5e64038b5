"""`orthoptim compare`: train the same model on the same batches with several optimizers
(default AdamW and Muon; `--optimizers adamw,muon,normuon,adamuon` any of `train`'s), then
report what each buys against the baseline (AdamW when compared, else the first): steps to
the baseline's final validation loss, and what it costs (throughput, optimizer share of step
time, memory, communication).

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

from orthoptim.optim.registry import MATRIX_OPTIMIZERS
from orthoptim.train import devices
from orthoptim.train.args import DEFAULT_LR, OPTIMIZERS, TrainArgs
from orthoptim.train.devices import plan_ranks
from orthoptim.train.launcher import check_out, launch
from orthoptim.train.runfolder import read_metrics

COMPARED = ("adamw", "muon")
# --sweep: the matrix optimizer's LR grid (AdamW: every parameter; the others: hidden
# matrices); an optimizer without one here sweeps its default LR × (0.4, 1, 2.5).
SWEEP_GRID = {"adamw": (1.5e-3, 3e-3, 6e-3), "muon": (0.02, 0.05, 0.1)}


def sweep_grid(name: str) -> tuple[float, ...]:
    """The LRs `--sweep` tries for optimizer `name`."""
    lr = DEFAULT_LR[name]
    return SWEEP_GRID.get(name, (0.4 * lr, lr, 2.5 * lr))


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

    optimizers: tuple[str, ...] = COMPARED
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
    lrs: dict[str, float] | None = None  # --lr NAME=LR: any compared optimizer's LR
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
        unknown = [n for n in self.optimizers if n not in OPTIMIZERS]
        if unknown:
            raise ValueError(
                f"--optimizers: {', '.join(map(repr, unknown))} not among {', '.join(OPTIMIZERS)}"
            )
        if len(set(self.optimizers)) != len(self.optimizers) or len(self.optimizers) < 2:
            raise ValueError(
                "--optimizers must name at least two different optimizers, got "
                f"{','.join(self.optimizers)}"
            )
        for name in self.lrs or {}:
            if name not in self.optimizers:
                raise ValueError(f"--lr {name}=...: {name!r} is not among --optimizers")
        given = [("--adamw-lr", self.adamw_lr), ("--muon-lr", self.muon_lr)]
        given += [(f"--lr {n}=", lr) for n, lr in (self.lrs or {}).items()]
        for flag, lr in given:
            if lr is not None and not (math.isfinite(lr) and lr > 0):
                raise ValueError(f"{flag} must be a finite number > 0, got {lr}")
        for name in self.optimizers:
            self.train_args(name, DEFAULT_LR[name], Path(self.out)).validate()

    @property
    def baseline(self) -> str:
        """The optimizer every other is measured against: AdamW when compared, else the first."""
        return "adamw" if "adamw" in self.optimizers else self.optimizers[0]

    def chosen_lr(self, name: str) -> float | None:
        """The LR given for optimizer `name` (None: its default, or its sweep)."""
        given = {"adamw": self.adamw_lr, "muon": self.muon_lr, **(self.lrs or {})}
        return given.get(name)

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
    """summary.json: every run, and each optimizer against the baseline (steps to its final
    validation loss, throughput ratio); Muon against AdamW under the earlier key names."""
    base_name = opts.baseline
    base = results[base_name]
    target = base["final_val_loss"]
    versus = {}
    for name, r in results.items():
        if name == base_name:
            continue
        reach = steps_to_reach(r["metrics"], target)
        ratio = (
            r["tokens_per_s"] / base["tokens_per_s"]
            if r.get("tokens_per_s") and base.get("tokens_per_s")
            else None
        )
        fraction = reach / opts.steps if reach is not None else None
        versus[name] = dict(
            steps_to_baseline_final_val_loss=reach,
            steps_fraction=fraction,
            tokens_per_s_ratio=ratio,
            steps_fraction_met=fraction is not None and fraction <= TARGET_STEPS_FRACTION,
            throughput_ratio_met=ratio is not None and ratio >= TARGET_THROUGHPUT_RATIO,
        )
    summary = dict(
        config=opts.config,
        nproc=opts.nproc,
        steps=opts.steps,
        batch_per_rank=opts.batch,
        tokens_per_step=base["tokens_per_step"],
        eval_every=opts.eval_every,
        segments=len(segment_ends(opts.steps, opts.segments)),
        device=base["device"],
        precision=base.get("precision"),
        compiled=base.get("compiled", False),
        threads_per_rank=base["threads_per_rank"],
        data=opts.data or "python stdlib",
        optimizers=list(opts.optimizers),
        baseline=base_name,
        baseline_final_val_loss=target,
        runs={name: _record(r) for name, r in results.items()},
        versus_baseline=versus,
        targets=dict(
            steps_fraction_at_most=TARGET_STEPS_FRACTION,
            throughput_ratio_at_least=TARGET_THROUGHPUT_RATIO,
        ),
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
        summary["targets"].update(
            steps_fraction_met=muon["steps_fraction_met"],
            throughput_ratio_met=muon["throughput_ratio_met"],
        )
    return summary


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
    ax_step.axhline(summary["baseline_final_val_loss"], color="gray", lw=0.8, ls="--")
    ax_time.axhline(summary["baseline_final_val_loss"], color="gray", lw=0.8, ls="--")
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


# each optimizer as the report writes it: its class's name (a newly registered one too)
NAMES = {"adamw": "AdamW", **{n: cls.__name__ for n, cls in MATRIX_OPTIMIZERS.items()}}


def table(summary: dict[str, Any]) -> str:
    """The headline table (markdown): one column per optimizer, the baseline first."""
    base = summary["baseline"]
    names = [base, *(n for n in summary["runs"] if n != base)]
    runs = [summary["runs"][n] for n in names]
    versus = summary["versus_baseline"]
    lines = [
        "| | " + " | ".join(NAMES.get(n, n) for n in names) + " |",
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

    row("learning rate", each(lambda r: f"{r['lr']:g}"))
    row("final validation loss", each(lambda r: f"{r['final_val_loss']:.4f}"))
    row(
        f"steps to {NAMES.get(base, base)}'s final val loss",
        [str(summary["steps"]), *(reached(n) for n in names[1:])],
    )
    row("tokens/s (median step)", each(lambda r: f"{r['tokens_per_s']:,.0f}"))
    row("optimizer share of step time", each(lambda r: f"{r['optimizer_share_of_step_time']:.1%}"))
    row(
        "peak memory per rank",
        each(lambda r: " / ".join(_fmt_bytes(b) for b in r["peak_memory_bytes_per_rank"])),
    )
    sent = "comm_bytes_per_step_per_rank"
    row(
        "bytes sent per step per rank",
        each(lambda r: " / ".join(_fmt_bytes(c["sent"]) for c in r[sent])),
    )
    row(
        f"tokens/s ratio to {NAMES.get(base, base)}",
        ["1", *(_ratio(versus[n]["tokens_per_s_ratio"]) for n in names[1:])],
    )
    return "\n".join(lines)


def _ratio(value: float | None) -> str:
    return f"{value:.3f}" if value is not None else "n/a"


def verdicts(summary: dict[str, Any]) -> str:
    """One line per optimizer: how it did against the baseline and the targets."""
    t = summary["targets"]
    base = NAMES.get(summary["baseline"], summary["baseline"])
    lines = []
    for name, v in summary["versus_baseline"].items():
        run = summary["runs"][name]
        label = NAMES.get(name, name)
        if v["steps_to_baseline_final_val_loss"] is None:
            speed = f"did not reach {base}'s final validation loss in {summary['steps']} steps"
        else:
            speed = (
                f"reached {base}'s final validation loss at step "
                f"{v['steps_to_baseline_final_val_loss']} ({v['steps_fraction']:.0%} of the steps; "
                f"target ≤ {t['steps_fraction_at_most']:.0%}: "
                f"{'met' if v['steps_fraction_met'] else 'not met'})"
            )
        ratio = v["tokens_per_s_ratio"]
        cost = (
            f"at {ratio:.3f}× its tokens/s (target ≥ {t['throughput_ratio_at_least']}: "
            f"{'met' if v['throughput_ratio_met'] else 'not met'})"
            if ratio is not None
            else "throughput not measured"
        )
        lines.append(
            f"- **{label}** (lr {run['lr']:g}, final validation loss "
            f"{run['final_val_loss']:.4f}) {speed}, {cost}."
        )
    return "\n".join(lines)


def report(summary: dict[str, Any]) -> str:
    """report.md: the table, how each optimizer did, and what exactly was measured."""
    precision = {"bf16": "bf16 autocast", "fp32": "fp32"}.get(summary["precision"], "fp32")
    precision += ", blocks compiled" if summary["compiled"] else ""
    names = [NAMES.get(n, n) for n in summary["optimizers"]]
    base = NAMES.get(summary["baseline"], summary["baseline"])
    return f"""# orthoptim compare: {" vs ".join(names)}

{summary["config"]} GPT on {summary["data"]}, {summary["nproc"]} ranks ({summary["device"]},
{summary["threads_per_rank"]} thread(s) per rank, {precision}), {summary["steps"]} steps of
{summary["tokens_per_step"]} tokens (batch {summary["batch_per_rank"]} per rank), the same
batches for every optimizer; validation every {summary["eval_every"]} steps on a fixed set.

{table(summary)}

![validation loss](loss.png)

How each did against {base} (its final validation loss {summary["baseline_final_val_loss"]:.4f}):

{verdicts(summary)}

What was measured: "steps to {base}'s final val loss" is the first evaluation step (a
multiple of {summary["eval_every"]}) at which an optimizer's validation loss is at or below
{base}'s final one. Tokens/s is tokens per step over the median step time on rank 0
(forward, backward and optimizer step, evaluation and checkpoints excluded);
the optimizer share is the summed `optimizer.step()` time (gradient reduction, the update
and the parameter gather) over the summed step time. Peak memory is each rank's maximum
resident set (CPU) or CUDA allocator peak (GPU). Bytes are those counted by
`orthoptim.collectives` in the last step. The runs took turns in
{summary["segments"]} segment(s), each resumed from its checkpoint, so changes in other load
on the machine over time hit every run alike; the first two steps after each start are left
out of the throughput.
"""


def run_compare(opts: CompareArgs) -> dict[str, Any]:
    """Train every compared optimizer (with --sweep: each over its LR grid, keeping the best
    final validation loss) and write report.md, loss.png and summary.json."""
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
    summary = summarize(opts, results, sweep)
    (out / "summary.json").write_text(json.dumps(summary, indent=1))
    plot(summary, out / "loss.png")
    (out / "report.md").write_text(report(summary))
    return summary
