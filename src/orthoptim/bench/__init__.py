"""Benchmark helpers shared by every `orthoptim bench` module.

The rules: candidates are timed side by side in one process (round-robin, so load on a
shared machine hits them alike), each figure is the median of repeats, and results are
reported as ratios to a named baseline. `--json` prints one machine-readable document.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import inspect
import json
import math
import statistics
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any

import torch

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float64": torch.float64}


@dataclass
class Case:
    """One candidate: `run()` is timed; `skip` (a reason) marks it unavailable here."""

    name: str
    run: Callable[[], object] | None = None
    note: str = ""
    skip: str | None = None
    setup: Callable[[], None] | None = None
    extra: dict[str, Any] = field(default_factory=dict)


def add_common_arguments(parser: argparse.ArgumentParser, repeats: int, warmup: int = 1) -> None:
    """The options every benchmark shares: --device, --repeats, --warmup, --threads, --json."""
    parser.add_argument("--device", default="cpu", help="cpu or cuda (default cpu)")
    parser.add_argument(
        "--repeats", type=int, default=repeats, help=f"timed repeats per case (default {repeats})"
    )
    parser.add_argument(
        "--warmup", type=int, default=warmup, help=f"untimed runs per case first ({warmup})"
    )
    parser.add_argument(
        "--threads", type=int, default=None, help="torch intra-op threads (default: torch's)"
    )
    parser.add_argument("--json", action="store_true", help="print one JSON document")


def setup_device(args: argparse.Namespace) -> torch.device:
    """Validate --device/--repeats/--warmup/--threads (apply --threads with `thread_count`)."""
    if args.repeats < 1:
        raise SystemExit(f"--repeats must be >= 1, got {args.repeats}")
    if args.warmup < 0:
        raise SystemExit(f"--warmup must be >= 0, got {args.warmup}")
    if args.threads is not None and args.threads < 1:
        raise SystemExit(f"--threads must be >= 1, got {args.threads}")
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda was given but torch sees no CUDA device; use --device cpu")
    if device.type not in ("cpu", "cuda"):
        raise SystemExit(f"--device must be cpu or cuda, got {args.device!r}")
    return device


@contextlib.contextmanager
def thread_count(threads: int | None) -> Iterator[None]:
    """Run the block with `threads` intra-op threads (None: unchanged), then restore."""
    before = torch.get_num_threads()
    if threads is not None:
        torch.set_num_threads(threads)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def parse_shapes(text: str, batched: bool = True) -> list[tuple[int, ...]]:
    """`--shapes` as an argparse type: '1024x4096,8x768x3072' → [(batch, rows, cols)] (batch 1
    when omitted), or with `batched` False 'ROWSxCOLS,...' → [(rows, cols)]. A bad item is an
    ArgumentTypeError naming it and the fix (argparse exits 2 naming --shapes)."""
    form = "ROWSxCOLS or BATCHxROWSxCOLS" if batched else "ROWSxCOLS"
    shapes: list[tuple[int, ...]] = []
    for item in (s.strip() for s in text.split(",") if s.strip()):
        try:
            dims = tuple(int(d) for d in item.lower().split("x"))
        except ValueError:
            dims = ()
        if len(dims) not in ((2, 3) if batched else (2,)):
            raise argparse.ArgumentTypeError(f"{item!r} is not {form}")
        if min(dims) < 1:
            raise argparse.ArgumentTypeError(f"{item!r}: every size must be >= 1")
        shapes.append((1, *dims) if batched and len(dims) == 2 else dims)
    if not shapes:
        raise argparse.ArgumentTypeError(f"name at least one shape ({form})")
    return shapes


def parse_sizes(text: str) -> list[int]:
    """`--nproc`-style sizes as an argparse type: '2,4' → [2, 4] (argparse names the flag)."""
    try:
        return [int(s) for s in text.split(",") if s.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"takes sizes like 2,4, got {text!r}") from None


def parse_dtypes(text: str) -> list[torch.dtype]:
    """'float32,bfloat16' → dtypes, with a clear error naming the bad entry."""
    out = []
    for name in (t.strip() for t in text.split(",") if t.strip()):
        if name not in DTYPES:
            raise SystemExit(f"--dtypes: unknown dtype {name!r}; choose from {', '.join(DTYPES)}")
        out.append(DTYPES[name])
    if not out:
        raise SystemExit("--dtypes must name at least one dtype")
    return out


def synchronize(device: torch.device) -> None:
    """Wait for queued device work so wall-clock times are honest."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def add_skip_argument(parser: argparse.ArgumentParser) -> None:
    """--skip NAME[,NAME]: candidates to leave out of the run."""
    parser.add_argument(
        "--skip",
        default="",
        metavar="NAMES",
        help="comma-separated candidates to leave out (e.g. a peer whose first-call "
        "autotuning would not fit a time limit)",
    )


