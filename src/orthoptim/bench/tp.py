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
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import Tensor
from torch.distributed import ProcessGroup
from torch.utils.flop_counter import FlopCounterMode

from orthoptim import collectives, kernels
from orthoptim.bench import import_optional, parse_shapes
from orthoptim.bench.ns import float32_matmul_precision
from orthoptim.checkpoint import load_file
from orthoptim.comm_bytes import CommStats
from orthoptim.fileio import atomic_write_json
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


def _parse_cases(text: str) -> list[str]:
    cases = [c.strip() for c in text.split(",") if c.strip()]
    unknown = [c for c in cases if c not in CASES]
    if unknown or not cases:
        raise argparse.ArgumentTypeError(
            f"unknown case(s) {unknown or text!r}; choose from {', '.join(CASES)}"
        )
    return cases


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


# The shapes the side-by-side table runs (`--cases`): k matrices of rows×cols split along
# shard_dim (0: rows, a column-parallel weight; 1: columns, row-parallel).
CASES: dict[str, tuple[int, int, int, int]] = {
    "up": (1, 4096, 1024, 0),  # column-parallel up-projection, rows split
    "down": (1, 1024, 4096, 1),  # row-parallel down-projection, columns split
    "sq": (1, 2048, 2048, 0),  # square, rows split
    "stack": (4, 1024, 1024, 0),  # a stack of square matrices, rows split
    "kv": (1, 1024, 4096, 0),  # k/v projection split along its short side
}
# orthoptim's variants in the side-by-side table: (label, mode, form)
OURS: tuple[tuple[str, str, str], ...] = (
    ("duplicated", "duplicated", "auto"),
    ("distributed/apply", "distributed", "apply"),
    ("distributed/square", "distributed", "square"),
    ("distributed/split", "distributed", "split"),
    ("distributed/rows", "distributed", "rows"),
    ("gram", "gram", "auto"),
    ("auto", "auto", "auto"),
)
EO_MODULE = "emerging_optimizers.orthogonalized_optimizers.muon_utils"
RIGHT = 1e-3  # a variant within this relative deviation of the float64 result is "right"


def import_eo() -> tuple[Any, str]:
    """Emerging-Optimizers' muon_utils and a note on how it was imported. 0.3.0 declares
    Python ≥ 3.12 and imports `typing.override`; on 3.11 that name is taken from
    typing_extensions for the import, and the note says so."""
    import typing

    note = ""
    if not hasattr(typing, "override"):
        import typing_extensions

        typing.override = typing_extensions.override  # type: ignore[attr-defined]
        note = "typing.override aliased from typing_extensions (Python < 3.12)"
    eo, reason = import_optional(EO_MODULE)
    if eo is None or not hasattr(eo, "newton_schulz_tp"):
        raise SystemExit(
            f"--against eo: {reason or 'this emerging_optimizers has no newton_schulz_tp'}; "
            "install emerging-optimizers (0.3.0 has newton_schulz_tp) to compare"
        )
    return eo, note


def _variants(
    local: Tensor, shard_dim: int, steps: int, eo: Any | None, calibrated: CostModel
) -> dict[str, Callable[[], Tensor]]:
    """The callables timed side by side on this rank's shard `local` [k, rows_i, cols_i]:
    orthoptim's modes (`auto` with the device's default figures and with `calibrated`) and,
    given its module `eo`, Emerging-Optimizers' two modes."""
    out: dict[str, Callable[[], Tensor]] = {}
    for label, mode, form in (*OURS, ("auto/calibrated", "auto", "auto")):
        model = calibrated if label == "auto/calibrated" else None
        orth = TensorParallelOrthogonalizer(
            mode=mode, shard_dim=shard_dim, steps=steps, form=form, cost_model=model
        )
        out[label] = lambda o=orth: o(local)
    if eo is not None:
        group = dist.group.WORLD

        def eo_run(tp_mode: str) -> Tensor:
            # one 2-D call per matrix, as its Muon orthogonalizes each parameter (a 3-D input's
            # distributed mode normalises the whole stack by one norm); partition_dim is the
            # matrix side split, which its distributed mode reads as "transpose when 0"
            with float32_matmul_precision("highest"):
                return torch.stack(
                    [
                        eo.newton_schulz_tp(x, steps, "quintic", group, shard_dim, tp_mode)
                        for x in local
                    ]
                )

        out["eo/distributed"] = lambda: eo_run("distributed")
        out["eo/duplicated"] = lambda: eo_run("duplicated")
    return out


