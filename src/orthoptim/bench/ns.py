"""`orthoptim bench ns`: Newton-Schulz speed, ours against plain matmul and the peers.

Per shape and dtype, timed side by side: `orthoptim` (kernels dispatch), `matmul_ns` (the
same function with the matmul path forced: the baseline), torch.optim.Muon's
orthogonalization (made float32 for float32 rows: it hard-codes bfloat16), and the peers
emerging-optimizers and heavyball where they import. The three GEMMs of a plain step are
timed alone too: their best GFLOP/s is the machine's matmul rate at that size, against
which each candidate's effective GFLOP/s (plain-matmul flops / time) is set.
"""

from __future__ import annotations

import argparse
import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import Tensor

from orthoptim import kernels
from orthoptim.bench import (
    Case,
    add_common_arguments,
    emit,
    environment,
    import_optional,
    parse_dtypes,
    setup_device,
    summarize,
    thread_count,
    time_side_by_side,
    torch_zeropower_fp32,
)
from orthoptim.newton_schulz import COEFFICIENT_SETS, newton_schulz

DEFAULT_SHAPES = "1024x1024,1024x4096,4096x1024,8x768x3072"
BASELINE = "matmul_ns"
HEAVYBALL_BF16 = (
    "heavyball's Newton-Schulz rounds its input to bfloat16 (float64 excepted): "
    "timed in the bfloat16 rows only"
)


def parse_shapes(text: str) -> list[tuple[int, int, int]]:
    """'1024x4096,8x768x3072' → [(batch, rows, cols)] (batch 1 when omitted)."""
    shapes = []
    for item in (s.strip() for s in text.split(",") if s.strip()):
        try:
            dims = [int(d) for d in item.lower().split("x")]
        except ValueError:
            dims = []
        if len(dims) not in (2, 3) or min(dims) < 1:
            raise SystemExit(f"--shapes: {item!r} is not ROWSxCOLS or BATCHxROWSxCOLS")
        shapes.append((1, *dims) if len(dims) == 2 else tuple(dims))  # type: ignore[arg-type]
    if not shapes:
        raise SystemExit("--shapes must name at least one shape")
    return shapes


def ns_flops(batch: int, rows: int, cols: int, steps: int) -> float:
    """Flops of a plain-matmul Newton-Schulz: per step 4m²n + 2m³ with m = min, n = max."""
    m, n = min(rows, cols), max(rows, cols)
    return float(batch * steps * (4 * m * m * n + 2 * m**3))


@contextlib.contextmanager
def float32_matmul_precision(precision: str) -> Iterator[None]:
    """torch.set_float32_matmul_precision within the block."""
    before = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision(precision)
    try:
        yield
    finally:
        torch.set_float32_matmul_precision(before)


def _peer_cases(X: Tensor, dtype: torch.dtype, steps: int, coefficients: str) -> list[Case]:
    cases = []
    eo, reason = import_optional("emerging_optimizers.orthogonalized_optimizers.muon_utils")
    if eo is not None and not hasattr(eo, "newton_schulz"):
        eo, reason = None, "emerging_optimizers has no muon_utils.newton_schulz here"
    if eo is None:
        cases.append(Case("emerging_optimizers", skip=reason))
    else:
        Xf = X.float()  # it takes float32 only; bfloat16 comes from torch's matmul precision
        precision = "highest" if dtype == torch.float32 else "medium"

        def emerging() -> Tensor:
            with float32_matmul_precision(precision):
                return eo.newton_schulz(Xf, steps=steps, coefficient_type=coefficients)

        cases.append(
            Case(
                "emerging_optimizers",
                emerging,
                note=f"muon_utils.newton_schulz, float32 input, matmul precision {precision!r}",
                extra={"peer": True},
            )
        )
    hb, reason = import_optional("heavyball.utils")
    if hb is not None and not hasattr(hb, "zeropower_via_newtonschulz5"):
        hb, reason = None, "heavyball has no utils.zeropower_via_newtonschulz5 here"
    if hb is not None and dtype != torch.bfloat16:
        hb, reason = None, HEAVYBALL_BF16
    if hb is None:
        cases.append(Case("heavyball", skip=reason))
    else:
        if hasattr(hb, "compile_mode"):
            hb.compile_mode = None  # its first compiled call takes ~25 s on CPU
        Xb = X.to(dtype)
        cases.append(
            Case(
                "heavyball",
                lambda: hb.zeropower_via_newtonschulz5(Xb),
                note="utils.zeropower_via_newtonschulz5 in bfloat16",
                extra={"peer": True},
            )
        )
    return cases


def _gemm_cases(X: Tensor, dtype: torch.dtype) -> list[Case]:
    """The three products of a plain step, alone: X·Xᵀ, A·A, B·X."""
    Y = X.to(dtype)
    if Y.shape[-2] > Y.shape[-1]:
        Y = Y.mT.contiguous()
    b, m, n = Y.shape
    A = torch.randn(b, m, m, dtype=dtype, device=Y.device)
    Y2, A2 = (Y[0], A[0]) if b == 1 else (Y, A)
    return [
        Case("gemm_gram", lambda: torch.matmul(Y2, Y2.mT), extra={"flops": 2.0 * b * m * m * n}),
        Case("gemm_square", lambda: torch.matmul(A2, A2), extra={"flops": 2.0 * b * m**3}),
        Case("gemm_apply", lambda: torch.matmul(A2, Y2), extra={"flops": 2.0 * b * m * m * n}),
    ]


