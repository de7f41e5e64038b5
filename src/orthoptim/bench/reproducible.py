"""`orthoptim bench reproducible`: what `reproducible=True` costs the layer-wise optimizer.

At each size of `--nproc` (gloo ranks, one intra-op thread each) every rank builds the same
small GPT twice, one `LayerwiseDistributedOptimizer` with reproducible=True and one without,
and times interleaved pairs of training steps (the pair's order alternating, a barrier before
each step): the accumulation loop of `docs/reproducible.md` over `--micro-batches` global
micro-batches (each rank its contiguous block, all but the last inside `no_sync()`), the
clip norm, `step()` and the parameter gathers' wait. Newton-Schulz takes each mode's own
path: reproducible=True the one its shape decides (`kernels.unraced`), the default what a
job's ranks take (the kernel cache file's choice, else plain matmuls), so the ratio is what
a run pays. Bytes are the
optimizer's counted wire bytes of a step (`opt.comm_stats()`).

Reported per size and as the worst over sizes: time_ratio = the busiest rank's median step
time, reproducible over default; bytes_ratio = the busiest rank's bytes sent per step,
reproducible over default. Wall-clock figures on a shared CPU are noisy: read the ratio, not
the milliseconds, and rerun on the hardware you train on.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from orthoptim import collectives as C
from orthoptim.bench import environment, parse_sizes
from orthoptim.bench.dist import gpt_model, spawn_gloo
from orthoptim.parallel.layerwise import LayerwiseDistributedOptimizer

MODES = ("default", "reproducible")


def _micro_batch(args: argparse.Namespace, step: int, index: int) -> tuple[Any, Any]:
    """Global micro-batch `index` of `step`: the same sequences at every size."""
    g = torch.Generator().manual_seed(args.seed * 1_000_003 + step * 1009 + index)
    idx = torch.randint(0, 256, (args.batch, args.seq_len + 1), generator=g)
    return idx[:, :-1], idx[:, 1:]


class _Mode:
    """One mode's model and optimizer on this rank; `step(i)` runs and times step i."""

    def __init__(self, name: str, args: argparse.Namespace, rank: int, world: int) -> None:
        self.name, self.args, self.rank, self.world = name, args, rank, world
        self.model = gpt_model(args)
        self.opt = LayerwiseDistributedOptimizer(
            self.model,
            optimizer="muon",
            lr=0.02,
            adamw_lr=3e-3,
            reproducible=name == "reproducible",
        )
        self.times: list[float] = []
        self.sent = 0.0

    def step(self, i: int) -> None:
        k = self.args.micro_batches // self.world
        batches = [_micro_batch(self.args, i, self.rank * k + j) for j in range(k)]
        start = time.perf_counter()
        for j, (x, y) in enumerate(batches):
            quiet = self.opt.no_sync() if j < k - 1 else contextlib.nullcontext()
            with quiet:
                (self.model(x, y) / k).backward()
        self.opt.clip_grad_norm_(1.0)
        self.opt.step()
        self.opt.zero_grad()
        self.opt.wait_for_params()
        self.times.append(time.perf_counter() - start)
        self.sent = self.opt.comm_stats()["total"]["sent"]

    def result(self) -> dict[str, float]:
        return {"step_s": statistics.median(self.times[self.args.warmup :]), "sent": self.sent}


