"""`orthoptim bench tp --nproc N`: tensor-parallel Newton-Schulz modes side by side.

Starts N gloo ranks on this machine (one thread each, so a rank stands for one device) and,
per shape and shard dimension, runs every mode of `TensorParallelOrthogonalizer` (or those
`--modes` names) on the same batch of `--k` matrices. Reported per mode: median time per
batch (slowest rank), collectives and bytes sent per rank (as `comm_bytes.CommStats` counts
them), matmul flops per rank (counted by `torch.utils.flop_counter`, not computed), flops ÷
(single-device plain iteration ÷ N), packed Gram bytes ÷ the unpacked all-reduce of the same
Gram, and the relative Frobenius deviation from full Newton-Schulz of the whole matrix.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.distributed import ProcessGroup
from torch.utils.flop_counter import FlopCounterMode

from orthoptim import collectives, kernels
from orthoptim.bench import parse_shapes
from orthoptim.checkpoint import load_file
from orthoptim.comm_bytes import CommStats
from orthoptim.newton_schulz import newton_schulz
from orthoptim.ns_cost import NS_STEPS, ns_flops
from orthoptim.parallel.tensor_parallel import (
    GRAM_KIND,
    TP_MODES,
    CostModel,
    TensorParallelOrthogonalizer,
)

DEFAULT_SHAPES = "512x512,256x1024,1024x256"
# (label, mode, form, cost model: "default" or "calibrated")
Variant = tuple[str, str, str, str]


def variants() -> list[Variant]:
    """What `bench tp` runs, from the orthogonalizer's table of modes: each mode, a mode with
    forms in each (and in its calibrated cost model's pick), then auto with the default and
    the calibrated cost model."""
    out: list[Variant] = []
    for mode, spec in TP_MODES.items():
        if spec.forms:
            out += [(f"{mode}/{form}", mode, form, "default") for form in spec.forms]
            out.append((f"{mode}/auto", mode, "auto", "calibrated"))
        else:
            out.append((mode, mode, "auto", "default"))
    out.append(("auto/default", "auto", "auto", "default"))
    out.append(("auto/calibrated", "auto", "auto", "calibrated"))
    return out


def _parse_shapes(text: str) -> list[tuple[int, ...]]:
    return parse_shapes(text, batched=False)


def _parse_modes(text: str) -> list[str]:
    labels = [v[0] for v in variants()]
    modes = [m.strip() for m in text.split(",") if m.strip()]
    for m in modes:
        if m not in labels:
            raise argparse.ArgumentTypeError(f"unknown mode {m!r}; choose from {', '.join(labels)}")
    return modes


def _parse_dims(text: str) -> list[int]:
    dims = [int(d) for d in text.split(",")]
    if not dims or any(d not in (0, 1) for d in dims):
        raise argparse.ArgumentTypeError(f"shard dims must be 0 and/or 1, got {text!r}")
    return dims


def _timed(fn: Any, repeats: int, group: ProcessGroup | None) -> float:
    """Median over `repeats` of the slowest rank's time of fn()."""
    samples = []
    for _ in range(repeats):
        collectives.barrier(group)
        t0 = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - t0)
    t = torch.tensor(
        [statistics.median(samples)], dtype=torch.float64, device=collectives.device_for(group)
    )
    collectives.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return float(t.item())


