"""`orthoptim bench plan`: the plan's predicted step time against the real step's.

For each layout of `--layouts` (gloo ranks, one intra-op thread each) every rank builds
`orthoptim train --config NAME`'s GPT once per variant of the layout, the way `orthoptim
train` lays it out, under `LayerwiseDistributedOptimizer`, and times interleaved steps of the
variants (their order rotating, a barrier before each): forward and backward of `--batch`
sequences per data-parallel rank, `step()`, `zero_grad()` and the wait for the parameter
gathers. A case's measured time is the busiest rank's median. The layouts:

* `dpN`: N data-parallel ranks, Muon and AdamW;
* `tpN`: N tensor-parallel ranks, Muon in each mode of `--tp-modes` (AdamW is not run under
  tensor parallelism, as `orthoptim train` does not run it), every mode's orthogonalizer
  pricing with the cost model `plan` prices with on the profile (`tp_cost_model`), so `auto`
  picks there what the plan's `auto` picks; the mode measured fastest is shown beside the
  modes `auto` took;
* `epN`: N data- and expert-parallel ranks of `--moe-config`, Muon and AdamW.

Its predicted time is `orthoptim plan`'s (`plan.steptime`) for the same model and layout on
the `--hardware` profile (one `orthoptim bench calibrate` measured on this machine, for the
rates it prices with): Newton-Schulz in fp32 on the CPU path, the step's global tokens.
A shared machine's speed drifts between the profile's minute and the run's (by a third, seen
on the test machines), so every rank also times probes in every round beside the cases
(`Probes`: the fp32 square matmul `bench calibrate` times, and with several ranks its
one-element all-reduce after compute, all ranks at once); with `--rescale` (the default)
the prediction prices on the profile's compute figures scaled by the matmul probe's rate
over the profile's (`probe_factor`: core sharing included, where the ranks outnumber the
cores) and its collectives' latency by the profile's all-reduce latency over the probe's
(`comm_probe_factor`; the bandwidths as measured). The plan itself (what `auto` picks) is
made on the profile as the runtime's cost model reads it. No step time enters a
prediction. The error of each case is what this machine gave at the load it had.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import re
import statistics
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import torch
import torch.distributed as dist

from orthoptim import collectives as C
from orthoptim.bench import environment
from orthoptim.bench.calibrate import (
    CHUNK_CALLS,
    MATMUL_SIDE,
    Timed,
    collective_call,
    compute_chunk,
    pairs,
    timed_once,
)
from orthoptim.bench.dist import spawn_gloo
from orthoptim.parallel.layerwise import LayerwiseDistributedOptimizer
from orthoptim.parallel.layout import ParallelDims, ParallelMesh
from orthoptim.parallel.tensor_parallel import TensorParallelOrthogonalizer, tp_mode_names
from orthoptim.parallel.tp_model import CostModel
from orthoptim.plan.hardware import Hardware, load_hardware
from orthoptim.plan.layouts import Layout
from orthoptim.plan.model import train_model
from orthoptim.plan.planner import make_plan, tp_cost_model
from orthoptim.plan.steptime import step_terms

Optimizer = Literal["muon", "adamw"]
OPTIMIZERS: tuple[Optimizer, ...] = ("muon", "adamw")
LayoutKind = Literal["dp", "tp", "ep"]
DEFAULT_LAYOUTS = "dp1,dp2,dp4,tp2,ep2"
# the side of the probe each rank times in every round: the fp32 square `bench calibrate`
# times on a CPU, so its rate compares with the profile's
PROBE_SIDE = MATMUL_SIDE["cpu"]["fp32"]


@dataclass(frozen=True)
class Variant:
    """One timed case of a layout: its optimizer and, under tensor parallelism, its mode."""

    optimizer: Optimizer
    tp_mode: str | None = None


@dataclass(frozen=True)
class BenchLayout:
    """A layout of `orthoptim bench plan`: `kind` over `size` ranks, its variants."""

    kind: LayoutKind
    size: int
    config: str
    variants: tuple[Variant, ...]

    @property
    def name(self) -> str:
        return f"{self.kind}{self.size}"

    def label(self, v: Variant) -> str:
        """The case's name: `dp2-muon`, `tp2-gram-muon`."""
        return "-".join(x for x in (self.name, v.tp_mode, v.optimizer) if x)

    def dims(self) -> ParallelDims:
        tp = self.size if self.kind == "tp" else 1
        ep = self.size if self.kind == "ep" else 1
        return ParallelDims.for_world(self.size, tp=tp, ep=ep)

    def plan_layout(self, v: Variant, tokens: int) -> Layout:
        """The plan's layout of case `v` at `tokens` per step."""
        d = self.dims()
        return Layout(
            dp=d.dp, tp=d.tp, ep=d.ep, tokens_per_step=tokens, device="cpu", ns_dtype="fp32",
            optimizer=v.optimizer, tp_mode=v.tp_mode or "auto",  # type: ignore[arg-type]
        )  # fmt: skip