def _side_by_side_rank(rank: int, world_size: int, args: argparse.Namespace) -> dict[str, Any]:
    """Every variant on every case, interleaved: per round each variant once (order rotated
    round by round), the slowest rank's time kept."""
    eo, note = import_eo() if args.against == "eo" else (None, "")
    dev = collectives.device_for()
    calibrated = CostModel.calibrate(repeats=3)
    result: dict[str, Any] = {"note": note, "cases": {}, "calibrated": calibrated.__dict__}
    for ci, name in enumerate(args.cases):
        k, rows, cols, shard_dim = CASES[name]
        rows, cols = rows // args.shrink, cols // args.shrink
        G = torch.randn(k, rows, cols, generator=torch.Generator().manual_seed(ci))
        ref = newton_schulz(G.double(), steps=args.steps).chunk(world_size, dim=1 + shard_dim)
        local = G.chunk(world_size, dim=1 + shard_dim)[rank].contiguous()
        variants = _variants(local, shard_dim, args.steps, eo, calibrated)
        deviation: dict[str, float] = {}
        for label, fn in variants.items():
            out = fn()
            err = torch.stack([(out.double() - ref[rank]).square().sum(), ref[rank].square().sum()])
            collectives.all_reduce(err.to(dev))
            deviation[label] = float((err[0] / err[1]).sqrt())
        chosen = {}
        for model in (None, calibrated):
            auto = TensorParallelOrthogonalizer(
                shard_dim=shard_dim, steps=args.steps, cost_model=model
            )
            auto(local)
            picked = auto.last_modes[0] + (f"/{auto.last_forms[0]}" if auto.last_forms else "")
            chosen["calibrated" if model else "default"] = picked
        labels = list(variants)
        times: dict[str, list[float]] = {label: [] for label in labels}
        for r in range(args.repeats):
            for label in labels[r % len(labels) :] + labels[: r % len(labels)]:
                collectives.barrier()
                t0 = time.perf_counter()
                variants[label]()
                t = torch.tensor([time.perf_counter() - t0], dtype=torch.float64, device=dev)
                collectives.all_reduce(t, op=dist.ReduceOp.MAX)
                times[label].append(float(t.item()))
        result["cases"][name] = {
            "shape": [k, rows, cols],
            "shard_dim": shard_dim,
            "times": times,
            "deviation": deviation,
            "auto_chose": chosen,
        }
    return result


def paired_ratios(times: dict[str, list[float]], right: set[str]) -> tuple[str, dict[str, float]]:
    """The fastest right variant (lowest median time) and every variant's paired median ratio
    to it: the median over rounds of its time ÷ the fastest one's in the same round."""
    best = min(sorted(right), key=lambda label: statistics.median(times[label]))
    return best, {
        label: statistics.median(t / b for t, b in zip(ts, times[best]))
        for label, ts in times.items()
    }