def time_side_by_side(
    cases: Sequence[Case],
    device: torch.device,
    repeats: int,
    warmup: int,
    skip: str = "",
    timer: Callable[[Callable[[], object]], float] | None = None,
) -> dict[str, list[float]]:
    """Seconds per run of each available case, timed round-robin (case order rotates).

    Peers (extra["peer"]) and cases marked extra["may_fail"] run once untimed even without
    warm-up; one that raises is marked skipped with the error instead of ending the
    benchmark. `skip` (--skip) names cases to leave out, comma-separated; a name that is no
    case is refused with the case names. `timer(run)` gives one sample in seconds (e.g. CUDA
    events over many calls); by default one call between device synchronizations.
    """
    left_out = {n.strip() for n in skip.split(",") if n.strip()}
    unknown = left_out - {c.name for c in cases}
    if unknown:
        raise SystemExit(
            f"--skip: no candidate named {', '.join(sorted(unknown))}; candidates: "
            f"{', '.join(c.name for c in cases)}"
        )
    for c in cases:
        if c.name in left_out and c.skip is None:
            c.skip = "left out with --skip"
    live = [c for c in cases if c.skip is None and c.run is not None]
    for c in list(live):
        may_fail = c.extra.get("peer") or c.extra.get("may_fail")
        for _ in range(max(warmup, 1 if may_fail else 0)):
            if c.setup is not None:
                c.setup()
            try:
                c.run()
            except Exception as exc:
                if not may_fail:
                    raise
                # an outside implementation (or a kernel config) failing here is a result to
                # report, not a crash
                c.skip = f"failed here: {type(exc).__name__}: {exc}"[:300]
                live.remove(c)
                break
    synchronize(device)
    times: dict[str, list[float]] = {c.name: [] for c in live}
    for r in range(repeats):
        order = live[r % len(live) :] + live[: r % len(live)] if live else []
        for c in order:
            if c.setup is not None:
                c.setup()
            if timer is not None:
                times[c.name].append(timer(c.run))
                continue
            synchronize(device)
            start = time.perf_counter()
            c.run()
            synchronize(device)
            times[c.name].append(time.perf_counter() - start)
    return times


def summarize(
    cases: Sequence[Case], times: dict[str, list[float]], baseline: str
) -> list[dict[str, Any]]:
    """Per case: median seconds and speedup = baseline median / case median (> 1: faster)."""
    base = statistics.median(times[baseline]) if times.get(baseline) else math.nan
    rows = []
    for c in cases:
        row: dict[str, Any] = {"name": c.name, "note": c.note, **c.extra}
        if c.name in times:
            med = statistics.median(times[c.name])
            row.update(median_s=med, times_s=times[c.name], speedup_vs_baseline=base / med)
        else:
            row.update(skipped=c.skip or "not run")
        rows.append(row)
    return rows


def add_peak_argument(parser: argparse.ArgumentParser) -> None:
    """--peak-size: the bf16 matmul whose measured rate effective TFLOP/s are set against."""
    parser.add_argument(
        "--peak-size",
        type=int,
        default=None,
        help="measure the bfloat16 matmul peak once on an NxNxN product and report each "
        "candidate's effective TFLOP/s and fraction of it (default 8192 on cuda, off on cpu; "
        "0 turns it off)",
    )


