"""`orthoptim bench dist`: data-parallel optimizers side by side on N real gloo ranks.

On the same small GPT and global batch (each rank its slice), one run measures:

  ddp_adamw          DDP + AdamW
  zero_adamw         DDP + torch's ZeroRedundancyOptimizer(AdamW)
  ddp_muon           DDP + Muon (hybrid), computed redundantly on every rank
  layerwise_*        orthoptim's LayerwiseDistributedOptimizer (Muon hybrid), with and without
                     overlap, parameters gathered in float32 and in bfloat16

With `--fsdp` the model is sharded by FSDP2 (`fully_shard` per block and at the root) instead:

  fsdp_adamw         FSDP2 + torch.optim.AdamW over the DTensor shards (elementwise, local)
  fsdp_muon          FSDP2 + orthoptim's FSDPOptimizer (Muon hybrid), updates in float32
  fsdp_muon_bf16     the same, updates travelling in bfloat16

For each: the step time (fwd + bwd + step, median over steps; the slowest rank), the
optimizer-state bytes per rank, and the bytes each rank sends per step (counted by
`orthoptim.collectives`: DDP's all-reduce runs through a comm hook that calls it; ZeRO's parameter
broadcasts are counted on their way to torch.distributed; FSDP2's parameter all-gathers and
gradient reduce-scatters run through its custom-collective hooks, see
`count_fsdp_collectives`). For the layer-wise runs also the compute-only time (fwd + bwd +
the owner's inner step, no communication) and the exposed communication = step time −
compute-only time; for the FSDP runs the bytes split into FSDP2's and the optimizer's, and the
optimizer's bytes over its sharded matrix-gradient bytes (≈ 2·(N−1)/N by design).
"""

from __future__ import annotations

import argparse
import contextlib
import math
import os
import socket
import statistics
import tempfile
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

from orthoptim import collectives as C
from orthoptim.bench import emit, environment
from orthoptim.checkpoint import load_file
from orthoptim.comm_bytes import CommStats, broadcast_bytes
from orthoptim.optim.hybrid import build_optimizer
from orthoptim.parallel.base import DistributedOptimizer
from orthoptim.parallel.fsdp import FSDPOptimizer, count_fsdp_collectives, shard_model
from orthoptim.parallel.layerwise import LayerwiseDistributedOptimizer
from orthoptim.shards import local_shard

LAYERWISE = {
    "layerwise_overlap_fp32": dict(overlap_grad_reduce=True, overlap_param_gather=True),
    "layerwise_no_overlap_fp32": dict(overlap_grad_reduce=False, overlap_param_gather=False),
    "layerwise_overlap_bf16": dict(
        overlap_grad_reduce=True, overlap_param_gather=True, gather_dtype=torch.bfloat16
    ),
    "layerwise_no_overlap_bf16": dict(
        overlap_grad_reduce=False, overlap_param_gather=False, gather_dtype=torch.bfloat16
    ),
}
METHODS = ("ddp_adamw", "zero_adamw", "ddp_muon", *LAYERWISE)
FSDP_METHODS = ("fsdp_adamw", "fsdp_muon", "fsdp_muon_bf16")


def gpt_model(args: argparse.Namespace) -> nn.Module:
    """The benchmarks' small GPT: --layers, --heads, --width, --seq-len, seeded by --seed."""
    from orthoptim.train.model import GPT, GPTConfig

    torch.manual_seed(args.seed)
    cfg = GPTConfig(
        n_layer=args.layers, n_head=args.heads, d_model=args.width, seq_len=args.seq_len
    )
    return GPT(cfg)


def _batch(args: argparse.Namespace, rank: int, world: int, step: int) -> tuple[Any, Any]:
    g = torch.Generator().manual_seed(args.seed * 1000 + step)
    idx = torch.randint(0, 256, (args.batch, args.seq_len + 1), generator=g)
    per = args.batch // world
    idx = idx[rank * per : (rank + 1) * per]
    return idx[:, :-1], idx[:, 1:]


def state_bytes(optimizer: Any) -> int:
    """Bytes of every tensor in an optimizer's state on this rank."""
    if isinstance(optimizer, DistributedOptimizer):  # the state and the owners' masters
        held = optimizer.memory()
        return held["masters"] + held["state"]
    if hasattr(optimizer, "optim"):  # ZeroRedundancyOptimizer: the local shard's optimizer
        optimizer = optimizer.optim
    return sum(_tensor_bytes(s) for s in optimizer.state.values())


