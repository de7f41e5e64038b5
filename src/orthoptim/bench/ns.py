"""`orthoptim bench ns`: Newton-Schulz speed, ours against plain matmul and the peers.

Per shape and dtype, timed side by side: `orthoptim` (kernels dispatch), `matmul_ns` (the
same function with the matmul path forced: the baseline), torch.optim.Muon's
orthogonalization (made float32 for float32 rows: it hard-codes bfloat16), and the peers
where they import: emerging-optimizers (plain and use_syrk), heavyball and dion. The three
GEMMs of a plain step are timed alone too: their best GFLOP/s is the machine's matmul rate
at that size, against which each candidate's effective GFLOP/s (plain-matmul flops / time)
is set. On CUDA (or with --peak-size) a large bf16 matmul is timed once per run as well,
and every rate is also given in TFLOP/s and as a fraction of that measured peak.
"""

from __future__ import annotations

import argparse
import contextlib
from collections.abc import Callable, Iterator
from typing import Any, NamedTuple

import torch
from torch import Tensor

from orthoptim import kernels
from orthoptim._torch_compat import torch_muon_newton_schulz
from orthoptim.bench import (
    DION_HINT,
    Case,
    add_common_arguments,
    add_peak_argument,
    add_skip_argument,
    describe_kernel_paths,
    describe_peak,
    emerging_syrk_skip,
    emit,
    environment,
    import_optional,
    kernel_paths,
    matmul_peak,
    parse_dtypes,
    parse_shapes,
    rate_against_peak,
    setup_device,
    summarize,
    takes_argument,
    thread_count,
    time_side_by_side,
    torch_zeropower_fp32,
)
from orthoptim.newton_schulz import COEFFICIENT_SETS, newton_schulz
from orthoptim.ns_cost import NS_STEPS, ns_flops

DEFAULT_SHAPES = "1024x1024,1024x4096,4096x1024,8x768x3072"
BASELINE = "matmul_ns"
EO_SYRK = "emerging_optimizers_syrk"
HEAVYBALL_BF16 = (
    "heavyball's Newton-Schulz rounds its input to bfloat16 (float64 excepted): "
    "timed in the bfloat16 rows only"
)


@contextlib.contextmanager
def float32_matmul_precision(precision: str) -> Iterator[None]:
    """torch.set_float32_matmul_precision within the block."""
    before = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision(precision)
    try:
        yield
    finally:
        torch.set_float32_matmul_precision(before)


class _DionFunction(NamedTuple):
    name: str
    module: str
    function: str
    cuda_only: bool
    note: str


# dion's orthogonalizers: 5 fixed steps in bfloat16 whatever the input dtype.
DION_FUNCTIONS = (
    _DionFunction(
        "dion_ns_triton",
        "dion.newton_schulz_triton",
        "newton_schulz_triton",
        True,
        "newton_schulz_triton: Triton kernels for X·Xᵀ and b·A + c·A·A, quintic coefficients",
    ),
    _DionFunction(
        "dion_polar_express_triton",
        "dion.polar_express",
        "polar_express_triton",
        True,
        "polar_express_triton: the same Triton kernels, Polar Express coefficients "
        "(dion.Muon(use_triton=True)'s orthogonalizer)",
    ),
    _DionFunction(
        "dion_ns_compiled",
        "dion.newton_schulz_triton",
        "zeropower_via_newtonschulz5",
        False,
        "zeropower_via_newtonschulz5: torch.compile'd matmuls, quintic coefficients",
    ),
)
DION_STEPS = 5
DION_BF16 = "dion's Newton-Schulz casts its input to bfloat16: timed in the bfloat16 rows only"