def _print_side_by_side(result: dict[str, Any], args: argparse.Namespace) -> list[dict[str, Any]]:
    """Print the ratio table (variants × cases) and return its rows for `--json`."""
    cases = result["cases"]
    labels = list(next(iter(cases.values()))["times"])
    rows: list[dict[str, Any]] = []
    best: dict[str, str] = {}
    for name, case in cases.items():
        right = {lb for lb, d in case["deviation"].items() if d <= RIGHT}
        best[name], ratios = paired_ratios(case["times"], right)
        rows += [
            {
                "case": name,
                "variant": label,
                "median_s": statistics.median(case["times"][label]),
                "ratio_to_fastest": ratios[label],
                "fastest": best[name],
                "deviation": case["deviation"][label],
                "right": label in right,
                "auto_chose": case["auto_chose"],
            }
            for label in labels
        ]
    ratio = {(r["case"], r["variant"]): r for r in rows}
    print(
        f"T = {args.nproc} gloo ranks, {args.threads} thread(s) each, float32, {args.steps} "
        f"steps: time ÷ the fastest right variant, paired median of {args.repeats} "
        "interleaved rounds (slowest rank)"
    )
    if result["note"]:
        print(f"emerging_optimizers imported with {result['note']}")
    print(
        "calibrated: bandwidth {bandwidth:.3g} B/s, latency {latency:.3g} s, throughput "
        "{throughput:.3g} flop/s, symmetric {symmetric:.2f}, memory {memory_bandwidth:.3g} B/s, "
        "launch {launch:.2g} s".format(**result["calibrated"])
    )
    head = f"{'variant':<20}" + "".join(f"{n:>9}" for n in cases)
    print(head)
    print("-" * len(head))
    for label in labels:
        cells = [ratio[name, label] for name in cases]
        print(
            f"{label:<20}"
            + "".join(f"{c['ratio_to_fastest']:8.2f}{' ' if c['right'] else '!'}" for c in cells)
        )
    ms = [ratio[name, best[name]]["median_s"] * 1e3 for name in cases]
    print(f"{'fastest (ms)':<20}" + "".join(f"{t:8.0f} " for t in ms))
    for name, case in cases.items():
        picks = case["auto_chose"]
        print(
            f"  {name}: fastest {best[name]}; auto chose {picks['default']}, "
            f"with the calibrated model {picks['calibrated']}"
        )
    print(
        f"!: more than {RIGHT:g} (relative Frobenius) from Newton-Schulz of the whole matrix in "
        "float64; never the reference."
    )
    return rows


def _worker(rank: int, world_size: int, port: int, outdir: str, args: argparse.Namespace) -> None:
    torch.set_num_threads(args.threads)
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size
    )
    try:
        side_by_side = args.against is not None or args.cases
        main = _side_by_side_rank if side_by_side else _rank_main
        result = main(rank, world_size, args)
        if rank == 0:
            torch.save(result, os.path.join(outdir, "result.pt"))
    finally:
        dist.destroy_process_group()


def run(args: argparse.Namespace) -> Any:
    """Spawn `args.nproc` gloo ranks, run the benchmark, return rank 0's result."""
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
    if args.shrink < 1 or any(
        s % (args.shrink * args.nproc) for c in CASES.values() for s in c[1:3]
    ):
        raise SystemExit(
            f"--shrink must divide every case's sides into shards of equal size at --nproc "
            f"{args.nproc}, got {args.shrink}"
        )
    if args.against is not None or args.cases:
        if args.against == "eo":
            import_eo()  # refused here, before any rank starts, when it does not import
        args.cases = args.cases or list(CASES)
        rows = _print_side_by_side(run(args), args)
        if args.json:
            atomic_write_json(rows, args.json, indent=1)
            print(f"wrote {args.json}")
        return 0
    _print(run(args), args)
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
    p.add_argument(
        "--against",
        choices=("eo",),
        default=None,
        help="also time NVIDIA Emerging-Optimizers' newton_schulz_tp (distributed and "
        "duplicated), interleaved with orthoptim's modes on --cases (it must be installed)",
    )
    p.add_argument(
        "--cases",
        type=_parse_cases,
        default=[],
        help=f"side-by-side cases, comma-separated, from {', '.join(CASES)} (default all of them "
        "when --against is given); each variant runs interleaved, ratios are paired medians",
    )
    p.add_argument(
        "--shrink",
        type=int,
        default=1,
        help="divide both sides of every case by this (a quick run; the table's figures are at 1)",
    )
    p.add_argument("--json", default=None, help="write the side-by-side rows to this JSON file")
    p.set_defaults(func=_cmd)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(prog="orthoptim bench")
    add_parser(parser.add_subparsers())
    ns = parser.parse_args()
    raise SystemExit(ns.func(ns))