def _tensor_bytes(state: dict[str, Any]) -> int:
    """Bytes held on this rank (a DTensor counts its local shard)."""
    local = [local_shard(v) for v in state.values()]
    return sum(v.numel() * v.element_size() for v in local if torch.is_tensor(v))


def _ddp_hook(stats: CommStats) -> Callable[..., Any]:
    """A DDP comm hook that averages each bucket through collectives.all_reduce (counted)."""

    def hook(_state, bucket):  # unannotated: DDP rejects annotations other than its own
        t = bucket.buffer()
        t.div_(dist.get_world_size())
        work = C.all_reduce(t, stats=stats, async_op=True)
        return work.get_future().then(lambda fut: fut.value()[0])

    return hook


@contextlib.contextmanager
def _count_broadcasts(stats: CommStats) -> Iterator[None]:
    """Count torch.distributed.broadcast calls made inside the block (ZeRO's parameter sync)
    under `orthoptim.collectives`' accounting (`comm_bytes.broadcast_bytes`: a pipelined chain from
    the source, every rank but the source receives the tensor, every rank but the last sends
    it)."""
    original = dist.broadcast

    def counted(tensor: torch.Tensor, src: int, *a: Any, **kw: Any) -> Any:
        group = kw.get("group", a[0] if a else None)
        rank, n = C.world(group)
        b = tensor.numel() * tensor.element_size()
        stats.record("broadcast", *broadcast_bytes(b, n, C.group_rank(group, src))[rank])
        return original(tensor, src, *a, **kw)

    dist.broadcast = counted
    try:
        yield
    finally:
        dist.broadcast = original


def _build(method: str, args: argparse.Namespace, stats: CommStats) -> tuple[nn.Module, Any, Any]:
    """(model to call, optimizer, the module holding the parameters)."""
    from torch.distributed.optim import ZeroRedundancyOptimizer
    from torch.nn.parallel import DistributedDataParallel as DDP

    model = gpt_model(args)
    hybrid = dict(lr=args.lr, adamw_lr=args.adamw_lr)
    if method.startswith("fsdp"):
        shard_model(model)
        count_fsdp_collectives(model, stats)
        if method == "fsdp_adamw":
            return model, torch.optim.AdamW(model.parameters(), lr=args.adamw_lr), model
        wire = torch.bfloat16 if method == "fsdp_muon_bf16" else None
        opt = FSDPOptimizer(
            model, optimizer="muon", bucket_mb=args.bucket_mb, comm_dtype=wire, **hybrid
        )
        return model, opt, model
    if method.startswith("layerwise"):
        opt = LayerwiseDistributedOptimizer(
            model, optimizer="muon", bucket_mb=args.bucket_mb, **hybrid, **LAYERWISE[method]
        )
        return model, opt, model
    ddp = DDP(model, bucket_cap_mb=args.bucket_mb)
    ddp.register_comm_hook(None, _ddp_hook(stats))
    if method == "ddp_adamw":
        opt = build_optimizer(model, optimizer="adamw", lr=args.adamw_lr)
    elif method == "zero_adamw":
        opt = ZeroRedundancyOptimizer(
            [p for p in model.parameters() if p.requires_grad],
            optimizer_class=torch.optim.AdamW,
            lr=args.adamw_lr,
            betas=(0.9, 0.95),
        )
    else:
        opt = build_optimizer(model, optimizer="muon", **hybrid)
    return ddp, opt, model