def _emerging_cases(X: Tensor, dtype: torch.dtype, steps: int, coefficients: str) -> list[Case]:
    """Emerging-Optimizers' newton_schulz: its plain path, and its use_syrk (Triton) path."""
    eo, reason = import_optional("emerging_optimizers.orthogonalized_optimizers.muon_utils")
    if eo is not None and not hasattr(eo, "newton_schulz"):
        eo, reason = None, "emerging_optimizers has no muon_utils.newton_schulz here"
    Xf = X.float()  # it takes float32 only; bfloat16 comes from torch's matmul precision
    syrk_skip = emerging_syrk_skip(X.device) or reason
    if syrk_skip is None and dtype != torch.bfloat16:
        syrk_skip = (
            "use_syrk takes effect only under matmul precision 'medium' (bfloat16 compute): "
            "timed in the bfloat16 rows only"
        )
    if syrk_skip is None and not takes_argument(eo.newton_schulz, "use_syrk"):
        syrk_skip = "this emerging_optimizers' newton_schulz has no use_syrk (0.3.0 has)"
    if eo is None:
        return [Case("emerging_optimizers", skip=reason), Case(EO_SYRK, skip=syrk_skip)]
    precision = "highest" if dtype == torch.float32 else "medium"

    def emerging() -> Tensor:
        with float32_matmul_precision(precision):
            return eo.newton_schulz(Xf, steps=steps, coefficient_type=coefficients)

    cases = [
        Case(
            "emerging_optimizers",
            emerging,
            note=f"muon_utils.newton_schulz, float32 input, matmul precision {precision!r}",
            extra={"peer": True},
        )
    ]
    if syrk_skip is not None:
        return [*cases, Case(EO_SYRK, skip=syrk_skip)]
    matrices = list(Xf)

    def emerging_syrk() -> list[Tensor]:
        with float32_matmul_precision("medium"):
            return [
                eo.newton_schulz(x, steps=steps, coefficient_type=coefficients, use_syrk=True)
                for x in matrices
            ]

    note = "muon_utils.newton_schulz(use_syrk=True), float32 input, matmul precision 'medium'"
    if len(matrices) > 1:
        note += (
            f"; use_syrk is 2-D only, so the batch is a loop over its {len(matrices)} matrices "
            "(as its Muon does)"
        )
    return [*cases, Case(EO_SYRK, emerging_syrk, note=note, extra={"peer": True})]


def _heavyball_case(X: Tensor, dtype: torch.dtype) -> Case:
    hb, reason = import_optional("heavyball.utils")
    if hb is not None and not hasattr(hb, "zeropower_via_newtonschulz5"):
        hb, reason = None, "heavyball has no utils.zeropower_via_newtonschulz5 here"
    if hb is not None and dtype != torch.bfloat16:
        hb, reason = None, HEAVYBALL_BF16
    if hb is None:
        return Case("heavyball", skip=reason)
    if hasattr(hb, "compile_mode"):
        hb.compile_mode = None  # its first compiled call takes ~25 s on CPU
    Xb = X.to(dtype)
    return Case(
        "heavyball",
        lambda: hb.zeropower_via_newtonschulz5(Xb),
        note="utils.zeropower_via_newtonschulz5 in bfloat16",
        extra={"peer": True},
    )


def _dion_cases(X: Tensor, dtype: torch.dtype, steps: int) -> list[Case]:
    """dion's Newton-Schulz functions, as shipped; a batch goes in as one 3-D tensor."""
    Xb = (X[0] if X.shape[0] == 1 else X).to(torch.bfloat16)
    cases = []
    for f in DION_FUNCTIONS:
        reason = None
        if f.cuda_only and X.device.type != "cuda":
            reason = "CUDA-only: dion's Triton kernels"
        elif steps != DION_STEPS:
            reason = f"dion's functions run a fixed {DION_STEPS} steps; --steps is {steps}"
        elif dtype != torch.bfloat16:
            reason = DION_BF16
        module = None
        if reason is None:
            module, reason = import_optional(f.module)
            if module is None:
                reason = f"{reason}; {DION_HINT}"
            elif not hasattr(module, f.function):
                module, reason = None, f"dion has no {f.module}.{f.function} here"
        if module is None:
            cases.append(Case(f.name, skip=reason))
            continue
        fn = getattr(module, f.function)
        cases.append(
            Case(f.name, lambda fn=fn: fn(Xb), note=f"{f.note}, bfloat16", extra={"peer": True})
        )
    return cases


def _peer_cases(X: Tensor, dtype: torch.dtype, steps: int, coefficients: str) -> list[Case]:
    return [
        *_emerging_cases(X, dtype, steps, coefficients),
        _heavyball_case(X, dtype),
        *_dion_cases(X, dtype, steps),
    ]


def _gemm_cases(X: Tensor, dtype: torch.dtype) -> list[Case]:
    """The three products of a plain step alone (X·Xᵀ, A·A, B·X): their best rate is the
    matmul GFLOP/s at this size. Plus `kernel_gram`, the Gram through `kernels.gram`, at the
    rate its plain-matmul flops would give (above gemm_gram's when the SYRK pays)."""
    Y = X.to(dtype)
    if Y.shape[-2] > Y.shape[-1]:
        Y = Y.mT.contiguous()
    b, m, n = Y.shape
    A = torch.randn(b, m, m, dtype=dtype, device=Y.device)
    Y2, A2 = (Y[0], A[0]) if b == 1 else (Y, A)
    gram_flops = 2.0 * b * m * m * n
    return [
        Case("gemm_gram", lambda: torch.matmul(Y2, Y2.mT), extra={"flops": gram_flops}),
        Case("gemm_square", lambda: torch.matmul(A2, A2), extra={"flops": 2.0 * b * m**3}),
        Case("gemm_apply", lambda: torch.matmul(A2, Y2), extra={"flops": gram_flops}),
        Case(
            "kernel_gram",
            lambda: kernels.gram(Y2),
            note=f"kernels.gram via {kernels.backend_for(Y2)}, plain flops",
            extra={"flops": gram_flops, "kernel": True},
        ),
    ]


