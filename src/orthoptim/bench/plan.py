"""`orthoptim bench plan`: the plan's predicted step time against the real step's.

At each data-parallel size of `--nproc` (gloo ranks, one intra-op thread each) every rank
builds `orthoptim train --config NAME`'s GPT twice, under `LayerwiseDistributedOptimizer`
with Muon and with AdamW, and times interleaved steps of both (the pair's order alternating,
a barrier before each): forward and backward of `--batch` sequences, `step()`, `zero_grad()`
and the wait for the parameter gathers. A case's measured time is the busiest rank's median.
Its predicted time is `orthoptim plan`'s (`plan.steptime`) for the same model and layout on
the `--hardware` profile (one `orthoptim bench calibrate` measured on this machine, for the
rates it prices with): Newton-Schulz in fp32 on the CPU path, the step's global tokens.
Wall-clock figures on a shared CPU are noisy: the error of each case is what this machine
gave at the load it had.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path
from typing import Any, Literal

import torch
import torch.distributed as dist

from orthoptim import collectives as C
from orthoptim.bench import environment, parse_sizes
from orthoptim.bench.dist import spawn_gloo
from orthoptim.parallel.layerwise import LayerwiseDistributedOptimizer
from orthoptim.plan.hardware import load_hardware
from orthoptim.plan.layouts import Layout
from orthoptim.plan.model import train_model
from orthoptim.plan.planner import make_plan
from orthoptim.plan.steptime import step_time

Optimizer = Literal["muon", "adamw"]
OPTIMIZERS: tuple[Optimizer, ...] = ("muon", "adamw")


class _Case:
    """One optimizer's model on this rank; `step(i)` runs and times step i."""

    def __init__(self, name: Optimizer, args: argparse.Namespace) -> None:
        from orthoptim.train.model import CONFIGS, GPT

        torch.manual_seed(args.seed)
        self.cfg = CONFIGS[args.config]
        self.model = GPT(self.cfg)
        self.opt = LayerwiseDistributedOptimizer(self.model, optimizer=name, lr=0.02)
        self.args, self.name, self.times = args, name, []

    def step(self, i: int, rank: int) -> None:
        g = torch.Generator().manual_seed(self.args.seed * 1_000_003 + i * 1009 + rank)
        shape = (self.args.batch, self.cfg.seq_len + 1)
        idx = torch.randint(0, self.cfg.vocab_size, shape, generator=g)
        start = time.perf_counter()
        self.model(idx[:, :-1], idx[:, 1:]).backward()
        self.opt.step()
        self.opt.zero_grad()
        self.opt.wait_for_params()
        self.times.append(time.perf_counter() - start)


def _rank_main(rank: int, world: int, port: int, outdir: str, args: argparse.Namespace) -> None:
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world
    )
    try:
        cases = [_Case(name, args) for name in OPTIMIZERS]
        for i in range(args.warmup + args.steps):
            for c in cases if i % 2 == 0 else cases[::-1]:  # interleaved
                C.barrier()
                c.step(i, rank)
        medians = {c.name: statistics.median(c.times[args.warmup :]) for c in cases}
        torch.save(medians, os.path.join(outdir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


def predicted(args: argparse.Namespace, dp: int) -> dict[Optimizer, float]:
    """The plan's step seconds of both optimizers at `dp` ranks of `args`' config."""
    from orthoptim.train.model import CONFIGS

    desc, hw = train_model(args.config), load_hardware(args.hardware)
    tokens = dp * args.batch * CONFIGS[args.config].seq_len
    layout = Layout(dp=dp, tokens_per_step=tokens, device="cpu", ns_dtype="fp32")
    section = step_time(desc, hw, layout, make_plan(desc, hw, layout))
    return {name: section[name]["step_s"] for name in OPTIMIZERS}


def run(args: argparse.Namespace) -> list[dict[str, Any]]:
    """Every (size, optimizer) case: predicted, measured (the busiest rank's median), error."""
    cases = []
    for dp in args.nproc:
        per_rank = spawn_gloo(_rank_main, dp, args)
        plan = predicted(args, dp)
        for name in OPTIMIZERS:
            measured = max(r[name] for r in per_rank)
            cases.append(
                {
                    "case": f"dp{dp}-{name}",
                    "predicted_s": plan[name],
                    "measured_s": measured,
                    "error": plan[name] / measured - 1,
                }
            )
    return cases


def render(cases: list[dict[str, Any]], args: argparse.Namespace) -> str:
    """The table: each case's predicted and measured ms and the error; each size's ratio."""
    lines = [
        f"orthoptim bench plan: train:{args.config}, {args.batch} sequences per rank, median "
        f"of {args.steps} interleaved steps, 1 thread/rank, gloo; predicted on {args.hardware}",
        f"{'case':<14}{'predicted ms':>13}{'measured ms':>13}{'error':>9}",
    ]
    for c in cases:
        lines.append(
            f"{c['case']:<14}{c['predicted_s'] * 1e3:>13.2f}{c['measured_s'] * 1e3:>13.2f}"
            f"{c['error']:>+9.1%}"
        )
    by_case = {c["case"]: c for c in cases}
    for dp in args.nproc:
        muon, adamw = by_case[f"dp{dp}-muon"], by_case[f"dp{dp}-adamw"]
        lines.append(
            f"dp{dp} muon/adamw: predicted {muon['predicted_s'] / adamw['predicted_s']:.3f}, "
            f"measured {muon['measured_s'] / adamw['measured_s']:.3f}"
        )
    lines.append(f"load average at the end: {os.getloadavg()[0]:.1f} ({environment()['torch']})")
    return "\n".join(lines)


def _cmd(args: argparse.Namespace) -> int:
    if any(n < 1 for n in args.nproc) or args.steps < 1 or args.warmup < 0 or args.batch < 1:
        raise SystemExit(
            "--nproc sizes, --steps and --batch must be >= 1 and --warmup >= 0, got "
            f"{args.nproc}, {args.steps}, {args.batch}, {args.warmup}"
        )
    try:
        load_hardware(args.hardware)
        train_model(args.config)
    except (ValueError, FileNotFoundError) as exc:
        raise SystemExit(f"orthoptim bench plan: {exc}") from None
    cases = run(args)
    print(render(cases, args))
    if args.json:
        Path(args.json).write_text(json.dumps(cases, indent=1))
        print(f"wrote {args.json}")
    return 0


def add_parser(bench_subparsers: argparse._SubParsersAction) -> None:
    """Register `orthoptim bench plan`."""
    p = bench_subparsers.add_parser(
        "plan",
        help="the plan's predicted step time against the real step's, Muon and AdamW, at "
        "each data-parallel size",
    )
    p.add_argument(
        "--hardware",
        required=True,
        help="the profile the prediction prices with: one `orthoptim bench calibrate --out` "
        "wrote on this machine (or a shipped name)",
    )
    p.add_argument("--config", default="tiny", help="orthoptim train's GPT config (default tiny)")
    p.add_argument(
        "--nproc", type=parse_sizes, default=[1, 2], help="gloo ranks, comma-separated (1,2)"
    )
    p.add_argument("--batch", type=int, default=4, help="sequences per rank per step (4)")
    p.add_argument("--steps", type=int, default=7, help="timed steps of each optimizer (7)")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps first (2)")
    p.add_argument("--seed", type=int, default=0, help="seed of the model and the batches")
    p.add_argument(
        "--json",
        metavar="PATH",
        default=None,
        help='write [{"case", "predicted_s", "measured_s", "error"}, ...] to PATH',
    )
    p.set_defaults(func=_cmd)
