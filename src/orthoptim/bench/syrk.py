"""`orthoptim bench syrk`: the symmetric products of Newton-Schulz alone, and the table that
decides between the Triton SYRK and torch's product on a GPU model.

Per shape [B, m, n] two products are timed side by side: the Gram X·Xᵀ, and the fused
epilogue b·A + c·A·A on the m×m A that the same Newton-Schulz step needs. Candidates:
`torch` (matmul / addmm: the baseline), `orthoptim` (`kernels.gram` / `kernels.sym_poly`,
the dispatch as it stands), with `--tune` every Triton config of `kernels.tuning.candidates`,
and Emerging-Optimizers' `tsyrk_ex` (2-D) / `batched_tsyrk_ex` (stacks, where its version
has it). Each result is checked against the float32 product; times are CUDA-event medians
(`tuning.cuda_timer`) taken round-robin. Rates are effective TFLOP/s (the plain product's
2·B·m²·n flops over the time) and their fraction of the measured matmul peak.

`--write FILE` (with `--tune`) writes the fastest correct candidate of every product,
the plain product among them, as a table `kernels.tuning` reads (ORTHOPTIM_SYRK_TABLE or
`src/orthoptim/kernels/tables/`).

On CPU, `--tune` races the Newton-Schulz paths of every shape afresh
(`kernels.calibration`: plain product, blocked SYRK, Gram form) and writes the winners to
the CPU decisions file, `$XDG_CACHE_HOME/orthoptim/kernels-cpu.json`, which later processes
and the ranks of a distributed job read instead of measuring.
"""

from __future__ import annotations

import argparse
import datetime
import math
import statistics
import sys
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from orthoptim import kernels
from orthoptim.bench import (
    Case,
    add_common_arguments,
    add_peak_argument,
    describe_kernel_paths,
    describe_peak,
    emit,
    environment,
    import_optional,
    kernel_paths,
    matmul_peak,
    parse_dtypes,
    parse_shapes,
    rate_against_peak,
    setup_device,
    thread_count,
    time_side_by_side,
)
from orthoptim.kernels import tuning

# On CUDA: square and wide from 256 to 16384 rows, stacks, and the stacks of `bench step`'s
# 12-layer width-2048 GPT (48 square matrices, 12 + 12 of 2048×8192 once the tall transposed).
DEFAULT_SHAPES = {
    "cuda": (
        "256x256,512x512,1024x1024,2048x2048,3072x3072,4096x4096,6144x6144,8192x8192,"
        "12288x12288,16384x16384,1024x4096,2048x8192,4096x14336,8192x28672,"
        "8x1024x1024,8x4096x4096,48x2048x2048,12x2048x8192"
    ),
    "cpu": "256x1024,512x2048,1024x1024",
}
# On CPU with --tune: also the shapes of `bench step`'s GPT (width 768) and `bench ns`.
CPU_TUNE_SHAPES = "256x1024,512x2048,768x768,768x3072,1024x1024,1024x4096"
BASELINE = "torch"
# The fused epilogue's coefficients: any b, c exercise it; these are quintic's first step.
POLY_B, POLY_C = -4.7750, 2.0315
ERR_LIMIT = {torch.float32: 1e-3, torch.bfloat16: 3e-2, torch.float16: 1e-2, torch.float64: 1e-9}


def _eo_cases(X: Tensor, A: Tensor | None) -> tuple[dict[str, Callable[[], Tensor]], str | None]:
    """Emerging-Optimizers' SYRK on X (gram) or on A with its epilogue, or why not."""
    eo, reason = import_optional("emerging_optimizers.triton_kernels")
    if eo is None:
        return {}, reason
    if not X.is_cuda or X.dtype != torch.bfloat16:
        return {}, "its Triton SYRK takes CUDA bfloat16 only"
    T = X if A is None else A
    if T.ndim == 2:
        fn = getattr(eo, "tsyrk_ex", None)
        if fn is None:
            return {}, "emerging_optimizers.triton_kernels has no tsyrk_ex here"
    else:
        fn = getattr(eo, "batched_tsyrk_ex", None)
        if fn is None:
            return {}, "this emerging_optimizers has no batched SYRK (tsyrk_ex is 2-D only)"
    if A is None:
        return {"emerging_optimizers": lambda: fn(T)}, None
    return {"emerging_optimizers": lambda: fn(T, T, alpha=POLY_C, beta=POLY_B)}, None


