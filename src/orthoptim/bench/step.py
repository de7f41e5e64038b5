"""`orthoptim bench step`: one whole optimizer step over the matrices of a GPT.

The parameter set is a `--layers`-layer, width-`--width` GPT's matrices (per layer four
attention width×width, the MLP's 4·width×width and width×4·width), float32, with fixed
random gradients. Each candidate owns a copy of the parameters and its optimizer; their
`step()` calls are timed side by side.

`--optimizer` picks a suite of candidates from SUITES (muon by default). A suite is a
function (args) → list[StepCandidate] plus the name of its baseline; add one with
`register_suite` from the module that implements the optimizer.

On CUDA (or with --peak-size) a large bf16 matmul is timed once per run, and each candidate
of a suite that counts its flops (muon: plain-matmul Newton-Schulz of every matrix) gets its
effective TFLOP/s and the fraction of that measured peak.
"""

from __future__ import annotations

import argparse
import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

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
    rate_against_peak,
    setup_device,
    summarize,
    takes_argument,
    thread_count,
    time_side_by_side,
    torch_muon_fp32,
)
from orthoptim.newton_schulz import resolve_ns_dtype
from orthoptim.ns_cost import NS_STEPS, ns_flops

Params = list[torch.nn.Parameter]
Builder = Callable[[Params], torch.optim.Optimizer]


@dataclass
class StepCandidate:
    """An optimizer to time: `build(params)` makes it; `skip` says why it cannot run here.

    `peer` marks an outside implementation of the suite's optimizer (for the headline
    "ours vs the fastest peer"); `ours` marks the orthoptim implementation.
    """

    name: str
    build: Builder | None = None
    note: str = ""
    skip: str | None = None
    peer: bool = False
    ours: bool = False
    wrap: Callable[[Callable[[], object]], Callable[[], object]] | None = None
    counts_flops: bool = True  # the suite's flop count is this candidate's work (not AdamW's)


@dataclass
class Suite:
    """The candidates of one `--optimizer` choice, the name of its baseline, and optionally
    `flops(shapes)`: the work of one step, against which effective TFLOP/s are reported."""

    candidates: Callable[[argparse.Namespace], list[StepCandidate]]
    baseline: str
    flops: Callable[[Sequence[tuple[int, int]]], float] | None = None


SUITES: dict[str, Suite] = {}


def register_suite(
    name: str,
    candidates: Callable[[argparse.Namespace], list[StepCandidate]],
    baseline: str,
    flops: Callable[[Sequence[tuple[int, int]]], float] | None = None,
) -> None:
    """Make `orthoptim bench step --optimizer NAME` time `candidates(args)`."""
    SUITES[name] = Suite(candidates, baseline, flops)


def gpt_matrix_shapes(layers: int, width: int) -> list[tuple[int, int]]:
    """(rows, cols) of every matrix of a GPT's blocks, as nn.Linear stores them (out, in)."""
    per_layer = [(width, width)] * 4 + [(4 * width, width), (width, 4 * width)]
    return per_layer * layers


def _torch_muon_fp32_step(run: Callable[[], object]) -> Callable[[], object]:
    def wrapped() -> object:
        with torch_muon_fp32():
            return run()

    return wrapped


def adamw_candidates() -> list[StepCandidate]:
    """torch.optim.AdamW, fused where torch offers it, and foreach."""
    out = []
    for impl in ("fused", "foreach"):
        out.append(
            StepCandidate(
                f"torch_adamw_{impl}",
                lambda ps, impl=impl: torch.optim.AdamW(ps, lr=1e-3, **{impl: True}),
                note=f"torch.optim.AdamW({impl}=True)",
                counts_flops=False,
            )
        )
    return out


def muon_candidates(args: argparse.Namespace) -> list[StepCandidate]:
    """orthoptim Muon (default dtype, kernels and forced matmul; on CUDA also explicit bf16 and
    fp32 Newton-Schulz), torch.optim.Muon, peers, AdamW.

    On CPU the peers run float32 (torch.optim.Muon patched, Emerging-Optimizers asked for it):
    their bf16 is ~50x slower there. On CUDA every peer runs as shipped (bf16 Newton-Schulz).
    """
    from orthoptim import kernels
    from orthoptim.optim.muon import Muon

    cuda = args.device != "cpu"

    def forced(run: Callable[[], object]) -> Callable[[], object]:
        def wrapped() -> object:
            with kernels.force_matmul():
                return run()

        return wrapped

    cands = [
        StepCandidate("orthoptim_muon", lambda ps: Muon(ps, lr=0.02), ours=True),
        StepCandidate(
            "orthoptim_muon_matmul",
            lambda ps: Muon(ps, lr=0.02),
            note="kernels forced to plain matmul",
            wrap=forced,
        ),
    ]
    if cuda:
        cands += [
            StepCandidate(
                f"orthoptim_muon_{name}",
                lambda ps, dtype=dtype: Muon(ps, lr=0.02, ns_dtype=dtype),
                note=f"ns_dtype=torch.{name}",
            )
            for name, dtype in (("bfloat16", torch.bfloat16), ("float32", torch.float32))
        ]
    cands.append(
        StepCandidate(
            "torch_muon",
            lambda ps: torch.optim.Muon(ps, lr=0.02),
            note="torch.optim.Muon as shipped (bfloat16 Newton-Schulz)"
            if cuda
            else "torch.optim.Muon with its Newton-Schulz made float32 (it hard-codes bfloat16)",
            peer=True,
            wrap=None if cuda else _torch_muon_fp32_step,
        )
    )
    return [
        *cands,
        *_emerging_candidates(cuda),
        _heavyball_candidate(args),
        *_dion_candidates(args),
        *adamw_candidates(),
    ]