def measure_matmul_peak(
    device: torch.device, size: int, repeats: int = 10, dtype: torch.dtype = torch.bfloat16
) -> dict[str, Any]:
    """Best rate of a size×size×size matmul on `device`, in TFLOP/s.

    Measured, not taken from a data sheet, so that a fraction of it says how much of what
    this device, driver and torch deliver a candidate reaches.
    """
    a = torch.randn(size, size, device=device, dtype=dtype)
    b = torch.randn(size, size, device=device, dtype=dtype)
    out = torch.empty_like(a)
    for _ in range(3):  # library selection and clocks settle before timing
        torch.matmul(a, b, out=out)
    best = math.inf
    for _ in range(repeats):
        synchronize(device)
        start = time.perf_counter()
        torch.matmul(a, b, out=out)
        synchronize(device)
        best = min(best, time.perf_counter() - start)
    flops = 2.0 * size**3
    return {
        "size": size,
        "dtype": str(dtype).removeprefix("torch."),
        "repeats": repeats,
        "flops": flops,
        "best_s": best,
        "tflops": flops / best / 1e12,
    }


def matmul_peak(args: argparse.Namespace, device: torch.device) -> dict[str, Any] | None:
    """The run's peak from --peak-size (default 8192 on CUDA, none on CPU), measured once."""
    size = args.peak_size if args.peak_size is not None else (8192 if device.type == "cuda" else 0)
    if size < 0:
        raise SystemExit(f"--peak-size must be >= 0, got {size}")
    return measure_matmul_peak(device, size) if size else None


def describe_peak(peak: dict[str, Any]) -> str:
    """One line naming the measured peak, for the text tables."""
    n = peak["size"]
    return (
        f"matmul peak: {peak['tflops']:.1f} TFLOP/s, {peak['dtype']} {n}x{n}x{n} "
        f"(best of {peak['repeats']})"
    )


def rate_against_peak(flops: float, seconds: float, peak: dict[str, Any]) -> dict[str, float]:
    """Effective TFLOP/s of `flops` done in `seconds`, and its fraction of the measured peak."""
    tflops = flops / seconds / 1e12
    return {"effective_tflops": tflops, "fraction_of_peak": tflops / peak["tflops"]}


def import_optional(module: str) -> tuple[ModuleType | None, str | None]:
    """Import a peer that is not a dependency; return (module, None) or (None, reason)."""
    try:
        return importlib.import_module(module), None
    except Exception as exc:  # a peer may fail on import for many reasons; report which
        return None, f"{module} does not import here ({type(exc).__name__}: {exc})"[:300]


# GPUs on which Emerging-Optimizers' Muon keeps use_syrk=True (elsewhere it turns it off).
EMERGING_SYRK_SM = ((8, 0), (9, 0), (10, 0), (10, 3))
DION_HINT = "dion is not on PyPI: install it (github.com/microsoft/dion) to time it"


def emerging_syrk_skip(device: torch.device) -> str | None:
    """Why Emerging-Optimizers' use_syrk path cannot run on `device`; None when it can."""
    if device.type != "cuda":
        return "use_syrk is CUDA-only: it runs Emerging-Optimizers' Triton tsyrk_ex kernel"
    if not torch.cuda.is_available():
        return "use_syrk needs a CUDA device, and torch sees none here"
    kernels, reason = import_optional("emerging_optimizers.triton_kernels")
    if kernels is None:
        return reason
    if not getattr(kernels, "HAS_TRITON_340", False):
        return "use_syrk needs Triton >= 3.4 (tensor descriptors)"
    sm = torch.cuda.get_device_capability(device)
    if sm not in EMERGING_SYRK_SM:
        return f"Emerging-Optimizers turns use_syrk off on SM {sm[0]}.{sm[1]} (not validated there)"
    return None


def takes_argument(function: Callable[..., Any], name: str) -> bool:
    """Whether `function` (or a class's constructor) has a parameter `name`."""
    return name in inspect.signature(function).parameters


