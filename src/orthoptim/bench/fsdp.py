"""`orthoptim bench fsdp`: Muon over FSDP2-sharded parameters vs FSDP2 + AdamW, on N gloo ranks.

The same small GPT-shaped model (tied embedding / head, per layer qkv, proj, MLP up and down,
LayerNorms) is wrapped with `fully_shard` per block and at the root, and trained on the same
global batch (each rank its slice) with:

  fsdp_adamw        torch.optim.AdamW over the DTensor parameters (elementwise, no extra comm)
  fsdp_muon         orthoptim's FSDPOptimizer (Muon hybrid), updates in float32 on the wire
  fsdp_muon_bf16    the same, updates in bfloat16 on the wire

For each: step time (fwd + bwd + step, median over steps, slowest rank), optimizer-step time
alone, and the optimizer's bytes per rank per step as collectives.py counts them, next to the
sharded matrix-gradient bytes per rank (the issue's "≈ 2 × sharded gradient" target) and
FSDP2's own traffic by formula (two parameter all-gathers and one gradient reduce-scatter:
3·(N−1)/N of the parameter bytes), which is the same for every method.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch import nn

from orthoptim.bench import emit, environment

METHODS = ("fsdp_adamw", "fsdp_muon", "fsdp_muon_bf16")


class _Block(nn.Module):
    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.proj = nn.Linear(d, 3 * d, bias=False), nn.Linear(d, d, bias=False)
        self.fc, self.fc2 = nn.Linear(d, 4 * d, bias=False), nn.Linear(4 * d, d, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        qkv = self.qkv(self.ln1(x)).view(B, T, 3, self.heads, C // self.heads)
        q, k, v = qkv.permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(B, T, C))
        return x + self.fc2(F.gelu(self.fc(self.ln2(x))))


class _GPT(nn.Module):
    def __init__(self, vocab: int, seq: int, d: int, layers: int, heads: int) -> None:
        super().__init__()
        self.tok, self.pos = nn.Embedding(vocab, d), nn.Embedding(seq, d)
        self.blocks = nn.ModuleList(_Block(d, heads) for _ in range(layers))
        self.ln_f = nn.LayerNorm(d)
        self.lm_head = nn.Linear(d, vocab, bias=False)
        self.lm_head.weight = self.tok.weight

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.tok(idx) + self.pos(torch.arange(idx.shape[1]))
        for b in self.blocks:
            x = b(x)
        return self.lm_head(self.ln_f(x))


def _run_method(args: argparse.Namespace, rank: int, world: int, method: str) -> dict[str, Any]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from orthoptim.parallel.fsdp import FSDPOptimizer

    torch.manual_seed(args.seed)
    model = _GPT(args.vocab, args.seq_len, args.width, args.layers, args.heads)
    param_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    mesh = init_device_mesh("cpu", (world,))
    for b in model.blocks:
        fully_shard(b, mesh=mesh)
    fully_shard(model, mesh=mesh)
    if method == "fsdp_adamw":
        opt: Any = torch.optim.AdamW(model.parameters(), lr=3e-4)
    else:
        wire = torch.bfloat16 if method == "fsdp_muon_bf16" else None
        opt = FSDPOptimizer(model, optimizer="muon", lr=0.02, comm_dtype=wire)
    per = args.batch // world
    step_times, opt_times = [], []
    for step in range(args.warmup + args.steps):
        g = torch.Generator().manual_seed(args.seed * 1000 + step)
        idx = torch.randint(0, args.vocab, (args.batch, args.seq_len + 1), generator=g)
        idx = idx[rank * per : (rank + 1) * per]
        dist.barrier()
        t0 = time.perf_counter()
        logits = model(idx[:, :-1])
        F.cross_entropy(logits.flatten(0, 1), idx[:, 1:].flatten()).backward()
        t1 = time.perf_counter()
        opt.step()
        opt.zero_grad()
        t2 = time.perf_counter()
        if step >= args.warmup:
            step_times.append(t2 - t0)
            opt_times.append(t2 - t1)
    out: dict[str, Any] = {
        "step_s": statistics.median(step_times),
        "opt_step_s": statistics.median(opt_times),
        "fsdp2_bytes_formula": 3 * (world - 1) / world * param_bytes,
        "opt_sent_bytes": 0.0,
        "sharded_matrix_grad_bytes": 0.0,
    }
    if method != "fsdp_adamw":
        out["opt_sent_bytes"] = opt.comm_stats()["total"]["sent"]
        out["sharded_matrix_grad_bytes"] = sum(m.numels[rank] * 4 for m in opt._matrices)
    return out


def _worker(rank: int, world: int, port: int, outdir: str, args: argparse.Namespace) -> None:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world
    )
    try:
        results = {m: _run_method(args, rank, world, m) for m in args.methods}
        torch.save(results, os.path.join(outdir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Spawn the ranks, run every method, and combine: times from the slowest rank, bytes
    from the rank that sends most."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    # The parsed arguments carry the CLI's handler, which cannot be pickled to the ranks.
    plain = argparse.Namespace(**{k: v for k, v in vars(args).items() if k != "func"})
    with tempfile.TemporaryDirectory() as outdir:
        mp.spawn(_worker, args=(args.world_size, port, outdir, plain), nprocs=args.world_size)
        ranks = [
            torch.load(os.path.join(outdir, f"rank{r}.pt"), weights_only=False)
            for r in range(args.world_size)
        ]
    methods: dict[str, Any] = {}
    for m in args.methods:
        per = [r[m] for r in ranks]
        row = {
            "step_s": max(p["step_s"] for p in per),
            "opt_step_s": max(p["opt_step_s"] for p in per),
            "opt_sent_bytes_max_rank": max(p["opt_sent_bytes"] for p in per),
            "opt_sent_bytes_mean_rank": statistics.mean(p["opt_sent_bytes"] for p in per),
            "sharded_matrix_grad_bytes_mean_rank": statistics.mean(
                p["sharded_matrix_grad_bytes"] for p in per
            ),
            "fsdp2_bytes_formula": per[0]["fsdp2_bytes_formula"],
        }
        if row["sharded_matrix_grad_bytes_mean_rank"]:
            row["opt_bytes_over_sharded_grad"] = (
                row["opt_sent_bytes_mean_rank"] / row["sharded_matrix_grad_bytes_mean_rank"]
            )
        methods[m] = row
    base = methods.get("fsdp_adamw")
    if base:
        for row in methods.values():
            row["step_time_vs_adamw"] = row["step_s"] / base["step_s"]
    return {
        "benchmark": "fsdp",
        "world_size": args.world_size,
        "model": dict(
            layers=args.layers,
            width=args.width,
            heads=args.heads,
            vocab=args.vocab,
            seq_len=args.seq_len,
            batch=args.batch,
        ),
        "steps": args.steps,
        "dtype": "float32",
        "environment": environment(),
        "methods": methods,
    }


def _render(report: dict[str, Any]) -> str:
    lines = [
        f"orthoptim bench fsdp: {report['world_size']} gloo ranks, model {report['model']}, "
        f"median of {report['steps']} steps, float32",
        f"{'method':<16}{'step ms':>10}{'opt ms':>10}{'vs adamw':>10}"
        f"{'opt KiB/rank':>14}{'/ shard grad':>14}{'FSDP2 KiB':>12}",
    ]
    for name, r in report["methods"].items():
        lines.append(
            f"{name:<16}{r['step_s'] * 1e3:>10.1f}{r['opt_step_s'] * 1e3:>10.1f}"
            f"{r.get('step_time_vs_adamw', float('nan')):>10.2f}"
            f"{r['opt_sent_bytes_mean_rank'] / 1024:>14.1f}"
            f"{r.get('opt_bytes_over_sharded_grad', 0.0):>14.2f}"
            f"{r['fsdp2_bytes_formula'] / 1024:>12.1f}"
        )
    return "\n".join(lines)


def add_parser(bench_subparsers: argparse._SubParsersAction) -> None:
    """Register `orthoptim bench fsdp`."""
    p = bench_subparsers.add_parser(
        "fsdp", help="Muon over FSDP2-sharded parameters vs FSDP2 + AdamW (gloo ranks)"
    )
    p.add_argument("--world-size", type=int, default=2)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--width", type=int, default=128)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--vocab", type=int, default=256)
    p.add_argument("--seq-len", type=int, default=32)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--methods", nargs="+", choices=METHODS, default=list(METHODS))
    p.add_argument("--json", action="store_true", help="print the report as JSON")

    def main(args: argparse.Namespace) -> int:
        if args.world_size < 2 or args.batch % args.world_size:
            raise SystemExit("--world-size must be >= 2 and divide --batch")
        emit(run(args), args.json, _render)
        return 0

    p.set_defaults(func=main)