def _bf16_on_cpu(what: str) -> str:
    return (
        f"{what}'s Newton-Schulz is bfloat16 by design, ~50x slower than float32 matmul on CPUs "
        "without bf16 units (minutes per step); --bf16-peers times it anyway"
    )


def _emerging_candidates(cuda: bool) -> list[StepCandidate]:
    """Emerging-Optimizers' Muon: bf16 Newton-Schulz on CUDA, float32 on CPU; and on CUDA its
    use_syrk option (Triton tsyrk_ex for both symmetric products)."""
    eo, reason = import_optional("emerging_optimizers.orthogonalized_optimizers")
    if eo is not None and not hasattr(eo, "Muon"):
        eo, reason = None, "emerging_optimizers has no orthogonalized_optimizers.Muon here"
    syrk_skip = emerging_syrk_skip(torch.device("cuda" if cuda else "cpu")) or reason
    if syrk_skip is None and not takes_argument(eo.Muon, "use_syrk"):
        syrk_skip = "this emerging_optimizers' Muon has no use_syrk option (0.3.0 has)"
    if eo is None:
        return [
            StepCandidate("emerging_optimizers_muon", skip=reason),
            StepCandidate("emerging_optimizers_muon_syrk", skip=syrk_skip),
        ]
    precision = "medium" if cuda else "highest"
    out = [
        StepCandidate(
            "emerging_optimizers_muon",
            lambda ps: eo.Muon(ps, lr=0.02, fp32_matmul_prec=precision),
            note=f"Muon(fp32_matmul_prec={precision!r}): "
            + ("bfloat16" if cuda else "float32")
            + " Newton-Schulz",
            peer=True,
        )
    ]
    if syrk_skip is not None:
        return [*out, StepCandidate("emerging_optimizers_muon_syrk", skip=syrk_skip)]
    return [
        *out,
        StepCandidate(
            "emerging_optimizers_muon_syrk",
            lambda ps: eo.Muon(ps, lr=0.02, fp32_matmul_prec="medium", use_syrk=True),
            note="Muon(fp32_matmul_prec='medium', use_syrk=True): bfloat16 Newton-Schulz, "
            "Triton tsyrk_ex for X·Xᵀ and b·A + c·A·A",
            peer=True,
        ),
    ]


def _heavyball_candidate(args: argparse.Namespace) -> StepCandidate:
    hb, reason = import_optional("heavyball")
    if hb is not None and not hasattr(hb, "Muon"):
        hb, reason = None, "heavyball has no Muon here"
    if hb is not None and args.device == "cpu" and not args.bf16_peers:
        hb, reason = None, _bf16_on_cpu("heavyball.Muon")
    if hb is None:
        return StepCandidate("heavyball_muon", skip=reason)
    hb_utils, _ = import_optional("heavyball.utils")
    if hb_utils is not None and hasattr(hb_utils, "compile_mode"):
        hb_utils.compile_mode = None  # compiling takes ~25 s on the first CPU step
    return StepCandidate(
        "heavyball_muon",
        lambda ps: hb.Muon(ps, lr=0.02),
        note="heavyball.Muon, compile off (Newton-Schulz in bfloat16 by design)",
        peer=True,
    )


# dion.Muon's settings timed: (name, keyword arguments, CUDA only, note).
DION_MUONS = (
    ("dion_muon", {}, False, "dion.Muon as shipped: Polar Express, torch.compile'd"),
    (
        "dion_muon_triton",
        {"use_triton": True},
        True,
        "dion.Muon(use_triton=True): Polar Express, Triton kernels for the symmetric products",
    ),
)