def torch_zeropower_fp32(
    grad: torch.Tensor, ns_coefficients: tuple[float, float, float], ns_steps: int, eps: float
) -> torch.Tensor:
    """torch.optim.Muon's Newton-Schulz line for line, with float32 in place of bfloat16."""
    a, b, c = ns_coefficients
    ortho_grad = grad.float()
    if grad.size(0) > grad.size(1):
        ortho_grad = ortho_grad.T
    ortho_grad.div_(ortho_grad.norm().clamp(min=eps))
    for _ in range(ns_steps):
        gram_matrix = ortho_grad @ ortho_grad.T
        gram_update = torch.addmm(gram_matrix, gram_matrix, gram_matrix, beta=b, alpha=c)
        ortho_grad = torch.addmm(ortho_grad, gram_update, ortho_grad, beta=a)
    if grad.size(0) > grad.size(1):
        ortho_grad = ortho_grad.T
    return ortho_grad


@contextlib.contextmanager
def torch_muon_fp32() -> Iterator[Callable[..., Any]]:
    """Make torch.optim.Muon orthogonalize in float32 (it hard-codes bfloat16) in the block.

    Yields the float32 function. bfloat16 matmul is ~50× slower than float32 on CPUs without
    native bf16, so a comparison against the unpatched optimizer would say nothing.
    """
    from orthoptim._torch_compat import torch_muon_newton_schulz_replaced

    with torch_muon_newton_schulz_replaced(torch_zeropower_fp32):
        yield torch_zeropower_fp32


def emit(report: dict[str, Any], as_json: bool, render: Callable[[dict[str, Any]], str]) -> None:
    """Print the report as JSON or as the benchmark's text table."""
    if as_json:
        print(json.dumps(report, indent=2, default=str))
    else:
        print(render(report))


def environment() -> dict[str, Any]:
    """What the figures were measured on."""
    return {
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "cuda": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
    }


def kernel_paths(
    shapes: Sequence[tuple[int, ...]],
    dtype: torch.dtype,
    device: torch.device,
    remeasure: bool = False,
) -> list[dict[str, Any]]:
    """Which path serves Newton-Schulz on each distinct shape ([batch,] rows, cols) and why,
    decided here, before any timing, so a first-sight race never lands in a timed call.

    On CPU `kernels.path_for` on a random matrix of the shape as Newton-Schulz iterates on it
    (rows <= columns, one matrix at a time): measured / cached / default / forced / not raced,
    with the timings of the race (`remeasure`: race again and rewrite the cache entry). On
    CUDA the per-product dispatch (`kernels.backend_for`, choices from `kernels.tuning`).
    """
    from orthoptim import kernels
    from orthoptim.kernels import calibration

    found: list[dict[str, Any]] = []
    seen: set[tuple[int, int, int]] = set()
    gen = torch.Generator().manual_seed(0)
    for shape in shapes:
        *lead, rows, cols = shape
        batch = math.prod(lead) if device.type == "cuda" else 1  # CPU iterates one by one
        key = (batch, min(rows, cols), max(rows, cols))
        if key in seen:
            continue
        seen.add(key)
        Z = torch.randn(*key, generator=gen).to(device=device, dtype=dtype)
        Z = Z[0] if batch == 1 else Z
        Z /= torch.linalg.matrix_norm(Z.float(), keepdim=True).to(dtype)
        if device.type != "cpu":
            backend = kernels.backend_for(Z)
            line = (
                f"{'x'.join(map(str, key[1:] if batch == 1 else key))} "
                f"{str(dtype).removeprefix('torch.')}: {backend} (per product: "
                "a kernels.tuning table, ORTHOPTIM_SYRK_TUNE, else torch's product)"
            )
            found.append({"shape": list(key), "backend": backend, "line": line})
            continue
        if remeasure and kernels.kernel_mode() == "auto":
            d = calibration.CALIBRATOR.decide(Z, remeasure=True)
        else:
            d = kernels.path_for(Z)
        found.append(
            {
                "shape": list(d.shape),
                "dtype": d.dtype,
                "path": d.path,
                "reason": d.reason,
                "ms": d.ms,
                "seconds": d.seconds,
                "line": d.describe(),
            }
        )
    return found


def describe_kernel_paths(paths: Sequence[dict[str, Any]]) -> list[str]:
    """The text lines of `kernel_paths`' result."""
    if not paths:
        return []
    from orthoptim.kernels import calibration

    return [
        "kernel paths (Newton-Schulz per shape; measured = raced here, cached = "
        f"{calibration.cache_path()}, default = the plain product):",
        *(f"  {p['line']}" for p in paths),
    ]