def parse_layouts(text: str, config: str, moe_config: str, modes: list[str]) -> list[BenchLayout]:
    """`--layouts` ('dp1,dp2,tp2,ep2') as `BenchLayout`s; a bad entry is refused by name."""
    out = []
    for entry in (t.strip() for t in text.split(",") if t.strip()):
        m = re.fullmatch(r"(dp|tp|ep)([1-9][0-9]*)", entry)
        if m is None or (m[1] != "dp" and int(m[2]) < 2):
            raise ValueError(
                f"--layouts entries are dpN (N >= 1), tpN or epN (N >= 2), got {entry!r}"
            )
        kind: LayoutKind = m[1]  # type: ignore[assignment]
        if kind == "tp":
            variants = tuple(Variant("muon", mode) for mode in modes)
        else:
            variants = tuple(Variant(name) for name in OPTIMIZERS)
        out.append(BenchLayout(kind, int(m[2]), moe_config if kind == "ep" else config, variants))
    return out


class _Case:
    """One variant's model and optimizer on this rank; `step(i)` runs and times step i."""

    def __init__(
        self,
        layout: BenchLayout,
        v: Variant,
        mesh: ParallelMesh,
        args: argparse.Namespace,
        cost_model: CostModel,
    ) -> None:
        from orthoptim.train.model import CONFIGS, GPT, expert_parallelize, parallelize

        torch.manual_seed(args.seed)
        self.cfg = CONFIGS[layout.config]
        self.model = GPT(self.cfg)
        extra: dict[str, Any] = {}
        self.orth: TensorParallelOrthogonalizer | None = None
        self.modes: Counter[str] = Counter()  # matrices per mode in the last step
        if mesh.dims.tp > 1:
            parallelize(self.model, mesh.tp_mesh)
            self.orth = TensorParallelOrthogonalizer(mode=v.tp_mode, cost_model=cost_model)
            extra["orthogonalizer"] = self._counted
        if mesh.dims.ep > 1:
            ep = mesh.dims.ep
            expert_parallelize(self.model, mesh.ep_group, mesh.coord.ep, ep, mesh.dp_group)
        self.opt = LayerwiseDistributedOptimizer(
            self.model,
            optimizer=v.optimizer,
            lr=0.02,
            layout=mesh,
            split_experts=v.optimizer != "adamw" and mesh.dims.tp == 1,
            **extra,
        )
        self.args, self.label, self.mesh = args, layout.label(v), mesh
        self.times: list[tuple[float, float]] = []  # (forward and backward, the rest)

    def _counted(self, mats: torch.Tensor) -> torch.Tensor:
        """The orthogonalizer, counting the matrices of each call under the mode it took."""
        assert self.orth is not None
        out = self.orth(mats)
        self.modes[self.orth.last_modes[-1]] += math.prod(mats.shape[:-2])
        return out

    def step(self, i: int) -> None:
        seed = self.args.seed * 1_000_003 + i * 1009 + self.mesh.coord.dp
        g = torch.Generator().manual_seed(seed)
        shape = (self.args.batch, self.cfg.seq_len + 1)
        idx = torch.randint(0, self.cfg.vocab_size, shape, generator=g)
        self.modes.clear()
        start = time.perf_counter()
        self.model(idx[:, :-1], idx[:, 1:]).backward()
        middle = time.perf_counter()
        self.opt.step()
        self.opt.zero_grad()
        self.opt.wait_for_params()
        self.times.append((middle - start, time.perf_counter() - middle))