class _Method:
    """One method's model, optimizer and counters; `step(i)` runs and times training step i."""

    def __init__(self, name: str, args: argparse.Namespace, rank: int, world: int) -> None:
        self.name, self.args, self.rank, self.world = name, args, rank, world
        self.stats = CommStats()
        self.runner, self.opt, self.model = _build(name, args, self.stats)
        self.times: list[float] = []
        self.step_stats: dict[str, Any] = {}

    def step(self, i: int) -> None:
        x, y = _batch(self.args, self.rank, self.world, i)
        self.stats.reset()
        counting = _count_broadcasts(self.stats) if self.name == "zero_adamw" else None
        start = time.perf_counter()
        self.runner(x, y).backward()
        with counting or contextlib.nullcontext():
            self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        self.times.append(time.perf_counter() - start)
        if isinstance(self.opt, LayerwiseDistributedOptimizer):
            self.step_stats = self.opt.comm_stats()
            return
        self.step_stats = self.stats.as_dict()  # DDP / ZeRO / FSDP2's collectives
        if isinstance(self.opt, FSDPOptimizer):
            theirs = self.step_stats.pop("total")
            mine = self.opt.comm_stats()
            self.step_stats.update({k: v for k, v in mine.items() if k != "total"})
            self.step_stats["optimizer_total"] = mine["total"]
            self.step_stats["total"] = {
                k: theirs[k] + mine["total"][k] for k in ("sent", "received", "calls")
            }

    def result(self) -> dict[str, Any]:
        if isinstance(self.opt, DistributedOptimizer):
            self.opt.wait_for_params()
        out: dict[str, Any] = {
            "step_s": statistics.median(self.times[self.args.warmup :]),
            "state_bytes": state_bytes(self.opt),
            "sent_bytes": self.step_stats["total"]["sent"],
            "received_bytes": self.step_stats["total"]["received"],
            "comm": self.step_stats,
        }
        if isinstance(self.opt, LayerwiseDistributedOptimizer):
            out["imbalance"] = self.opt.assignment.imbalance
            out["owned_params"] = sum(len(g["params"]) for g in self.opt.param_groups)
        if self.name.startswith("fsdp"):
            opt_total = self.step_stats.get("optimizer_total", {"sent": 0.0})
            out["optimizer_sent_bytes"] = opt_total["sent"]
            out["fsdp2_sent_bytes"] = out["sent_bytes"] - opt_total["sent"]
        if isinstance(self.opt, FSDPOptimizer):
            # fp32 gradient shards of the matrices (the optimizer's units): dim-0 shards
            out["sharded_matrix_grad_bytes"] = sum(
                4 * local_shard(self.opt.named[u.name]).numel() for u in self.opt.units
            )
        return out


class _ComputeOnly(_Method):
    """fwd + bwd (no hooks) and the owner's inner step of the layer-wise optimizer: the
    step without any communication."""

    def __init__(self, args: argparse.Namespace, rank: int, world: int) -> None:
        super().__init__("layerwise_overlap_fp32", args, rank, world)
        self.name = "compute_only"
        self.opt.remove_hooks()

    def step(self, i: int) -> None:
        x, y = _batch(self.args, self.rank, self.world, i)
        start = time.perf_counter()
        self.model(x, y).backward()
        if self.opt.inner is not None:
            self.opt.inner.step()
        for p in self.model.parameters():
            p.grad = None
        self.times.append(time.perf_counter() - start)

    def result(self) -> dict[str, Any]:
        return {"step_s": statistics.median(self.times[self.args.warmup :])}


def _run_all(args: argparse.Namespace, rank: int, world: int) -> dict[str, Any]:
    """Every method built up front, then timed step by step in rotation (so a change of
    load on a shared machine hits them alike)."""
    methods: list[_Method] = [_Method(m, args, rank, world) for m in args.methods]
    if any(m.startswith("layerwise") for m in args.methods):
        methods.append(_ComputeOnly(args, rank, world))
    for i in range(args.warmup + args.steps):
        k = i % len(methods)
        for m in methods[k:] + methods[:k]:
            C.barrier()
            m.step(i)
    return {m.name: m.result() for m in methods}