def _dion_candidates(args: argparse.Namespace) -> list[StepCandidate]:
    """dion's Muon in one process (distributed_mesh=None: no device mesh or process group)."""
    dion, reason = import_optional("dion")
    if dion is None:
        reason = f"{reason}; {DION_HINT}"
    elif not hasattr(dion, "Muon"):
        dion, reason = None, "dion has no Muon here"
    cpu = args.device == "cpu"
    out = []
    for name, kwargs, cuda_only, note in DION_MUONS:
        skip = reason
        if cuda_only and cpu:
            skip = "CUDA-only: dion's Triton kernels"
        elif cpu and not args.bf16_peers:
            skip = _bf16_on_cpu("dion.Muon")
        if skip is not None:
            out.append(StepCandidate(name, skip=skip))
            continue
        out.append(
            StepCandidate(
                name,
                lambda ps, kwargs=kwargs: dion.Muon(ps, lr=0.02, **kwargs),
                note=f"{note}; bfloat16 Newton-Schulz, distributed_mesh=None",
                peer=True,
            )
        )
    return out


def muon_step_flops(shapes: Sequence[tuple[int, int]]) -> float:
    """Plain-matmul flops of the default Newton-Schulz steps on every matrix: one Muon step's
    work."""
    return sum(ns_flops(rows, cols, NS_STEPS) for rows, cols in shapes)


register_suite("muon", muon_candidates, baseline="torch_muon", flops=muon_step_flops)


def soap_candidates(args: argparse.Namespace) -> list[StepCandidate]:
    """orthoptim SOAP refreshing its bases every step and every 10 steps, Muon, AdamW.

    A SOAP step that refreshes costs more than one that does not: at frequency 10 the median
    is a step without a refresh, and the amortized step is t10 + (t1 − t10)/10.
    """
    from orthoptim.optim.muon import Muon
    from orthoptim.optim.soap import SOAP

    cands = [
        StepCandidate(
            f"orthoptim_soap_f{f}",
            lambda ps, f=f: SOAP(ps, lr=3e-3, precondition_frequency=f),
            note=f"SOAP(precondition_frequency={f}): QR refresh every {f} step(s)",
            ours=f == 1,
        )
        for f in (1, 10)
    ]
    cands.append(StepCandidate("orthoptim_muon", lambda ps: Muon(ps, lr=0.02)))
    return cands + adamw_candidates()


register_suite("soap", soap_candidates, baseline="torch_adamw_fused")


def _make_params(
    shapes: Sequence[tuple[int, int]], device: torch.device, seed: int
) -> tuple[list[Tensor], list[Tensor]]:
    gen = torch.Generator().manual_seed(seed)
    weights = [torch.randn(r, c, generator=gen) * (1.0 / c**0.5) for r, c in shapes]
    grads = [torch.randn(r, c, generator=gen) * 1e-3 for r, c in shapes]
    return [w.to(device) for w in weights], [g.to(device) for g in grads]


def run(
    optimizer: str,
    args: argparse.Namespace,
    device: torch.device,
) -> dict[str, Any]:
    """Time one step of every candidate of the suite; return the report."""
    if optimizer not in SUITES:
        raise SystemExit(
            f"--optimizer: unknown {optimizer!r}; choose one of {', '.join(sorted(SUITES))}"
        )
    suite = SUITES[optimizer]
    shapes = gpt_matrix_shapes(args.layers, args.width)
    peak = matmul_peak(args, device)
    weights, grads = _make_params(shapes, device, args.seed)
    # Muon's paths (every suite times it), decided before timing: a race is no step's time
    paths = kernel_paths(shapes, resolve_ns_dtype("auto", device, torch.float32), device)
    cases = []
    candidates = suite.candidates(args)
    for cand in candidates:
        if cand.skip is not None or cand.build is None:
            cases.append(Case(cand.name, note=cand.note, skip=cand.skip or "not available"))
            continue
        params = [torch.nn.Parameter(w.clone()) for w in weights]
        for p, g in zip(params, grads):
            p.grad = g  # shared and never written by an optimizer step
        try:
            opt = cand.build(params)
        except Exception as exc:  # a peer may reject the setup; report it instead of failing
            cases.append(Case(cand.name, note=cand.note, skip=f"construction failed: {exc}"))
            continue
        step: Callable[[], object] = opt.step
        if cand.wrap is not None:
            step = cand.wrap(step)
        cases.append(
            Case(cand.name, step, note=cand.note, extra={"peer": cand.peer, "ours": cand.ours})
        )
    times = time_side_by_side(cases, device, args.repeats, args.warmup, args.skip)
    rows = summarize(cases, times, suite.baseline)
    step_flops = suite.flops(shapes) if suite.flops is not None else None
    if peak is not None and step_flops is not None:
        counted = {c.name for c in candidates if c.counts_flops}
        for row in rows:
            if "median_s" in row and row["name"] in counted:
                row.update(rate_against_peak(step_flops, row["median_s"], peak))
    medians = {r["name"]: r["median_s"] for r in rows if "median_s" in r}
    ours = [r["name"] for r in rows if r.get("ours") and r["name"] in medians]
    peers = [r["name"] for r in rows if r.get("peer") and r["name"] in medians]
    headline: dict[str, Any] = {}
    if ours and peers:
        fastest = min(peers, key=medians.__getitem__)
        headline = {
            "ours": ours[0],
            "fastest_peer": fastest,
            "speedup_vs_fastest_peer": medians[fastest] / medians[ours[0]],
            # each round times every case back to back: its ratio is immune to slow drift
            "per_round_speedups": [p / o for p, o in zip(times[fastest], times[ours[0]])],
        }
        if "orthoptim_muon_bfloat16" in medians:  # on CUDA: is the default dtype the fast one?
            headline["default_vs_explicit_bfloat16"] = (
                medians[ours[0]] / medians["orthoptim_muon_bfloat16"]
            )
    return {
        "benchmark": "step",
        "optimizer": optimizer,
        "baseline": suite.baseline,
        "layers": args.layers,
        "width": args.width,
        "matrices": len(shapes),
        "parameters": sum(r * c for r, c in shapes),
        "device": str(device),
        "repeats": args.repeats,
        "environment": environment(),
        "step_flops": step_flops,
        "matmul_peak": peak,
        "kernel_paths": paths,
        "cases": rows,
        "headline": headline,
        "median_of_all_s": statistics.median(medians.values()) if medians else None,
    }