def _rank_main(rank: int, world_size: int, args: argparse.Namespace) -> list[dict[str, Any]]:
    T = world_size
    dtype = getattr(torch, args.dtype)
    calibrated = CostModel.calibrate(repeats=3)
    rows_out: list[dict[str, Any]] = []
    for si, (rows, cols) in enumerate(args.shapes):
        g = torch.Generator().manual_seed(si)
        G = torch.randn(args.k, rows, cols, generator=g, dtype=dtype)
        full = newton_schulz(G, steps=args.steps)
        t_single = (
            _timed(lambda G=G: newton_schulz(G, steps=args.steps), args.repeats, None)
            if args.single
            else None
        )
        plain = args.k * ns_flops(rows, cols, args.steps)
        for shard_dim in args.shard_dims:
            if (rows, cols)[shard_dim] % T:
                continue
            local = G.chunk(T, dim=1 + shard_dim)[rank].contiguous()
            ref = full.chunk(T, dim=1 + shard_dim)[rank]
            p = (cols, rows)[shard_dim]
            # The unpacked all-reduce of the same Gram, counted side by side with the packed one.
            unpacked = CommStats()
            W = local if shard_dim == 1 else local.mT
            collectives.all_reduce(kernels.gram(W).contiguous(), stats=unpacked)
            unpacked_bytes = unpacked.sent["all_reduce"] * args.steps
            for label, mode, form, model in variants():
                if args.modes and label not in args.modes:
                    continue
                stats = CommStats()
                cm = calibrated if model == "calibrated" else CostModel()
                orth = TensorParallelOrthogonalizer(
                    mode=mode,
                    shard_dim=shard_dim,
                    steps=args.steps,
                    form=form,
                    cost_model=cm,
                    stats=stats,
                )
                with FlopCounterMode(display=False) as counter:
                    out = orth(local)
                sent = stats.as_dict()["total"]["sent"]
                calls = stats.as_dict()["total"]["calls"]
                gram_sent = stats.sent.get(GRAM_KIND, 0.0)
                diff = torch.stack(
                    [(out - ref).double().square().sum(), ref.double().square().sum()]
                ).to(collectives.device_for())
                collectives.all_reduce(diff)
                flops = torch.tensor(
                    [float(counter.get_total_flops())],
                    dtype=torch.float64,
                    device=collectives.device_for(),
                )
                collectives.all_reduce(flops, op=dist.ReduceOp.MAX)
                seconds = _timed(lambda o=orth, x=local: o(x), args.repeats, None)
                rows_out.append(
                    {
                        "shape": f"{rows}x{cols}",
                        "shard_dim": shard_dim,
                        "mode": label,
                        "chosen": orth.last_modes[0]
                        + (f"/{orth.last_forms[0]}" if orth.last_forms else ""),
                        "seconds": seconds,
                        "single_seconds": t_single,
                        "bytes_per_rank": sent,
                        "collectives": calls,
                        "flops_per_rank": flops.item(),
                        "flops_vs_plain_over_T": flops.item() / (plain / T),
                        "gram_bytes_vs_unpacked": (
                            gram_sent / unpacked_bytes
                            if orth.last_modes[0] != "duplicated" and gram_sent
                            else None
                        ),
                        "gram_side": p,
                        "rel_deviation": float((diff[0] / diff[1]).sqrt()),
                    }
                )
    if rank == 0:
        rows_out.append({"calibrated": calibrated.__dict__})
    return rows_out


def _worker(rank: int, world_size: int, port: int, outdir: str, args: argparse.Namespace) -> None:
    torch.set_num_threads(args.threads)
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size
    )
    try:
        result = _rank_main(rank, world_size, args)
        if rank == 0:
            torch.save(result, os.path.join(outdir, "result.pt"))
    finally:
        dist.destroy_process_group()


