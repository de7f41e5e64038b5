"""`orthoptim bench build`: the peak resident memory building the layer-wise optimizer adds,
on N gloo ranks, against the parameters it moves into its flat buffers.

Each rank builds `--layers` x Linear(`--width`, `--width`) in fp32, makes torch's own
one-time imports first (a torch optimizer's first construction loads `torch._dynamo`,
about 150 MiB of code whatever the model), then reads its peak RSS (`ru_maxrss`) before
and after `LayerwiseDistributedOptimizer(...)` and after the first step. The gradient
buffers are part of what building adds: the parameters' gradients live there from then on.
"""

from __future__ import annotations

import argparse
import os
import resource
import socket
import tempfile
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

from orthoptim.bench import emit, environment
from orthoptim.checkpoint import load_file


def _peak_rss() -> int:
    """The process's peak resident set in bytes (Linux reports KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _rank_main(rank: int, world: int, port: int, outdir: str, args: argparse.Namespace) -> None:
    from orthoptim.parallel import LayerwiseDistributedOptimizer

    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world
    )
    try:
        torch.optim.AdamW(nn.Linear(2, 2).parameters())  # torch's one-time imports
        torch.manual_seed(0)
        model = nn.Sequential(
            *[nn.Linear(args.width, args.width, bias=False) for _ in range(args.layers)]
        )
        dtype = torch.bfloat16 if args.param_dtype == "bf16" else None
        before = _peak_rss()
        opt = LayerwiseDistributedOptimizer(
            model, "muon", lr=0.02, bucket_mb=args.bucket_mb, param_dtype=dtype
        )
        built = _peak_rss()
        x = torch.randn(4, args.width, dtype=dtype or torch.float32)
        model(x).float().square().mean().backward()
        opt.step()
        stepped = _peak_rss()
        out = {"before": before, "built": built, "stepped": stepped}
        torch.save(out, os.path.join(outdir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Spawn `args.nproc` gloo ranks, build and step once on each, and report the peaks."""
    with tempfile.TemporaryDirectory() as outdir:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        mp.spawn(_rank_main, args=(args.nproc, port, outdir, args), nprocs=args.nproc, join=True)
        ranks = [load_file(os.path.join(outdir, f"rank{r}.pt")) for r in range(args.nproc)]
    params = args.layers * args.width * args.width * 4
    rows = [
        {
            "construction_bytes": r["built"] - r["before"],
            "construction_over_params": (r["built"] - r["before"]) / params,
            "first_step_bytes": r["stepped"] - r["built"],
        }
        for r in ranks
    ]
    return {
        "benchmark": "build",
        "nproc": args.nproc,
        "model": {"layers": args.layers, "width": args.width, "param_bytes": params},
        "param_dtype": args.param_dtype,
        "bucket_mb": args.bucket_mb,
        "environment": environment(),
        "ranks": rows,
        "construction_over_params_max": max(r["construction_over_params"] for r in rows),
    }


def _render(report: dict[str, Any]) -> str:
    m = report["model"]
    lines = [
        f"building LayerwiseDistributedOptimizer on {report['nproc']} gloo ranks: "
        f"{m['layers']} x Linear({m['width']}, {m['width']}), "
        f"{m['param_bytes'] / 2**20:.0f} MiB of fp32 parameters, --param-dtype "
        f"{report['param_dtype']}, buckets of {report['bucket_mb']:g} MiB",
        f"{'rank':>4} {'construction (MiB)':>19} {'x params':>9} {'first step (MiB)':>17}",
    ]
    for r, row in enumerate(report["ranks"]):
        lines.append(
            f"{r:>4} {row['construction_bytes'] / 2**20:>19.0f} "
            f"{row['construction_over_params']:>9.2f} {row['first_step_bytes'] / 2**20:>17.0f}"
        )
    lines.append(
        "peak RSS (ru_maxrss) added by each phase, the gradient buffers included in the "
        "construction"
    )
    return "\n".join(lines)


def _cmd(args: argparse.Namespace) -> int:
    if args.nproc < 1:
        raise SystemExit(f"--nproc must be >= 1, got {args.nproc}")
    emit(run(args), args.json, _render)
    return 0


def add_parser(bench_subparsers: argparse._SubParsersAction) -> None:
    """Register `orthoptim bench build`."""
    p = bench_subparsers.add_parser(
        "build",
        help="peak RSS building the layer-wise optimizer adds, against the parameters",
    )
    p.add_argument("--nproc", type=int, default=2, help="gloo ranks (default 2)")
    p.add_argument("--layers", type=int, default=12, help="Linear layers (default 12)")
    p.add_argument("--width", type=int, default=2048, help="their width (default 2048)")
    p.add_argument(
        "--param-dtype", choices=("fp32", "bf16"), default="fp32", help="parameter dtype"
    )
    p.add_argument("--bucket-mb", type=float, default=25.0, help="bucket size in MiB")
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.set_defaults(func=_cmd)