def _candidates(X: Tensor, dtype: torch.dtype, steps: int, coefficients: str) -> list[Case]:
    Xn = X[0] if X.shape[0] == 1 else X

    def ours() -> Tensor:
        return newton_schulz(Xn, steps=steps, coefficients=coefficients, dtype=dtype)

    def plain() -> Tensor:
        with kernels.force_matmul():
            return newton_schulz(Xn, steps=steps, coefficients=coefficients, dtype=dtype)

    from torch.optim import _muon

    abc = COEFFICIENT_SETS["simple"][0]
    if dtype == torch.float32:
        zp: Callable[..., Tensor] = torch_zeropower_fp32
        torch_note = "torch.optim.Muon's Newton-Schulz made float32 (torch hard-codes bfloat16)"
    else:
        zp = _muon._zeropower_via_newtonschulz
        torch_note = "torch.optim.Muon's Newton-Schulz (bfloat16, as shipped)"

    def torch_muon() -> list[Tensor]:
        return [zp(x, abc, steps, 1e-7) for x in X.to(dtype)]

    return [
        Case("orthoptim", ours, note=f"kernels: {kernels.backend_for(X.to(dtype))}"),
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
    steps: int = 5,
    coefficients: str = "quintic",
    bf16_shrink: int = 1,
    bf16_repeats: int | None = None,
) -> dict[str, Any]:
    """Benchmark every (shape, dtype); return the report (see `orthoptim bench ns --json`)."""
    results = []
    gen = torch.Generator().manual_seed(0)
    for dtype in dtypes:
        low = dtype in (torch.bfloat16, torch.float16)
        for batch, rows, cols in shapes:
            shrink = bf16_shrink if low else 1
            r, c = max(1, rows // shrink), max(1, cols // shrink)
            X = torch.randn(batch, r, c, generator=gen).to(device)
            cases = _candidates(X, dtype, steps, coefficients) + _gemm_cases(X, dtype)
            reps = min(repeats, bf16_repeats) if low and bf16_repeats else repeats
            times = time_side_by_side(cases, device, reps, 0 if low and bf16_repeats else warmup)
            rows_out = summarize(cases, times, BASELINE)
            flops = ns_flops(batch, r, c, steps)
            gemm_rates = [
                row["flops"] / row["median_s"] / 1e9 for row in rows_out if "flops" in row
            ]
            peak = max(gemm_rates)
            for row in rows_out:
                if "median_s" in row and "flops" not in row:
                    row["effective_gflops"] = flops / row["median_s"] / 1e9
                    row["fraction_of_matmul"] = row["effective_gflops"] / peak
                elif "flops" in row:
                    row["gflops"] = row["flops"] / row["median_s"] / 1e9
            results.append(
                {
                    "shape": [batch, r, c],
                    "requested_shape": [batch, rows, cols],
                    "dtype": str(dtype).removeprefix("torch."),
                    "repeats": reps,
                    "plain_flops": flops,
                    "matmul_gflops": peak,
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
        "results": results,
    }


def render(report: dict[str, Any]) -> str:
    """A text table per (shape, dtype)."""
    lines = [
        f"Newton-Schulz, {report['steps']} steps ({report['coefficients']}), "
        f"{report['device']}, {report['environment']['threads']} threads; "
        f"speedup = {report['baseline']} time / case time (median)"
    ]
    for res in report["results"]:
        shape = "x".join(map(str, res["shape"]))
        asked = "x".join(map(str, res["requested_shape"]))
        scaled = "" if shape == asked else f" (scaled down from {asked})"
        lines.append(
            f"\n{shape} {res['dtype']}{scaled}, {res['repeats']} repeats, "
            f"matmul {res['matmul_gflops']:.1f} GFLOP/s"
        )
        for row in res["cases"]:
            if "skipped" in row:
                lines.append(f"  {row['name']:<20} skipped: {row['skipped']}")
            elif "flops" in row:
                lines.append(
                    f"  {row['name']:<20} {row['median_s'] * 1e3:9.2f} ms  "
                    f"{row['gflops']:7.1f} GFLOP/s"
                )
            else:
                lines.append(
                    f"  {row['name']:<20} {row['median_s'] * 1e3:9.2f} ms  "
                    f"x{row['speedup_vs_baseline']:.2f}  {row['effective_gflops']:7.1f} GFLOP/s "
                    f"({100 * row['fraction_of_matmul']:.0f}% of matmul)  {row['note']}"
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
    shapes, dtypes = parse_shapes(args.shapes), parse_dtypes(args.dtypes)
    with thread_count(args.threads):
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
        )
    emit(report, args.json, render)
    return 0


def add_parser(bench_subparsers: argparse._SubParsersAction) -> None:
    """Register `orthoptim bench ns`."""
    p = bench_subparsers.add_parser(
        "ns", help="Newton-Schulz: ours vs plain matmul vs torch.optim.Muon vs peers"
    )
    add_common_arguments(p, repeats=5)
    p.add_argument("--shapes", default=DEFAULT_SHAPES, help=f"default {DEFAULT_SHAPES}")
    p.add_argument("--dtypes", default="float32,bfloat16", help="default float32,bfloat16")
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--coefficients", default="quintic")
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