def _candidates(
    X: Tensor, A: Tensor | None, tune: bool, peers: bool = True
) -> tuple[dict[str, Callable[[], Tensor]], dict[str, tuning.Choice], dict[str, str]]:
    """(name → call, name → table choice, name → why skipped) for the Gram of X (A None) or
    the epilogue on A."""
    if A is None:
        calls: dict[str, Callable[[], Tensor]] = {
            BASELINE: lambda: torch.matmul(X, X.mT),
            "orthoptim": lambda: kernels.gram(X),
        }
    else:
        calls = {
            BASELINE: lambda: (
                torch.baddbmm(A, A, A, beta=POLY_B, alpha=POLY_C)
                if A.ndim == 3
                else torch.addmm(A, A, A, beta=POLY_B, alpha=POLY_C)
            ),
            "orthoptim": lambda: kernels.sym_poly(A, POLY_B, POLY_C),
        }
    choices: dict[str, tuning.Choice] = {BASELINE: tuning.MATMUL}
    skipped: dict[str, str] = {}
    T = X if A is None else A
    if tune:
        if T.is_cuda and kernels.triton_available():
            from orthoptim.kernels import triton_syrk

            for cfg in tuning.candidates(T.shape[-2], T.dtype):
                name = f"triton_{cfg.name}"
                choices[name] = cfg
                if A is None:
                    calls[name] = lambda cfg=cfg: triton_syrk.syrk(X, None, 0.0, 1.0, cfg)
                else:
                    calls[name] = lambda cfg=cfg: triton_syrk.syrk(A, A, POLY_B, POLY_C, cfg)
        else:
            skipped["triton configs"] = "the Triton SYRK runs on CUDA with triton installed"
    peer, reason = _eo_cases(X, A) if peers else ({}, "--no-peers")
    calls.update(peer)
    if reason:
        skipped["emerging_optimizers"] = reason
    return calls, choices, skipped


def _time(
    calls: dict[str, Callable[[], Tensor]], device: torch.device, rounds: int
) -> tuple[dict[str, float], dict[str, str]]:
    """Median ms per call, candidates taken round-robin (`rounds` rounds), each sample timed
    by `tuning`'s timers; a candidate that raises is reported instead of timed."""
    cases = [Case(name, fn, extra={"may_fail": True}) for name, fn in calls.items()]
    if device.type == "cuda":
        times = time_side_by_side(cases, device, rounds, 0, timer=_cuda_sample)
    else:
        times = time_side_by_side(cases, device, rounds, 0, timer=_wall_sample)
    failed = {c.name: c.skip for c in cases if c.skip is not None}
    return {name: statistics.median(v) * 1e3 for name, v in times.items()}, failed


def _cuda_sample(run: Callable[[], object]) -> float:
    return tuning.cuda_timer(run, 5) * 1e-3


def _wall_sample(run: Callable[[], object]) -> float:
    return tuning.wall_timer(run, 1) * 1e-3


def _rel_err(got: Tensor, want: Tensor) -> float:
    return ((got.float() - want).abs().max() / want.abs().max().clamp_min(1e-30)).item()


def _measure(
    X: Tensor,
    A: Tensor | None,
    tune: bool,
    device: torch.device,
    rounds: int,
    peak: dict[str, Any] | None,
    peers: bool = True,
) -> dict[str, Any]:
    """One product of one shape: every candidate's time, rate, error and the winner."""
    calls, choices, skipped = _candidates(X, A, tune, peers)
    T = X if A is None else A
    if A is None:
        reference = torch.matmul(X.float(), X.float().mT)
    else:
        Af = A.float()
        reference = POLY_B * Af + POLY_C * torch.matmul(Af, Af)
    b, m, n = (math.prod(T.shape[:-2]), *T.shape[-2:])
    flops = 2.0 * b * m * m * n
    times, failed = _time(calls, device, rounds)
    limit = ERR_LIMIT[T.dtype]
    rows = []
    for name, ms in times.items():
        err = _rel_err(calls[name](), reference)
        rows.append(
            {
                "name": name,
                "ms": ms,
                **(
                    rate_against_peak(flops, ms * 1e-3, peak)
                    if peak
                    else {"effective_tflops": flops / (ms * 1e-3) / 1e12}
                ),
                "speedup_vs_torch": times[BASELINE] / ms if BASELINE in times else None,
                "rel_err": err,
                "correct": err <= limit,
            }
        )
    rows += [{"name": k, "skipped": v} for k, v in {**skipped, **failed}.items()]
    raced = [r for r in rows if r["name"] in choices and r.get("correct")]
    best = min(raced, key=lambda r: r["ms"]) if raced else None
    return {
        "product": "gram" if A is None else "poly",
        "shape": [b, m, n],
        "flops": flops,
        "cases": rows,
        "winner": best["name"] if best else None,
        "choice": tuning.choice_to_json(choices[best["name"]]) if best else None,
    }