def run(args: argparse.Namespace) -> list[dict[str, Any]]:
    """Spawn `args.nproc` gloo ranks, run the benchmark, return rank 0's rows."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory() as outdir:
        mp.spawn(_worker, args=(args.nproc, port, outdir, args), nprocs=args.nproc, join=True)
        return load_file(os.path.join(outdir, "result.pt"))


def _print(rows: list[dict[str, Any]], args: argparse.Namespace) -> None:
    calibrated = rows.pop()["calibrated"]
    print(
        f"TP = {args.nproc} gloo ranks, {args.threads} thread(s) each, {args.dtype}, "
        f"k = {args.k} matrices per batch, {args.steps} steps, median of {args.repeats}"
    )
    print(
        "calibrated cost model: bandwidth {bandwidth:.3g} B/s, latency {latency:.3g} s, "
        "throughput {throughput:.3g} flop/s".format(**calibrated)
    )
    head = (
        f"{'shape':>10} {'shard':>5} {'mode':<19} {'chose':<18} {'ms':>8} {'x single':>8} "
        f"{'colls':>5} {'KiB/rank':>10} {'MFLOP/rank':>11} {'fl/(pl/T)':>9} {'gram/unp':>8} "
        f"{'rel dev':>9}"
    )
    print(head)
    print("-" * len(head))
    for r in rows:
        gram = r["gram_bytes_vs_unpacked"]
        single = "" if r["single_seconds"] is None else f"{r['seconds'] / r['single_seconds']:.2f}"
        print(
            f"{r['shape']:>10} {r['shard_dim']:>5} {r['mode']:<19} {r['chosen']:<18} "
            f"{r['seconds'] * 1e3:8.1f} {single:>8} {r['collectives']:>5} "
            f"{r['bytes_per_rank'] / 1024:10.1f} {r['flops_per_rank'] / 1e6:11.1f} "
            f"{r['flops_vs_plain_over_T']:9.3f} {'' if gram is None else f'{gram:.3f}':>8} "
            f"{r['rel_deviation']:9.2e}"
        )
    print(
        "ms: median time per batch of the slowest rank; x single: ÷ full Newton-Schulz of the "
        "whole batch on one rank; colls: collectives per batch; fl/(pl/T): flops per rank ÷ "
        "(single-device plain iteration steps·(4m²n+2m³) ÷ T); gram/unp: packed Gram bytes ÷ "
        "the unpacked all-reduce of the same Gram at every step; rel dev: ‖out − NS(full)‖_F ÷ "
        "‖NS(full)‖_F over all ranks. auto/default uses CostModel() (a GPU node), "
        "auto/calibrated and distributed/auto the probe above."
    )


def _cmd(args: argparse.Namespace) -> int:
    if args.nproc < 2:
        raise SystemExit(f"--nproc must be >= 2, got {args.nproc}")
    rows = run(args)
    _print(rows, args)
    return 0


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    """Register `bench tp`."""
    p = subparsers.add_parser(
        "tp",
        help="tensor-parallel Newton-Schulz: duplicated / distributed / gram / blockwise / auto",
    )
    p.add_argument("--nproc", type=int, default=2, help="tensor-parallel ranks (gloo)")
    p.add_argument(
        "--shapes",
        type=_parse_shapes,
        default=_parse_shapes(DEFAULT_SHAPES),
        help=f"matrix shapes ROWSxCOLS, comma-separated (default {DEFAULT_SHAPES})",
    )
    p.add_argument("--k", type=int, default=1, help="matrices per batch")
    p.add_argument(
        "--steps",
        type=int,
        default=NS_STEPS,
        help=f"Newton-Schulz iterations (default {NS_STEPS})",
    )
    p.add_argument(
        "--repeats", type=int, default=3, help="timed repeats; the median is reported (default 3)"
    )
    p.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    p.add_argument(
        "--modes",
        type=_parse_modes,
        default=[],
        help="comma-separated mode labels to run, e.g. duplicated,distributed/apply,gram "
        f"(default every one: {', '.join(v[0] for v in variants())})",
    )
    p.add_argument(
        "--shard-dims",
        type=_parse_dims,
        default=[0, 1],
        help="the matrix dims to shard along, comma-separated (default 0,1)",
    )
    p.add_argument(
        "--no-single",
        dest="single",
        action="store_false",
        help="skip timing the whole batch on one rank (the x single column)",
    )
    p.add_argument(
        "--dtype",
        default="float32",
        choices=("float32", "float64"),
        help="dtype of the matrices (default float32)",
    )
    p.set_defaults(func=_cmd)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(prog="orthoptim bench")
    add_parser(parser.add_subparsers())
    ns = parser.parse_args()
    raise SystemExit(ns.func(ns))