def render(report: dict[str, Any]) -> str:
    """A text table of the step times."""
    lines = [
        f"{report['optimizer']} step over {report['matrices']} matrices "
        f"({report['parameters'] / 1e6:.1f} M parameters: {report['layers']} layers, width "
        f"{report['width']}), {report['device']}, {report['environment']['threads']} threads, "
        f"median of {report['repeats']}; speedup = {report['baseline']} time / case time"
    ]
    peak = report.get("matmul_peak")
    if peak and report.get("step_flops"):
        lines.append(
            f"{describe_peak(peak)}; effective TFLOP/s = {report['step_flops'] / 1e12:.3g} TFLOP "
            "(plain-matmul Newton-Schulz of every matrix) / step time"
        )
    for row in report["cases"]:
        if "skipped" in row:
            lines.append(f"  {row['name']:<29} skipped: {row['skipped']}")
            continue
        rate = (
            f"  {row['effective_tflops']:6.1f} TFLOP/s ({100 * row['fraction_of_peak']:.0f}% of "
            "peak)"
            if "effective_tflops" in row
            else ""
        )
        lines.append(
            f"  {row['name']:<29} {row['median_s'] * 1e3:10.1f} ms  "
            f"x{row['speedup_vs_baseline']:.2f}{rate}  {row['note']}"
        )
    lines += describe_kernel_paths(report.get("kernel_paths", []))
    h = report["headline"]
    if h:
        rounds = h["per_round_speedups"]
        lines.append(
            f"{h['ours']} is {h['speedup_vs_fastest_peer']:.2f}x the speed of the fastest peer "
            f"({h['fastest_peer']}); round by round {min(rounds):.2f}x to {max(rounds):.2f}x, "
            f"median {statistics.median(rounds):.2f}x"
        )
        if "default_vs_explicit_bfloat16" in h:
            lines.append(
                f"{h['ours']} (default ns_dtype) takes {h['default_vs_explicit_bfloat16']:.2f}x "
                "the time of ns_dtype=torch.bfloat16"
            )
    return "\n".join(lines)


def _cmd(args: argparse.Namespace) -> int:
    device = setup_device(args)
    if args.layers < 1 or args.width < 1:
        raise SystemExit(f"--layers and --width must be >= 1, got {args.layers}, {args.width}")
    with thread_count(args.threads):
        report = run(args.optimizer, args, device)
    emit(report, args.json, render)
    return 0


def add_parser(bench_subparsers: argparse._SubParsersAction) -> None:
    """Register `orthoptim bench step`."""
    p = bench_subparsers.add_parser(
        "step", help="one optimizer step over a GPT's matrices: ours vs peers vs AdamW"
    )
    add_common_arguments(p, repeats=3)
    add_peak_argument(p)
    add_skip_argument(p)
    p.add_argument(
        "--optimizer",
        default="muon",
        help=f"which suite to time (registered: {', '.join(sorted(SUITES))}; default muon)",
    )
    p.add_argument("--layers", type=int, default=12, help="transformer blocks of the GPT")
    p.add_argument("--width", type=int, default=768, help="model width of the GPT")
    p.add_argument("--seed", type=int, default=0, help="seed of the weights and gradients")
    p.add_argument(
        "--bf16-peers",
        action="store_true",
        help="on cpu, also time peers whose Newton-Schulz is bfloat16 (very slow there)",
    )
    p.set_defaults(func=_cmd)
