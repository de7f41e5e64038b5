"""`orthoptim bench telemetry`: what the optimizer telemetry costs a training run.

Runs `orthoptim train` with telemetry on (`--log-every N`) and off (`--log-every 0`),
interleaved (on, off, on, off, ...: the machine's drift falls on both alike), and compares
the mean step time (`step_time_s` of metrics.jsonl, warm-up steps left out) of each pair.
Within the runs with telemetry on it also sets the recorded steps against the others of the
same run: their extra time spread over `--log-every` steps is the overhead per step.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
from pathlib import Path
from typing import Any

from orthoptim.bench import emit, environment


def _step_times(out: Path, skip: int) -> list[tuple[int, float, bool]]:
    """(step, seconds, recorded) of every step of a run after its first `skip`."""
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return [
        (r["step"], r["step_time_s"], "telemetry" in r)
        for r in rows
        if "step_time_s" in r and r["step"] > skip
    ]


def run(args: argparse.Namespace) -> dict[str, Any]:
    """`args.pairs` interleaved pairs of runs, telemetry on and off; the step times."""
    from orthoptim.train.args import TrainArgs
    from orthoptim.train.launcher import launch

    pairs = []
    with tempfile.TemporaryDirectory() as root:
        for i in range(args.pairs):
            pair = {}
            for label, every in (("on", args.log_every), ("off", 0)):
                out = Path(root) / f"{label}{i}"
                launch(
                    TrainArgs(
                        optimizer=args.optimizer, config=args.config, steps=args.steps,
                        batch=args.batch, eval_every=args.steps, ckpt_every=args.steps,
                        out=str(out), log_every=every, progress=False,
                    ),
                    nproc=args.nproc,
                )  # fmt: skip
                pair[label] = _step_times(out, args.skip)
            pairs.append(pair)
    rows = []
    for pair in pairs:
        on = statistics.mean(t for _, t, _ in pair["on"])
        off = statistics.mean(t for _, t, _ in pair["off"])
        recorded = [t for _, t, r in pair["on"] if r]
        others = [t for _, t, r in pair["on"] if not r]
        extra = statistics.median(recorded) - statistics.median(others)
        rows.append(
            {
                "on_s": on,
                "off_s": off,
                "on_over_off": on / off,
                "recorded_step_s": statistics.median(recorded),
                "other_step_s": statistics.median(others),
                "amortized_overhead": extra / args.log_every / statistics.median(others),
            }
        )
    return {
        "benchmark": "telemetry",
        "optimizer": args.optimizer,
        "config": args.config,
        "nproc": args.nproc,
        "steps": args.steps,
        "batch": args.batch,
        "log_every": args.log_every,
        "environment": environment(),
        "pairs": rows,
        "on_over_off_median": statistics.median(r["on_over_off"] for r in rows),
        "amortized_overhead_median": statistics.median(r["amortized_overhead"] for r in rows),
    }


def _render(report: dict[str, Any]) -> str:
    lines = [
        f"telemetry on (--log-every {report['log_every']}) vs off, {report['optimizer']} "
        f"{report['config']}, {report['nproc']} ranks, {report['steps']} steps of batch "
        f"{report['batch']}, interleaved pairs; mean step time (ms)",
        f"{'pair':>4} {'on':>8} {'off':>8} {'on/off':>7} {'recorded':>9} {'others':>8} "
        f"{'amortized':>9}",
    ]
    for i, r in enumerate(report["pairs"]):
        lines.append(
            f"{i:>4} {r['on_s'] * 1e3:>8.1f} {r['off_s'] * 1e3:>8.1f} {r['on_over_off']:>7.3f} "
            f"{r['recorded_step_s'] * 1e3:>9.1f} {r['other_step_s'] * 1e3:>8.1f} "
            f"{r['amortized_overhead']:>9.2%}"
        )
    lines.append(
        f"median on/off {report['on_over_off_median']:.3f}; median amortized overhead "
        f"{report['amortized_overhead_median']:.2%} (recorded steps' extra median time over "
        "--log-every, against the other steps of the same runs)"
    )
    return "\n".join(lines)


def _cmd(args: argparse.Namespace) -> int:
    for name in ("pairs", "steps", "batch", "log_every", "nproc"):
        if getattr(args, name) < 1:
            raise SystemExit(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.skip >= args.steps:
        raise SystemExit(f"--skip must be below --steps ({args.steps}), got {args.skip}")
    emit(run(args), args.json, _render)
    return 0


def add_parser(bench_subparsers: argparse._SubParsersAction) -> None:
    """Register `orthoptim bench telemetry`."""
    p = bench_subparsers.add_parser(
        "telemetry", help="step time with the optimizer telemetry on against off, interleaved"
    )
    p.add_argument("--optimizer", default="muon", help="the optimizer trained (default muon)")
    p.add_argument("--config", default="tiny", help="the model config (default tiny)")
    p.add_argument("--nproc", type=int, default=2, help="gloo ranks (default 2)")
    p.add_argument("--steps", type=int, default=60, help="steps per run (default 60)")
    p.add_argument("--batch", type=int, default=16, help="sequences per rank (default 16)")
    p.add_argument("--log-every", type=int, default=10, help="telemetry period (default 10)")
    p.add_argument("--pairs", type=int, default=3, help="interleaved on/off pairs (default 3)")
    p.add_argument("--skip", type=int, default=5, help="warm-up steps left out (default 5)")
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.set_defaults(func=_cmd)