def _candidates(
    X: Tensor, dtype: torch.dtype, steps: int, coefficients: str, path: str = ""
) -> list[Case]:
    Xn = X[0] if X.shape[0] == 1 else X

    def ours() -> Tensor:
        return newton_schulz(Xn, steps=steps, coefficients=coefficients, dtype=dtype)

    def plain() -> Tensor:
        with kernels.force_matmul():
            return newton_schulz(Xn, steps=steps, coefficients=coefficients, dtype=dtype)

    abc = COEFFICIENT_SETS["simple"][0]
    if dtype == torch.float32:
        zp: Callable[..., Tensor] = torch_zeropower_fp32
        torch_note = "torch.optim.Muon's Newton-Schulz made float32 (torch hard-codes bfloat16)"
    else:
        zp = torch_muon_newton_schulz()
        torch_note = "torch.optim.Muon's Newton-Schulz (bfloat16, as shipped)"

    def torch_muon() -> list[Tensor]:
        return [zp(x, abc, steps, 1e-7) for x in X.to(dtype)]

    return [
        Case("orthoptim", ours, note=f"kernels: {path or kernels.backend_for(X.to(dtype))}"),
        Case(BASELINE, plain, note="same newton_schulz, matmul path forced"),
        Case("torch_muon", torch_muon, note=torch_note, extra={"peer": True}),
        *_peer_cases(X, dtype, steps, coefficients),
    ]