def _rank_main(rank: int, world: int, port: int, outdir: str, args: argparse.Namespace) -> None:
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world
    )
    try:
        modes = [_Mode(name, args, rank, world) for name in MODES]
        for i in range(args.warmup + args.steps):
            for m in modes if i % 2 == 0 else modes[::-1]:  # interleaved pairs
                C.barrier()
                m.step(i)
        torch.save({m.name: m.result() for m in modes}, os.path.join(outdir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


def run_size(args: argparse.Namespace, world: int) -> dict[str, Any]:
    """Both modes at `world` ranks: each rank's median step time and bytes, the ratios."""
    per_rank = spawn_gloo(_rank_main, world, args)
    row: dict[str, Any] = {"accumulation": args.micro_batches // world}
    for name in MODES:
        row[name] = {
            "step_s_per_rank": [r[name]["step_s"] for r in per_rank],
            "sent_bytes_per_rank": [r[name]["sent"] for r in per_rank],
        }
    busiest = {n: max(row[n]["step_s_per_rank"]) for n in MODES}
    most = {n: max(row[n]["sent_bytes_per_rank"]) for n in MODES}
    row["time_ratio"] = busiest["reproducible"] / busiest["default"]
    row["bytes_ratio"] = most["reproducible"] / most["default"] if most["default"] else None
    return row


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Every size of --nproc, and the worst ratios over them."""
    sizes = {str(n): run_size(args, n) for n in args.nproc}
    bytes_ratios = [r["bytes_ratio"] for r in sizes.values() if r["bytes_ratio"] is not None]
    return {
        "benchmark": "reproducible",
        "time_ratio": max(r["time_ratio"] for r in sizes.values()),
        "bytes_ratio": max(bytes_ratios) if bytes_ratios else None,
        "sizes": sizes,
        "model": dict(layers=args.layers, width=args.width, heads=args.heads, seq_len=args.seq_len),
        "micro_batches": args.micro_batches,
        "micro_batch": args.batch,
        "steps": args.steps,
        "threads_per_rank": 1,
        "environment": environment(),
    }


def render(report: dict[str, Any]) -> str:
    """The table: per size, each mode's busiest-rank step time and bytes, and the ratios."""
    m = report["model"]
    lines = [
        f"orthoptim bench reproducible: GPT {m['layers']}x{m['width']}, "
        f"{report['micro_batches']} micro-batches of {report['micro_batch']}x{m['seq_len']} "
        f"per step, median of {report['steps']} interleaved pairs, 1 thread/rank, gloo",
        f"{'nproc':>5s} {'accum':>5s} {'default ms':>10s} {'repro ms':>9s} {'time ratio':>10s} "
        f"{'default MB':>10s} {'repro MB':>9s} {'bytes ratio':>11s}",
    ]
    for n, r in report["sizes"].items():
        t = {k: 1e3 * max(r[k]["step_s_per_rank"]) for k in MODES}
        b = {k: max(r[k]["sent_bytes_per_rank"]) / 2**20 for k in MODES}
        ratio = "n/a" if r["bytes_ratio"] is None else f"{r['bytes_ratio']:.3f}"
        lines.append(
            f"{n:>5s} {r['accumulation']:5d} {t['default']:10.1f} {t['reproducible']:9.1f} "
            f"{r['time_ratio']:10.3f} {b['default']:10.2f} {b['reproducible']:9.2f} {ratio:>11s}"
        )
    lines.append(
        f"worst: time_ratio {report['time_ratio']:.3f}, bytes_ratio "
        + ("n/a" if report["bytes_ratio"] is None else f"{report['bytes_ratio']:.3f}")
        + " (busiest rank, reproducible over default; targets <= 1.05 and <= 1.00)"
    )
    return "\n".join(lines)


def _cmd(args: argparse.Namespace) -> int:
    for n in args.nproc:
        if n < 2 or args.micro_batches % n:
            raise SystemExit(
                f"--nproc {n}: each size must be >= 2 and divide --micro-batches "
                f"{args.micro_batches}; pass sizes like 2,4"
            )
    if args.steps < 1 or args.warmup < 0:
        raise SystemExit(f"--steps must be >= 1 and --warmup >= 0, got {args.steps}, {args.warmup}")
    report = run(args)
    print(render(report))
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1))
        print(f"wrote {args.json}")
    return 0


def add_parser(bench_subparsers: argparse._SubParsersAction) -> None:
    """Register `orthoptim bench reproducible`."""
    p = bench_subparsers.add_parser(
        "reproducible",
        help="the layer-wise optimizer with and without reproducible=True: step time and wire "
        "bytes at 2 and 4 gloo ranks",
    )
    p.add_argument(
        "--nproc",
        type=parse_sizes,
        default=[2, 4],
        help="gloo ranks, comma-separated (default 2,4)",
    )
    p.add_argument("--layers", type=int, default=4, help="transformer blocks of the GPT")
    p.add_argument("--width", type=int, default=128, help="model width of the GPT")
    p.add_argument("--heads", type=int, default=4, help="attention heads of the GPT")
    p.add_argument("--seq-len", type=int, default=64, help="tokens per sequence")
    p.add_argument("--batch", type=int, default=2, help="sequences per micro-batch")
    p.add_argument(
        "--micro-batches", type=int, default=8, help="micro-batches per step (the global batch)"
    )
    p.add_argument("--steps", type=int, default=8, help="timed pairs of steps")
    p.add_argument("--warmup", type=int, default=2, help="untimed pairs first")
    p.add_argument("--seed", type=int, default=0, help="seed of the model and the batches")
    p.add_argument(
        "--json",
        metavar="PATH",
        default=None,
        help='write the report to PATH: {"time_ratio", "bytes_ratio", "sizes", ...}',
    )
    p.set_defaults(func=_cmd)
