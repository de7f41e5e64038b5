"""`orthoptim bench step`: one whole optimizer step over the matrices of a GPT.

The parameter set is a `--layers`-layer, width-`--width` GPT's matrices (per layer four
attention width×width, the MLP's 4·width×width and width×4·width), float32, with fixed
random gradients. Each candidate owns a copy of the parameters and its optimizer; their
`step()` calls are timed side by side.

`--optimizer` picks a suite of candidates from SUITES (muon by default). A suite is a
function (args) → list[StepCandidate] plus the name of its baseline; add one with
`register_suite` from the module that implements the optimizer.
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
    Case,
    add_common_arguments,
    emit,
    environment,
    import_optional,
    setup_device,
    summarize,
    thread_count,
    time_side_by_side,
    torch_muon_fp32,
)

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


@dataclass
class Suite:
    """The candidates of one `--optimizer` choice and the name of its baseline."""

    candidates: Callable[[argparse.Namespace], list[StepCandidate]]
    baseline: str


SUITES: dict[str, Suite] = {}


def register_suite(
    name: str, candidates: Callable[[argparse.Namespace], list[StepCandidate]], baseline: str
) -> None:
    """Make `orthoptim bench step --optimizer NAME` time `candidates(args)`."""
    SUITES[name] = Suite(candidates, baseline)


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
    eo, reason = import_optional("emerging_optimizers.orthogonalized_optimizers")
    if eo is None or not hasattr(eo, "Muon"):
        cands.append(StepCandidate("emerging_optimizers_muon", skip=reason or "no Muon class"))
    else:
        precision = "medium" if cuda else "highest"
        cands.append(
            StepCandidate(
                "emerging_optimizers_muon",
                lambda ps: eo.Muon(ps, lr=0.02, fp32_matmul_prec=precision),
                note=f"Muon(fp32_matmul_prec={precision!r}): "
                + ("bfloat16" if cuda else "float32")
                + " Newton-Schulz",
                peer=True,
            )
        )
    hb, reason = import_optional("heavyball")
    if hb is not None and not hasattr(hb, "Muon"):
        hb, reason = None, "heavyball has no Muon here"
    if hb is not None and not cuda and not args.bf16_peers:
        hb, reason = (
            None,
            (
                "heavyball.Muon's Newton-Schulz is bfloat16 by design, ~50x slower than float32 "
                "matmul on CPUs without bf16 units (minutes per step); --bf16-peers times it anyway"
            ),
        )
    if hb is None:
        cands.append(StepCandidate("heavyball_muon", skip=reason))
    else:
        hb_utils, _ = import_optional("heavyball.utils")
        if hb_utils is not None and hasattr(hb_utils, "compile_mode"):
            hb_utils.compile_mode = None  # compiling takes ~25 s on the first CPU step
        cands.append(
            StepCandidate(
                "heavyball_muon",
                lambda ps: hb.Muon(ps, lr=0.02),
                note="heavyball.Muon, compile off (Newton-Schulz in bfloat16 by design)",
                peer=True,
            )
        )
    return cands + adamw_candidates()


register_suite("muon", muon_candidates, baseline="torch_muon")


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
    weights, grads = _make_params(shapes, device, args.seed)
    cases = []
    for cand in suite.candidates(args):
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
    times = time_side_by_side(cases, device, args.repeats, args.warmup)
    rows = summarize(cases, times, suite.baseline)
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
    for row in report["cases"]:
        if "skipped" in row:
            lines.append(f"  {row['name']:<24} skipped: {row['skipped']}")
        else:
            lines.append(
                f"  {row['name']:<24} {row['median_s'] * 1e3:10.1f} ms  "
                f"x{row['speedup_vs_baseline']:.2f}  {row['note']}"
            )
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
    p.add_argument(
        "--optimizer",
        default="muon",
        help=f"which suite to time (registered: {', '.join(sorted(SUITES))}; default muon)",
    )
    p.add_argument("--layers", type=int, default=12)
    p.add_argument("--width", type=int, default=768)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--bf16-peers",
        action="store_true",
        help="on cpu, also time peers whose Newton-Schulz is bfloat16 (very slow there)",
    )
    p.set_defaults(func=_cmd)