def run(
    shapes: list[tuple[int, int, int]],
    dtypes: list[torch.dtype],
    device: torch.device,
    repeats: int,
    warmup: int,
    steps: int = NS_STEPS,
    coefficients: str = "quintic",
    bf16_shrink: int = 1,
    bf16_repeats: int | None = None,
    peak: dict[str, Any] | None = None,
    skip: str = "",
) -> dict[str, Any]:
    """Benchmark every (shape, dtype); return the report (see `orthoptim bench ns --json`).

    With `peak` (`measure_matmul_peak`'s result) each timed row also gets its effective
    TFLOP/s and fraction of that peak; without, the per-shape GEMM rate is the only reference.
    """
    results = []
    gen = torch.Generator().manual_seed(0)
    for dtype in dtypes:
        low = dtype in (torch.bfloat16, torch.float16)
        for batch, rows, cols in shapes:
            shrink = bf16_shrink if low else 1
            r, c = max(1, rows // shrink), max(1, cols // shrink)
            X = torch.randn(batch, r, c, generator=gen).to(device)
            paths = kernel_paths([(batch, r, c)], dtype, device)
            path = paths[0].get("path") or paths[0].get("backend", "")
            cases = _candidates(X, dtype, steps, coefficients, path) + _gemm_cases(X, dtype)
            reps = min(repeats, bf16_repeats) if low and bf16_repeats else repeats
            warm = 0 if low and bf16_repeats else warmup
            times = time_side_by_side(cases, device, reps, warm, skip)
            rows_out = summarize(cases, times, BASELINE)
            flops = batch * ns_flops(r, c, steps)
            gemm_rates = [
                row["flops"] / row["median_s"] / 1e9
                for row in rows_out
                if "flops" in row and not row.get("kernel")
            ]
            matmul = max(gemm_rates)
            for row in rows_out:
                if "median_s" not in row:
                    continue
                if "flops" in row:
                    row["gflops"] = row["flops"] / row["median_s"] / 1e9
                else:
                    row["effective_gflops"] = flops / row["median_s"] / 1e9
                    row["fraction_of_matmul"] = row["effective_gflops"] / matmul
                if peak is not None:
                    row.update(rate_against_peak(row.get("flops", flops), row["median_s"], peak))
            results.append(
                {
                    "shape": [batch, r, c],
                    "requested_shape": [batch, rows, cols],
                    "dtype": str(dtype).removeprefix("torch."),
                    "repeats": reps,
                    "plain_flops": flops,
                    "matmul_gflops": matmul,
                    "kernel_paths": paths,
                    "cases": rows_out,
                }
            )
    return {
        "benchmark": "ns",
        "baseline": BASELINE,
        "steps": steps,
        "coefficients": coefficients,
        "device": str(device),
        "kernel_mode": kernels.kernel_mode(),
        "environment": environment(),
        "matmul_peak": peak,
        "results": results,
    }


def render(report: dict[str, Any]) -> str:
    """A text table per (shape, dtype)."""
    lines = [
        f"Newton-Schulz, {report['steps']} steps ({report['coefficients']}), "
        f"{report['device']}, {report['environment']['threads']} threads; "
        f"speedup = {report['baseline']} time / case time (median)"
    ]
    peak = report.get("matmul_peak")
    if peak:
        lines.append(
            f"{describe_peak(peak)}; effective TFLOP/s = plain-matmul Newton-Schulz flops / time"
        )
    for res in report["results"]:
        shape = "x".join(map(str, res["shape"]))
        asked = "x".join(map(str, res["requested_shape"]))
        scaled = "" if shape == asked else f" (scaled down from {asked})"
        lines.append(
            f"\n{shape} {res['dtype']}{scaled}, {res['repeats']} repeats, "
            f"matmul {res['matmul_gflops']:.1f} GFLOP/s"
        )
        lines += describe_kernel_paths(res.get("kernel_paths", []))
        for row in res["cases"]:
            if "skipped" in row:
                lines.append(f"  {row['name']:<25} skipped: {row['skipped']}")
            elif "flops" in row:
                rate = (
                    f"{row['effective_tflops']:7.1f} TFLOP/s "
                    f"({100 * row['fraction_of_peak']:.0f}% of peak)"
                    if peak
                    else f"{row['gflops']:7.1f} GFLOP/s"
                )
                lines.append(
                    f"  {row['name']:<25} {row['median_s'] * 1e3:9.2f} ms  {rate}  {row['note']}"
                )
            else:
                rate = (
                    f"{row['effective_tflops']:7.1f} TFLOP/s ({100 * row['fraction_of_peak']:.0f}% "
                    f"of peak, {100 * row['fraction_of_matmul']:.0f}% of matmul)"
                    if peak
                    else f"{row['effective_gflops']:7.1f} GFLOP/s "
                    f"({100 * row['fraction_of_matmul']:.0f}% of matmul)"
                )
                lines.append(
                    f"  {row['name']:<25} {row['median_s'] * 1e3:9.2f} ms  "
                    f"x{row['speedup_vs_baseline']:.2f}  {rate}  {row['note']}"
                )
    return "\n".join(lines)


def _cmd(args: argparse.Namespace) -> int:
    device = setup_device(args)
    if args.coefficients not in COEFFICIENT_SETS:
        raise SystemExit(
            f"--coefficients: unknown set {args.coefficients!r}; choose from "
            f"{', '.join(sorted(COEFFICIENT_SETS))}"
        )
    if args.steps < 1:
        raise SystemExit(f"--steps must be >= 1, got {args.steps}")
    shrink = (
        args.bf16_shrink if args.bf16_shrink is not None else (4 if device.type == "cpu" else 1)
    )
    if shrink < 1:
        raise SystemExit(f"--bf16-shrink must be >= 1, got {shrink}")
    shapes, dtypes = args.shapes, parse_dtypes(args.dtypes)
    with thread_count(args.threads):
        peak = matmul_peak(args, device)
        report = run(
            shapes,
            dtypes,
            device,
            args.repeats,
            args.warmup,
            steps=args.steps,
            coefficients=args.coefficients,
            bf16_shrink=shrink,
            bf16_repeats=args.bf16_repeats if device.type == "cpu" else None,
            peak=peak,
            skip=args.skip,
        )
    emit(report, args.json, render)
    return 0


def add_parser(bench_subparsers: argparse._SubParsersAction) -> None:
    """Register `orthoptim bench ns`."""
    p = bench_subparsers.add_parser(
        "ns", help="Newton-Schulz: ours vs plain matmul vs torch.optim.Muon vs peers"
    )
    add_common_arguments(p, repeats=5)
    add_peak_argument(p)
    add_skip_argument(p)
    p.add_argument(
        "--shapes", type=parse_shapes, default=DEFAULT_SHAPES, help=f"default {DEFAULT_SHAPES}"
    )
    p.add_argument("--dtypes", default="float32,bfloat16", help="default float32,bfloat16")
    p.add_argument(
        "--steps",
        type=int,
        default=NS_STEPS,
        help=f"Newton-Schulz iterations (default {NS_STEPS})",
    )
    p.add_argument(
        "--coefficients",
        default="quintic",
        help="orthoptim's coefficient set (simple, quintic, polar_express, cubic; default quintic)",
    )
    p.add_argument(
        "--bf16-shrink",
        type=int,
        default=None,
        help="divide rows and cols by this for bfloat16/float16 (default 4 on cpu, where bf16 "
        "matmul is ~50x slower than float32; 1 on cuda)",
    )
    p.add_argument(
        "--bf16-repeats",
        type=int,
        default=1,
        help="on cpu: at most this many repeats and no warm-up for bfloat16 (default 1)",
    )
    p.set_defaults(func=_cmd)