def _rank_main(rank: int, world: int, port: int, outdir: str, args: argparse.Namespace) -> None:
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world
    )
    try:
        layout: BenchLayout = args.layout
        mesh = layout.dims().build("cpu", rank)
        hw = sharing_cores(load_hardware(args.hardware), layout.size, cores())
        # the plan's TP cost model on the profile (the same for every variant of the layout)
        model = tp_cost_model(hw, layout.plan_layout(Variant("muon"), 0))
        cases = [_Case(layout, v, mesh, args, model) for v in layout.variants]
        probe = Probes(world)
        for i in range(args.warmup + args.steps):
            probe.round()
            shift = i % len(cases)
            for c in cases[shift:] + cases[:shift]:  # interleaved, the order rotating
                C.barrier()
                c.step(i)
        out: dict[str, Any] = probe.medians(args.warmup)
        out |= {
            c.label: {
                "median_s": statistics.median(a + b for a, b in c.times[args.warmup :]),
                "compute_s": statistics.median(a for a, _ in c.times[args.warmup :]),
                "optimizer_s": statistics.median(b for _, b in c.times[args.warmup :]),
                "modes": dict(c.modes),
            }
            for c in cases
        }
        torch.save(out, os.path.join(outdir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


class Probes:
    """The probes every rank of a layout times in each round beside its cases, all ranks at
    once: "probe_s", the fp32 square matmul `bench calibrate` times (`PROBE_SIDE`), and
    with several ranks "comm_probe_s", a one-element all-reduce as calibrate times its
    latency (`CHUNK_CALLS` of them, each after its matmul, less the matmuls alone)."""

    def __init__(self, world: int) -> None:
        cpu = torch.device("cpu")
        a, b = (torch.randn(PROBE_SIDE, PROBE_SIDE) for _ in range(2))
        self.matmul = Timed(lambda: torch.matmul(a, b))
        chunk = compute_chunk(cpu)
        call = collective_call("all_reduce", world, world, cpu)
        self.alone = pairs(chunk, None)
        self.after = pairs(chunk, lambda: call(None)) if world > 1 else None
        self.seconds: dict[str, list[float]] = {"probe_s": [], "comm_probe_s": []}

    def round(self) -> None:
        """One round's probes."""
        cpu = torch.device("cpu")
        self.seconds["probe_s"].append(timed_once(self.matmul, cpu))
        if self.after is not None:
            alone, after = timed_once(self.alone, cpu), timed_once(self.after, cpu)
            self.seconds["comm_probe_s"].append((after - alone) / CHUNK_CALLS)

    def medians(self, skip: int) -> dict[str, float | None]:
        """Each probe's median over the rounds after the first `skip` (None: not timed)."""
        return {
            k: statistics.median(v[skip:]) if v[skip:] else None for k, v in self.seconds.items()
        }


def cores() -> int:
    """The cores this process may run on (its ranks inherit them)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def scale_compute(hw: Hardware, factor: float) -> Hardware:
    """`hw` on a machine `factor` × as fast: every compute and memory rate × factor, every
    fixed cost per tensor or layer ÷ it. Collectives keep their measured figures."""
    if factor == 1.0:
        return hw
    rates = {d: {c: r * factor for c, r in t.items()} for d, t in hw.matmul_tflops.items()}

    def times(v: float | None) -> float | None:
        return None if v is None else v * factor

    return dataclasses.replace(
        hw,
        bf16_tflops=hw.bf16_tflops * factor,
        fp32_tflops=hw.fp32_tflops * factor,
        matmul_tflops=rates,
        memory_gb_per_s=times(hw.memory_gb_per_s),
        activation_gb_per_s=times(hw.activation_gb_per_s),
        optimizer_gb_per_s=times(hw.optimizer_gb_per_s),
        optimizer_us_per_tensor={k: v / factor for k, v in hw.optimizer_us_per_tensor.items()},
        tp_us_per_linear=None if hw.tp_us_per_linear is None else hw.tp_us_per_linear / factor,
    )


def scale_links(hw: Hardware, factor: float) -> Hardware:
    """`hw` with collectives' latency `factor` × as short: every link's and measured
    collective's latency ÷ factor, the bandwidths as measured (the probe sends one element;
    seen on the test machines, the latency and the bandwidth do not drift together)."""
    if factor == 1.0:
        return hw
    links = {
        kind: {n: {**e, "latency_us": e["latency_us"] / factor} for n, e in by_size.items()}
        for kind, by_size in hw.collectives.items()
    }
    return dataclasses.replace(
        hw,
        collectives=links,
        intra_node_latency_us=hw.intra_node_latency_us / factor,
        inter_node_latency_us=hw.inter_node_latency_us / factor,
    )


def comm_probe_factor(hw: Hardware, probe_s: float | None, group: int) -> float | None:
    """The profile's measured all-reduce latency at `group` ranks over the comm probe's
    (`Probes`: the busiest rank's median): how much shorter a collective's fixed cost was
    during the run than when the profile was measured; None without either."""
    entry = hw.collectives.get("all_reduce", {}).get(str(group))
    if entry is None or probe_s is None:
        return None
    return entry["latency_us"] * 1e-6 / max(probe_s, 1e-7)


def sharing_cores(hw: Hardware, ranks: int, n_cores: int) -> Hardware:
    """`hw` as each of `ranks` one-thread ranks sees it on `n_cores` cores: with more ranks
    than cores, `scale_compute` by n_cores / ranks (the plan models one rank per device;
    here they take turns on the cores)."""
    return scale_compute(hw, min(1.0, n_cores / ranks))


def probe_factor(hw: Hardware, probe_s: float) -> float | None:
    """The probe's rate (a `PROBE_SIDE`³ fp32 matmul in `probe_s`: the busiest rank's median,
    every rank timing it at once in every round beside the cases) over the profile's
    measured fp32 square rate: how fast each rank computed during the run against when the
    profile was measured, core sharing included; None where the profile measured no such
    rate."""
    measured = hw.matmul_tflops.get("fp32", {}).get("square")
    if measured is None:
        return None
    return 2 * PROBE_SIDE**3 / probe_s / (measured * 1e12)


def predicted(
    args: argparse.Namespace,
    layout: BenchLayout,
    v: Variant,
    factor: float | None = None,
    comm: float | None = None,
) -> dict[str, Any]:
    """The plan's seconds of case `v` of `layout` on this machine, the profile's compute
    scaled by the layout's probe `factor` where given (`probe_factor`), else shared among
    the ranks (`sharing_cores`), and its collectives by `comm` where given
    (`comm_probe_factor`): the step, its forward and backward, the rest (the optimizer
    with its exposed collectives); under tensor parallelism the modes the plan's `auto`
    picks (matrices per mode)."""
    from orthoptim.train.model import CONFIGS

    desc = train_model(layout.config)
    profile = load_hardware(args.hardware)
    shared = sharing_cores(profile, layout.size, cores())
    dp = layout.dims().dp
    plan_layout = layout.plan_layout(v, dp * args.batch * CONFIGS[layout.config].seq_len)
    # planned (auto's picks) on the profile the runtime's cost model read; priced on the
    # probe's where given
    plan = make_plan(desc, shared, plan_layout)
    priced = shared if factor is None else scale_compute(profile, factor)
    priced = priced if comm is None else scale_links(priced, comm)
    terms = step_terms(plan, priced, plan_layout)  # this case's optimizer alone
    compute = sum(terms["phases_s"][p] for p in ("forward", "backward", "activation_collectives"))
    out: dict[str, Any] = {
        "step_s": terms["step_s"],
        "compute_s": compute,
        "optimizer_s": terms["step_s"] - compute,
    }
    if layout.kind == "tp":
        picks = plan["tp"]["auto_picks"]
        out["auto_picks"] = {m: n for m, n in picks.items() if " form " not in m}
    return out


def run(args: argparse.Namespace) -> list[dict[str, Any]]:
    """Every case of every layout: predicted (with `--rescale`, on the profile scaled by the
    layout's probes, `probe_factor` and `comm_probe_factor`), measured (the busiest rank's
    median), error, the probes' factors, and under tensor parallelism the modes `auto` took
    (rank 0's last step, matrices per mode)."""
    cases = []
    for layout in args.layouts:
        per_rank = spawn_gloo(
            _rank_main, layout.size, argparse.Namespace(**vars(args), layout=layout)
        )
        profile = load_hardware(args.hardware)
        factor = probe_factor(profile, max(r["probe_s"] for r in per_rank))
        slowest = None if layout.size == 1 else max(r["comm_probe_s"] for r in per_rank)
        comm = comm_probe_factor(profile, slowest, layout.size)
        for v in layout.variants:
            label = layout.label(v)
            if args.rescale:
                plan = predicted(args, layout, v, factor, comm)
            else:
                plan = predicted(args, layout, v)
            busiest = max(per_rank, key=lambda r: r[label]["median_s"])[label]
            measured = busiest["median_s"]
            case: dict[str, Any] = {
                "case": label,
                "layout": layout.name,
                "optimizer": v.optimizer,
                "predicted_s": plan["step_s"],
                "measured_s": measured,
                "error": plan["step_s"] / measured - 1,
                "probe_factor": factor,
                "comm_probe_factor": comm,
                "rescaled": bool(args.rescale and factor is not None),
            }
            for part in ("compute_s", "optimizer_s"):  # the busiest rank's
                case[f"predicted_{part}"], case[f"measured_{part}"] = plan[part], busiest[part]
            if v.tp_mode is not None:
                case["tp_mode"] = v.tp_mode
                case["modes_taken"] = per_rank[0][label]["modes"]
                case["plan_auto_picks"] = plan["auto_picks"]
            cases.append(case)
    return cases


def _counts(counts: dict[str, int]) -> str:
    return ", ".join(f"{m} ×{n}" for m, n in sorted(counts.items())) or "—"


def summary_lines(cases: list[dict[str, Any]]) -> list[str]:
    """Per layout: Muon/AdamW predicted and measured; under tensor parallelism the mode
    measured fastest, the mode predicted fastest and what `auto` took."""
    lines = []
    for name in dict.fromkeys(c["layout"] for c in cases):
        mine = [c for c in cases if c["layout"] == name]
        factor, comm = mine[0].get("probe_factor"), mine[0].get("comm_probe_factor")
        if factor is not None:
            how = "the profile scaled by them" if mine[0]["rescaled"] else "not applied"
            speeds = f"compute {factor:.3f}x" + (f", collectives {comm:.3f}x" if comm else "")
            lines.append(f"{name} probes: {speeds} the profile's ({how})")
        by_opt = {c["optimizer"]: c for c in mine if "tp_mode" not in c}
        if "muon" in by_opt and "adamw" in by_opt:
            muon, adamw = by_opt["muon"], by_opt["adamw"]
            lines.append(
                f"{name} muon/adamw: predicted {muon['predicted_s'] / adamw['predicted_s']:.3f}, "
                f"measured {muon['measured_s'] / adamw['measured_s']:.3f}"
            )
        modes = [c for c in mine if "tp_mode" in c]
        if modes:
            fastest = min(modes, key=lambda c: c["measured_s"])
            best = min(modes, key=lambda c: c["predicted_s"])
            auto = next((c for c in modes if c["tp_mode"] == "auto"), None)
            line = (
                f"{name}: fastest measured {fastest['tp_mode']}, fastest predicted "
                f"{best['tp_mode']}"
            )
            if auto is not None:
                line += (
                    f"; auto took {_counts(auto['modes_taken'])} ("
                    f"{auto['measured_s'] / fastest['measured_s']:.3f}× the fastest), the plan's "
                    f"auto picks {_counts(auto['plan_auto_picks'])} (matrices per mode)"
                )
            lines.append(line)
    return lines


def render(cases: list[dict[str, Any]], args: argparse.Namespace) -> str:
    """The table: each case's predicted and measured ms, the error, and the same for its
    two parts (forward and backward; the optimizer step with its exposed collectives); each
    layout's summary (`summary_lines`)."""
    width = max(14, *(len(c["case"]) + 2 for c in cases))
    lines = [
        f"orthoptim bench plan: train:{args.config} (ep: train:{args.moe_config}), "
        f"{args.batch} sequences per data-parallel rank, median of {args.steps} interleaved "
        f"steps, 1 thread/rank, gloo, {cores()} cores; predicted on {args.hardware}, "
        + (
            "its compute scaled by each layout's probe"
            if args.rescale
            else "its rates shared where the ranks outnumber the cores"
        ),
        f"{'':<{width}}{'step':>29}{'':>9}{'forward+backward':>29}{'optimizer':>20}",
        f"{'case':<{width}}{'predicted ms':>13}{'measured ms':>13}{'error':>9}"
        f"{'predicted':>11}{'measured':>10}{'error':>8}{'predicted':>11}{'measured':>10}"
        f"{'error':>8}",
    ]
    for c in cases:
        row = f"{c['case']:<{width}}{c['predicted_s'] * 1e3:>13.2f}{c['measured_s'] * 1e3:>13.2f}"
        row += f"{c['error']:>+9.1%}"
        for part in ("compute_s", "optimizer_s"):
            p, m = c[f"predicted_{part}"], c[f"measured_{part}"]
            row += f"{p * 1e3:>11.2f}{m * 1e3:>10.2f}{p / m - 1 if m else 0.0:>+8.0%}"
        lines.append(row)
    lines += summary_lines(cases)
    lines.append(f"load average at the end: {os.getloadavg()[0]:.1f} ({environment()['torch']})")
    return "\n".join(lines)


def _check(args: argparse.Namespace) -> None:
    """Refuse bad flags before any rank starts: sizes, the profile, the configs and each
    layout against its model (`--layouts` parsed into `args.layouts`)."""
    from orthoptim.train.model import check_tensor_parallel, get_config

    if args.steps < 1 or args.warmup < 0 or args.batch < 1:
        raise ValueError(
            f"--steps and --batch must be >= 1 and --warmup >= 0, got {args.steps}, "
            f"{args.batch}, {args.warmup}"
        )
    unknown = [m for m in args.tp_modes if m not in tp_mode_names()]
    if unknown or not args.tp_modes:
        raise ValueError(f"--tp-modes takes some of {', '.join(tp_mode_names())}, got {unknown}")
    args.layouts = parse_layouts(args.layouts, args.config, args.moe_config, args.tp_modes)
    load_hardware(args.hardware)
    for layout in args.layouts:
        train_model(layout.config)
        cfg = get_config(layout.config)
        if layout.kind == "ep" and cfg.moe is None:
            raise ValueError(f"--moe-config {layout.config} has no experts; use tiny-moe")
        if layout.kind == "tp":
            check_tensor_parallel(cfg, layout.size)
        layout.dims().check(n_layer=cfg.n_layer, n_expert=cfg.moe.n_expert if cfg.moe else None)


def _cmd(args: argparse.Namespace) -> int:
    try:
        _check(args)
    except (ValueError, FileNotFoundError) as exc:
        raise SystemExit(f"orthoptim bench plan: {exc}") from None
    cases = run(args)
    print(render(cases, args))
    if args.json:
        Path(args.json).write_text(json.dumps(cases, indent=1))
        print(f"wrote {args.json}")
    return 0


def add_parser(bench_subparsers: argparse._SubParsersAction) -> None:
    """Register `orthoptim bench plan`."""
    p = bench_subparsers.add_parser(
        "plan",
        help="the plan's predicted step time against the real step's: Muon and AdamW at each "
        "data- and expert-parallel size, Muon in each tensor-parallel mode",
    )
    p.add_argument(
        "--hardware",
        required=True,
        help="the profile the prediction prices with: one `orthoptim bench calibrate --out` "
        "wrote on this machine (or a shipped name)",
    )
    p.add_argument("--config", default="tiny", help="orthoptim train's GPT config (default tiny)")
    p.add_argument(
        "--moe-config", default="tiny-moe", help="the config of the epN layouts (tiny-moe)"
    )
    p.add_argument(
        "--layouts",
        default=DEFAULT_LAYOUTS,
        help=f"comma-separated dpN, tpN, epN (N ranks each; default {DEFAULT_LAYOUTS})",
    )
    p.add_argument(
        "--tp-modes",
        type=lambda t: [m.strip() for m in t.split(",") if m.strip()],
        default=list(tp_mode_names()),
        help=f"the tpN layouts' modes (default all: {','.join(tp_mode_names())})",
    )
    p.add_argument(
        "--batch", type=int, default=4, help="sequences per data-parallel rank per step (4)"
    )
    p.add_argument("--steps", type=int, default=7, help="timed steps of each case (7)")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps first (2)")
    p.add_argument("--seed", type=int, default=0, help="seed of the model and the batches")
    p.add_argument(
        "--rescale",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="price on the profile scaled by each layout's probes (a fp32 matmul and a small "
        "all-reduce its ranks time at once in every round beside the cases) over the "
        "profile's own figures, for the machine's speed during the run (default on; "
        "--no-rescale: the profile as measured, its rates shared where the ranks outnumber "
        "the cores)",
    )
    p.add_argument(
        "--json",
        metavar="PATH",
        default=None,
        help='write [{"case", "layout", "optimizer", "predicted_s", "measured_s", "error"}, '
        '...] (tpN cases also "tp_mode" and "modes_taken") to PATH',
    )
    p.set_defaults(func=_cmd)
