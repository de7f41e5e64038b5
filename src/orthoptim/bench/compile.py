"""`orthoptim bench compile`: `torch.compile(opt.step, fullgraph=True)` against the eager step.

For each optimizer of `--optimizers` two copies of one GPT (`orthoptim.train.model.GPT`,
`--layers` blocks of width `--width`, float32) are stepped: one eagerly, one through the
compiled step, both with tensor LRs (the way to compile, see docs/optimizers.md) and on the
same fixed gradients (one backward of a random batch, kept for every step). "muon" is Muon over
the blocks' matrices alone; "hybrid_<variant>" is `build_optimizer(model, optimizer=variant)`:
the variant on the hidden matrices, torch's AdamW on the embedding, head and norm gains.

The first compiled call (tracing and code generation, plus one step) is timed on its own and
reported as the compile time; the eager copy takes one untimed step alongside it. Then every
case is timed side by side (`time_side_by_side`: interleaved rounds, `--warmup` untimed steps
first, median of `--repeats`). Both copies of an optimizer step equally often on the same
gradients, so at the end their parameters must agree to float32 rounding: the report gives,
per optimizer, the largest ‖Δ_compiled − Δ_eager‖∞ / ‖Δ_eager‖∞ over the parameters, where Δ
is a parameter's total change over the run.
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from orthoptim._torch_compat import dynamo_config
from orthoptim.bench import (
    Case,
    add_common_arguments,
    emit,
    environment,
    setup_device,
    summarize,
    synchronize,
    thread_count,
    time_side_by_side,
)

VARIANTS = ("muon", "normuon", "adamuon", "polargrad", "scion")
OPTIMIZERS = ("muon", *(f"hybrid_{v}" for v in VARIANTS))


def build(name: str, model: nn.Module) -> torch.optim.Optimizer:
    """Optimizer `name` of OPTIMIZERS over `model`, with tensor learning rates."""
    from orthoptim import Muon, build_optimizer

    if name == "muon":
        blocks = [(n, p) for n, p in model.named_parameters() if n.startswith("blocks.")]
        return Muon([(n, p) for n, p in blocks if p.ndim == 2], lr=torch.tensor(0.02))
    return build_optimizer(
        model,
        optimizer=name.removeprefix("hybrid_"),  # type: ignore[arg-type]
        lr=torch.tensor(0.02),
        adamw_lr=torch.tensor(3e-3),
    )


def gpt(layers: int, width: int, device: torch.device, seed: int) -> nn.Module:
    """The GPT of the run with gradients from one backward of a random batch (kept)."""
    from orthoptim.train.model import GPT, GPTConfig

    heads = max(1, width // 64)
    torch.manual_seed(seed)
    model = GPT(GPTConfig(n_layer=layers, n_head=heads, d_model=width, seq_len=64)).to(device)
    gen = torch.Generator().manual_seed(seed)
    idx = torch.randint(0, model.cfg.vocab_size, (4, 65), generator=gen).to(device)
    model(idx[:, :-1], idx[:, 1:]).backward()
    return model


def max_relative_difference(
    start: list[torch.Tensor], eager: nn.Module, compiled: nn.Module
) -> float:
    """max over parameters of ‖Δ_compiled − Δ_eager‖∞ / ‖Δ_eager‖∞ (Δ: change since `start`)."""
    worst = 0.0
    for p0, pe, pc in zip(start, eager.parameters(), compiled.parameters()):
        de, dc = pe.detach() - p0, pc.detach() - p0
        scale = float(de.abs().max())
        if scale > 0:
            worst = max(worst, float((dc - de).abs().max()) / scale)
        elif float(dc.abs().max()) > 0:
            return float("inf")  # compiled moved a parameter eager left alone
    return worst


def timed_first_call(step: Callable[[], object], device: torch.device) -> float:
    """Seconds of one call (the first compiled call: compiling included)."""
    synchronize(device)
    start = time.perf_counter()
    step()
    synchronize(device)
    return time.perf_counter() - start


def run(args: argparse.Namespace, device: torch.device) -> dict[str, Any]:
    """Time every optimizer eager and compiled; return the report."""
    names = [n.strip() for n in args.optimizers.split(",") if n.strip()]
    unknown = [n for n in names if n not in OPTIMIZERS]
    if unknown or not names:
        raise SystemExit(
            f"--optimizers: unknown {', '.join(unknown) or '(none given)'}; choose from "
            f"{', '.join(OPTIMIZERS)}"
        )
    # one cached graph per optimizer instance, all of the same `step` code
    config = dynamo_config()
    limit = max(config.recompile_limit, len(names))
    with config.patch(recompile_limit=limit):
        return _run(names, args, device)


def _run(names: list[str], args: argparse.Namespace, device: torch.device) -> dict[str, Any]:
    base = gpt(args.layers, args.width, device, args.seed)
    start = [p.detach().clone() for p in base.parameters()]
    cases: list[Case] = []
    pairs: dict[str, tuple[nn.Module, nn.Module, float]] = {}
    for name in names:
        eager_model, compiled_model = copy.deepcopy(base), copy.deepcopy(base)
        for copied in (eager_model, compiled_model):  # a deep-copied Parameter has no grad
            for p, q in zip(copied.parameters(), base.parameters()):
                p.grad = q.grad  # shared and never written by a step
        eager, opt = build(name, eager_model), build(name, compiled_model)
        compiled = torch.compile(opt.step, fullgraph=True)
        compile_s = timed_first_call(compiled, device)
        eager.step()  # the same number of steps for both copies
        pairs[name] = (eager_model, compiled_model, compile_s)
        cases.append(Case(f"{name}_eager", eager.step, note="eager step", extra={"of": name}))
        cases.append(
            Case(
                f"{name}_compiled",
                compiled,
                note="torch.compile(opt.step, fullgraph=True)",
                extra={"of": name, "compile_s": compile_s},
            )
        )
    times = time_side_by_side(cases, device, args.repeats, args.warmup)
    rows = summarize(cases, times, cases[0].name)
    medians = {r["name"]: r["median_s"] for r in rows}
    results = []
    for name, (eager_model, compiled_model, compile_s) in pairs.items():
        e, c = times[f"{name}_eager"], times[f"{name}_compiled"]
        results.append(
            {
                "optimizer": name,
                "eager_ms": medians[f"{name}_eager"] * 1e3,
                "compiled_ms": medians[f"{name}_compiled"] * 1e3,
                # compiled / eager: < 1 means compiling pays
                "compiled_over_eager": medians[f"{name}_compiled"] / medians[f"{name}_eager"],
                "per_round_ratios": [ci / ei for ci, ei in zip(c, e)],
                "compile_s": compile_s,
                "max_relative_difference": max_relative_difference(
                    start, eager_model, compiled_model
                ),
            }
        )
    return {
        "benchmark": "compile",
        "layers": args.layers,
        "width": args.width,
        "parameters": sum(p.numel() for p in base.parameters()),
        "device": str(device),
        "repeats": args.repeats,
        "warmup": args.warmup,
        "environment": environment(),
        "cases": rows,
        "results": results,
    }


def render(report: dict[str, Any]) -> str:
    """A text table: eager and compiled step side by side, per optimizer."""
    lines = [
        f"compiled vs eager optimizer step: {report['layers']}-layer GPT of width "
        f"{report['width']} ({report['parameters'] / 1e6:.1f} M parameters), float32, "
        f"{report['device']}, {report['environment']['threads']} threads, median of "
        f"{report['repeats']} interleaved rounds after {report['warmup']} warm-up step(s)",
        f"  {'optimizer':<18} {'eager':>10} {'compiled':>10} {'compiled/eager':>15} "
        f"{'compile':>9} {'max rel diff':>13}",
    ]
    for r in report["results"]:
        rounds = r["per_round_ratios"]
        lines.append(
            f"  {r['optimizer']:<18} {r['eager_ms']:8.1f}ms {r['compiled_ms']:8.1f}ms "
            f"{r['compiled_over_eager']:14.2f}x {r['compile_s']:8.1f}s "
            f"{r['max_relative_difference']:13.1e}   (rounds {min(rounds):.2f}x to "
            f"{max(rounds):.2f}x, median {statistics.median(rounds):.2f}x)"
        )
    return "\n".join(lines)


def _cmd(args: argparse.Namespace) -> int:
    device = setup_device(args)
    if args.layers < 1 or args.width < 1 or args.width % 2:
        raise SystemExit(
            f"--layers must be >= 1 and --width an even number >= 2, got {args.layers}, "
            f"{args.width}"
        )
    with thread_count(args.threads):
        report = run(args, device)
    emit(report, args.json, render)
    return 0


def add_parser(bench_subparsers: argparse._SubParsersAction) -> None:
    """Register `orthoptim bench compile`."""
    p = bench_subparsers.add_parser(
        "compile",
        help="torch.compile(opt.step, fullgraph=True) vs the eager step, on a GPT",
    )
    add_common_arguments(p, repeats=10, warmup=2)
    p.add_argument(
        "--optimizers",
        default=",".join(OPTIMIZERS),
        help=f"comma-separated, from {', '.join(OPTIMIZERS)} (default: all)",
    )
    p.add_argument("--layers", type=int, default=12, help="transformer blocks of the GPT (12)")
    p.add_argument("--width", type=int, default=128, help="model width of the GPT (128)")
    p.add_argument("--seed", type=int, default=0, help="seed of the weights and the batch")
    p.set_defaults(func=_cmd)