def run(
    shapes: list[tuple[int, int, int]],
    dtype: torch.dtype,
    device: torch.device,
    tune: bool,
    rounds: int,
    peak: dict[str, Any] | None,
    peers: bool = True,
) -> dict[str, Any]:
    """Benchmark the Gram and the epilogue of every shape; return the report."""
    # decided (on CPU with `tune`: raced afresh and cached) before timing `kernels.gram`
    paths = kernel_paths(shapes, dtype, device, remeasure=tune and device.type == "cpu")
    gen = torch.Generator().manual_seed(0)
    results = []
    seen_poly: set[tuple[int, int]] = set()
    for batch, rows, cols in shapes:
        m, n = min(rows, cols), max(rows, cols)
        X = torch.randn(batch, m, n, generator=gen).to(device=device, dtype=dtype)
        X = X[0] if batch == 1 else X
        results.append(_measure(X, None, tune, device, rounds, peak, peers))
        if (batch, m) not in seen_poly:
            seen_poly.add((batch, m))
            G = torch.matmul(X.float(), X.float().mT)
            A = (G / G.abs().amax(dim=(-2, -1), keepdim=True)).to(dtype)
            results.append(_measure(X, A, tune, device, rounds, peak, peers))
    return {
        "benchmark": "syrk",
        "device": str(device),
        "gpu": tuning.device_name(device),
        "dtype": str(dtype).removeprefix("torch."),
        "tuned": tune,
        "matmul_peak": peak,
        "rounds": rounds,
        "environment": environment(),
        "kernel_paths": paths,
        "results": results,
    }


def table_rows(report: dict[str, Any]) -> list[dict[str, Any]]:
    """The report's winners as `tuning.write_table` rows, with every candidate's time."""
    rows = []
    for res in report["results"]:
        if res["choice"] is None:
            continue
        b, m, n = res["shape"]
        rows.append(
            {
                "dtype": report["dtype"],
                "batch": b,
                "m": m,
                "n": n,
                "has_c": res["product"] == "poly",
                "choice": tuning.choice_from_json(res["choice"]),
                "ms": {c["name"]: c["ms"] for c in res["cases"] if "ms" in c},
            }
        )
    return rows


def render(report: dict[str, Any]) -> str:
    """A text table per (product, shape)."""
    lines = [
        f"SYRK, {report['device']} ({report['gpu']}), {report['dtype']}; effective TFLOP/s = "
        "2·B·m²·n / time; speedup = torch time / case time"
    ]
    if report["matmul_peak"]:
        lines.append(describe_peak(report["matmul_peak"]))
    lines += describe_kernel_paths(report.get("kernel_paths", []))
    for res in report["results"]:
        shape = "x".join(map(str, res["shape"]))
        label = "X·Xᵀ" if res["product"] == "gram" else "b·A + c·A·A"
        lines.append(f"\n{label} {shape}: winner {res['winner']}")
        for row in sorted(res["cases"], key=lambda r: r.get("ms", math.inf)):
            if "skipped" in row:
                lines.append(f"  {row['name']:<34} skipped: {row['skipped']}")
                continue
            frac = row.get("fraction_of_peak")
            lines.append(
                f"  {row['name']:<34} {row['ms']:9.4f} ms  {row['effective_tflops']:7.1f} TFLOP/s"
                + (f" ({100 * frac:.0f}% of peak)" if frac else "")
                + f"  x{row['speedup_vs_torch']:.2f}  err {row['rel_err']:.1e}"
                + ("" if row["correct"] else "  WRONG")
            )
    return "\n".join(lines)


def _cmd(args: argparse.Namespace) -> int:
    device = setup_device(args)
    dtypes = parse_dtypes(args.dtype or ("bfloat16" if device.type == "cuda" else "float32"))
    if len(dtypes) != 1:
        raise SystemExit("--dtype names one dtype")
    if args.write and not args.tune:
        raise SystemExit("--write needs --tune: a table records the fastest of every candidate")
    default = CPU_TUNE_SHAPES if args.tune and device.type == "cpu" else DEFAULT_SHAPES[device.type]
    shapes = args.shapes or parse_shapes(default)
    with thread_count(args.threads):
        peak = matmul_peak(args, device)
        report = run(shapes, dtypes[0], device, args.tune, args.repeats, peak, args.peers)
    if args.write:
        tuning.write_table(
            args.write,
            report["gpu"],
            table_rows(report),
            measured=datetime.date.today().isoformat(),
            command=" ".join(["orthoptim", *sys.argv[1:]]),
            environment=report["environment"],
        )
    emit(report, args.json, render)
    return 0


def add_parser(bench_subparsers: argparse._SubParsersAction) -> None:
    """Register `orthoptim bench syrk`."""
    p = bench_subparsers.add_parser(
        "syrk",
        help="X·Xᵀ and b·A + c·A·A: torch vs kernels vs Triton configs vs peers; --write a table",
    )
    add_common_arguments(p, repeats=3)
    p.add_argument(
        "--shapes", type=parse_shapes, default=None, help="default: a sweep for the device"
    )
    p.add_argument(
        "--dtype", default=None, help="one dtype (default bfloat16 on cuda, float32 on cpu)"
    )
    p.add_argument(
        "--tune",
        action="store_true",
        help="time every Triton config too (CUDA); on cpu race the Newton-Schulz paths and "
        "write the winners to the CPU decisions file",
    )
    p.add_argument(
        "--no-peers",
        dest="peers",
        action="store_false",
        help="leave Emerging-Optimizers out (its autotuning compiles ~180 configs per shape)",
    )
    p.add_argument("--write", default=None, metavar="FILE", help="write the table (with --tune)")
    add_peak_argument(p)
    p.set_defaults(func=_cmd)