def _rank_main(rank: int, world: int, port: int, outdir: str, args: argparse.Namespace) -> None:
    os.environ["OMP_NUM_THREADS"] = str(args.threads)
    torch.set_num_threads(args.threads)
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world
    )
    try:
        results = _run_all(args, rank, world)
        torch.save(results, os.path.join(outdir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


def spawn_gloo(
    rank_main: Callable[[int, int, int, str, argparse.Namespace], None],
    world: int,
    args: argparse.Namespace,
) -> list[Any]:
    """`rank_main(rank, world, port, outdir, args)` on `world` spawned ranks (a free port on
    this machine for their gloo group); each rank saves its result to OUTDIR/rank{rank}.pt,
    returned here in rank order."""
    with tempfile.TemporaryDirectory() as outdir:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        mp.spawn(rank_main, args=(world, port, outdir, args), nprocs=world, join=True)
        return [load_file(os.path.join(outdir, f"rank{r}.pt")) for r in range(world)]


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Spawn `args.nproc` gloo ranks, run every method, and assemble the report."""
    world = args.nproc
    per_rank = spawn_gloo(_rank_main, world, args)
    rows: dict[str, dict[str, Any]] = {}
    for m in args.methods:
        rs = [pr[m] for pr in per_rank]
        row = {
            "step_s": max(r["step_s"] for r in rs),
            "state_bytes_per_rank": [r["state_bytes"] for r in rs],
            "state_bytes_max": max(r["state_bytes"] for r in rs),
            "sent_bytes_per_rank": [r["sent_bytes"] for r in rs],
            "sent_bytes_mean": statistics.fmean(r["sent_bytes"] for r in rs),
            "comm_rank0": rs[0]["comm"],
        }
        if m.startswith("layerwise"):
            row["compute_only_s"] = max(pr["compute_only"]["step_s"] for pr in per_rank)
            row["exposed_comm_s"] = row["step_s"] - row["compute_only_s"]
            row["imbalance"] = rs[0]["imbalance"]
        if m.startswith("fsdp"):
            row["fsdp2_sent_bytes_mean"] = statistics.fmean(r["fsdp2_sent_bytes"] for r in rs)
            row["optimizer_sent_bytes_mean"] = statistics.fmean(
                r["optimizer_sent_bytes"] for r in rs
            )
        if "sharded_matrix_grad_bytes" in rs[0]:
            grad = statistics.fmean(r["sharded_matrix_grad_bytes"] for r in rs)
            row["optimizer_bytes_over_sharded_grad"] = row["optimizer_sent_bytes_mean"] / grad
        rows[m] = row
    if "fsdp_adamw" in rows:
        for row in rows.values():
            row["step_time_vs_fsdp_adamw"] = row["step_s"] / rows["fsdp_adamw"]["step_s"]
    return {
        "benchmark": "dist",
        "fsdp": args.fsdp,
        "nproc": world,
        "model": dict(
            layers=args.layers,
            width=args.width,
            heads=args.heads,
            seq_len=args.seq_len,
            global_batch=args.batch,
            params=sum(p.numel() for p in gpt_model(args).parameters()),
        ),
        "steps": args.steps,
        "threads_per_rank": args.threads,
        "bucket_mb": args.bucket_mb,
        "environment": environment(),
        "methods": rows,
        "targets": _targets(rows, world) if not args.fsdp else {},
    }


def _targets(rows: dict[str, dict[str, Any]], world: int) -> dict[str, Any]:
    """The issue's targets as measured ratios (None where a needed method was not run)."""

    def ratio(a: str, b: str, key: str) -> float | None:
        if a in rows and b in rows and rows[b][key]:
            return rows[a][key] / rows[b][key]
        return None

    out: dict[str, Any] = {
        "bytes_fp32_vs_zero": ratio("layerwise_overlap_fp32", "zero_adamw", "sent_bytes_mean"),
        "bytes_fp32_vs_zero_target": 1.01,
        "bytes_bf16_vs_zero": ratio("layerwise_overlap_bf16", "zero_adamw", "sent_bytes_mean"),
        "bytes_bf16_vs_zero_target": 0.76,
        "state_vs_redundant_muon": ratio("layerwise_overlap_fp32", "ddp_muon", "state_bytes_max"),
        "state_vs_redundant_muon_target": 1 / world + 0.05,
    }
    on, off = rows.get("layerwise_overlap_fp32"), rows.get("layerwise_no_overlap_fp32")
    if on and off and off["exposed_comm_s"] > 0:
        out["exposed_comm_overlap_vs_not"] = on["exposed_comm_s"] / off["exposed_comm_s"]
    out["exposed_comm_overlap_vs_not_target"] = 0.5
    return out


def _render(report: dict[str, Any]) -> str:
    m = report["model"]
    head = (
        f"orthoptim bench dist{' --fsdp' if report['fsdp'] else ''}: {report['nproc']} gloo "
        f"ranks, GPT {m['layers']}x{m['width']} ({m['params'] / 1e6:.2f}M params), global batch "
        f"{m['global_batch']}x{m['seq_len']}, {report['threads_per_rank']} thread(s)/rank, "
        f"median of {report['steps']} steps, float32"
    )
    if report["fsdp"]:
        return _render_fsdp(head, report)
    lines = [
        head,
        f"{'method':28s} {'step ms':>9s} {'compute ms':>10s} {'exposed ms':>10s} "
        f"{'state MB/rank':>13s} {'sent MB/rank':>12s}",
    ]
    for name, r in report["methods"].items():
        comp = f"{1e3 * r['compute_only_s']:10.1f}" if "compute_only_s" in r else f"{'':10s}"
        exp = f"{1e3 * r['exposed_comm_s']:10.1f}" if "exposed_comm_s" in r else f"{'':10s}"
        lines.append(
            f"{name:28s} {1e3 * r['step_s']:9.1f} {comp} {exp} "
            f"{r['state_bytes_max'] / 2**20:13.2f} {r['sent_bytes_mean'] / 2**20:12.2f}"
        )
    t = report["targets"]

    def fmt(key: str, op: str) -> str:
        v = t.get(key)
        shown = "n/a" if v is None else f"{v:.3f}"
        ok = "" if v is None else ("  ok" if v <= t[key + "_target"] else "  MISSED")
        return f"  {key:32s} {shown:>7s}  (target {op} {t[key + '_target']:.3f}){ok}"

    lines.append("targets (layer-wise Muon vs the baselines):")
    for key in (
        "bytes_fp32_vs_zero",
        "bytes_bf16_vs_zero",
        "state_vs_redundant_muon",
        "exposed_comm_overlap_vs_not",
    ):
        lines.append(fmt(key, "<="))
    return "\n".join(lines)


def _render_fsdp(head: str, report: dict[str, Any]) -> str:
    lines = [
        head,
        f"{'method':16s} {'step ms':>9s} {'vs adamw':>9s} {'state MB/rank':>13s} "
        f"{'sent MB/rank':>12s} {'FSDP2 MB':>9s} {'optim MB':>9s} {'optim/shard grad':>16s}",
    ]
    for name, r in report["methods"].items():
        ratio = r.get("optimizer_bytes_over_sharded_grad")
        mb = {k: r[k] / 2**20 for k in ("state_bytes_max", "sent_bytes_mean")}
        fsdp2, mine = r["fsdp2_sent_bytes_mean"] / 2**20, r["optimizer_sent_bytes_mean"] / 2**20
        vs = r.get("step_time_vs_fsdp_adamw", math.nan)
        lines.append(
            f"{name:16s} {1e3 * r['step_s']:9.1f} {vs:9.3f} "
            f"{mb['state_bytes_max']:13.2f} {mb['sent_bytes_mean']:12.2f} {fsdp2:9.2f} {mine:9.2f} "
            f"{'' if ratio is None else f'{ratio:.3f}':>16s}"
        )
    return "\n".join(lines)


def _cmd(args: argparse.Namespace) -> int:
    if args.nproc < 2:
        raise SystemExit(f"--nproc must be >= 2 (a data-parallel comparison), got {args.nproc}")
    if args.batch % args.nproc:
        raise SystemExit(f"--batch ({args.batch}) must be divisible by --nproc ({args.nproc})")
    known = FSDP_METHODS if args.fsdp else METHODS
    if args.methods is None:
        args.methods = list(known)
    unknown = [m for m in args.methods if m not in known]
    if unknown:
        raise SystemExit(
            f"--methods: unknown {unknown}{' under --fsdp' if args.fsdp else ''}; "
            f"choose from {', '.join(known)}"
        )
    try:
        import orthoptim.train.model  # noqa: F401
    except ImportError as exc:
        raise SystemExit(f"bench dist needs orthoptim.train.model (the GPT): {exc}") from exc
    emit(run(args), args.json, _render)
    return 0


def add_parser(bench_subparsers: argparse._SubParsersAction) -> None:
    """Register `orthoptim bench dist`."""
    p = bench_subparsers.add_parser(
        "dist",
        help="layer-wise Muon vs DDP/ZeRO AdamW and redundant Muon on N gloo ranks "
        "(--fsdp: FSDPOptimizer vs FSDP2 + AdamW)",
    )
    p.add_argument("--nproc", type=int, default=2, help="data-parallel ranks (default 2)")
    p.add_argument("--layers", type=int, default=4, help="transformer blocks of the GPT")
    p.add_argument("--width", type=int, default=256, help="model width of the GPT")
    p.add_argument("--heads", type=int, default=4, help="attention heads of the GPT")
    p.add_argument("--seq-len", type=int, default=128, help="tokens per sequence")
    p.add_argument("--batch", type=int, default=8, help="global batch (sequences)")
    p.add_argument("--steps", type=int, default=8, help="timed steps per method")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps first")
    p.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    p.add_argument(
        "--bucket-mb", type=float, default=25.0, help="gradient bucket size in MiB (default 25)"
    )
    p.add_argument("--lr", type=float, default=0.02, help="Muon learning rate")
    p.add_argument("--adamw-lr", type=float, default=3e-4, help="AdamW learning rate")
    p.add_argument("--seed", type=int, default=0, help="seed of the model and the batches")
    p.add_argument(
        "--methods",
        type=lambda s: [m.strip() for m in s.split(",") if m.strip()],
        default=None,
        help=f"comma-separated subset of {','.join(METHODS)} "
        f"(with --fsdp: of {','.join(FSDP_METHODS)}); default all",
    )
    p.add_argument(
        "--fsdp",
        action="store_true",
        help="shard the model with FSDP2: FSDPOptimizer (Muon) vs FSDP2 + AdamW",
    )
    p.add_argument("--json", action="store_true", help="print one JSON document")
    p.set_defaults(func=_cmd)
