"""Models, batches and helpers shared by the GPU suite (device-aware versions of the builders
in tests/test_layerwise.py and tests/test_fsdp.py).

Every multi-rank check trains on a global batch of BATCH sequences: rank r takes rows
[r·BATCH/2, (r+1)·BATCH/2), the single-process reference takes all of them (the mean of the
ranks' mean losses is the full batch's mean loss: equal halves).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from distributed import run_ranks

VOCAB, SEQ, WIDTH, BATCH = 64, 8, 32, 8
WORLD = 2
# Seconds a collective may wait before the run fails (instead of hanging a GPU slot).
TIMEOUT = 300.0


class Block(nn.Module):
    def __init__(self, d: int, odd: bool = False) -> None:
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        # No qkv bias: the key bias has an exactly-zero gradient (softmax is shift-invariant),
        # and AdamW turns the rounding noise of a zero gradient into full-size steps.
        self.qkv, self.proj = nn.Linear(d, 3 * d, bias=False), nn.Linear(d, d)
        self.fc, self.fc2 = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)
        # 3 rows: uneven dim-0 shards at 2 ranks (FSDP).
        self.gate = nn.Linear(d, 3, bias=False) if odd else None
        self.up = nn.Linear(3, d, bias=False) if odd else None

    def forward(self, x: Tensor) -> Tensor:
        B, T, C = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(B, T, 3, 2, C // 2).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(B, T, C))
        if self.gate is not None:
            x = x + self.up(torch.tanh(self.gate(x)))
        return x + self.fc2(F.gelu(self.fc(self.ln2(x))))


class TinyGPT(nn.Module):
    """Tied embedding / head, 1-D norms and biases; positions made on the input's device."""

    def __init__(self, d: int = WIDTH, layers: int = 2, odd: bool = False) -> None:
        super().__init__()
        self.tok, self.pos = nn.Embedding(VOCAB, d), nn.Embedding(SEQ, d)
        self.blocks = nn.ModuleList(Block(d, odd) for _ in range(layers))
        self.ln_f = nn.LayerNorm(d)
        self.lm_head = nn.Linear(d, VOCAB, bias=False)
        self.lm_head.weight = self.tok.weight

    def forward(self, idx: Tensor) -> Tensor:
        x = self.tok(idx) + self.pos(torch.arange(idx.shape[1], device=idx.device))
        for b in self.blocks:
            x = b(x)
        return self.lm_head(self.ln_f(x))


def make_model(
    device: str, dtype: torch.dtype = torch.float64, seed: int = 0, odd: bool = False
) -> TinyGPT:
    """The same initial weights on every rank and device (drawn on the CPU, then moved)."""
    torch.manual_seed(seed)
    return TinyGPT(odd=odd).to(device=device, dtype=dtype)


def batch(step: int, device: str, rank: int | None = None) -> tuple[Tensor, Tensor]:
    """Step `step`'s global batch (inputs, targets), or rank `rank`'s half of it."""
    g = torch.Generator().manual_seed(1000 + step)
    idx = torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=g)
    if rank is not None:
        per = BATCH // WORLD
        idx = idx[rank * per : (rank + 1) * per]
    idx = idx.to(device)
    return idx[:, :-1], idx[:, 1:]


def loss_fn(model: nn.Module, x: Tensor, y: Tensor) -> Tensor:
    return F.cross_entropy(model(x).flatten(0, 1), y.flatten())


def train(
    model: nn.Module,
    opt: torch.optim.Optimizer,
    steps: range,
    device: str,
    rank: int | None = None,
) -> None:
    """Steps over the global batches (rank None) or over rank `rank`'s halves."""
    for step in steps:
        loss_fn(model, *batch(step, device, rank)).backward()
        opt.step()
        opt.zero_grad()
    wait = getattr(opt, "wait_for_params", None)
    if wait is not None:
        wait()


def params(model: nn.Module) -> dict[str, Tensor]:
    """Detached CPU copies of the parameters (a DTensor's local shard)."""
    out = {}
    for n, p in model.named_parameters():
        t = p.to_local() if hasattr(p, "to_local") else p
        out[n] = t.detach().to("cpu", copy=True)
    return out


def to_cpu(obj: Any) -> Any:
    """`obj` with every tensor moved to the CPU (what ranks return is compared there)."""
    if isinstance(obj, Tensor):
        return obj.detach().to("cpu", copy=True)
    if isinstance(obj, dict):
        return {k: to_cpu(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(to_cpu(v) for v in obj)
    return obj


def rel_errors(got: dict[str, Tensor], want: dict[str, Tensor]) -> dict[str, float]:
    """‖got − want‖ / ‖want‖ per name (float64 norms)."""
    assert got.keys() == want.keys(), (sorted(got), sorted(want))
    return {
        n: ((got[n].double() - w.double()).norm() / w.double().norm().clamp_min(1e-300)).item()
        for n, w in want.items()
    }


def assert_close_rel(
    got: dict[str, Tensor], want: dict[str, Tensor], rtol: float, label: str = ""
) -> float:
    """Every relative error at most `rtol`; returns the largest."""
    errors = rel_errors(got, want)
    bad = {n: e for n, e in errors.items() if not e <= rtol}
    assert not bad, f"{label}: relative errors above {rtol}: {bad}"
    return max(errors.values())


def assert_replicas_equal(results: list[dict], key: str) -> None:
    """Every rank holds bitwise the same parameters under `key`."""
    for rank, res in enumerate(results[1:], start=1):
        for n, p in res[key].items():
            assert torch.equal(p, results[0][key][n]), f"rank {rank} differs on {key} {n}"


def setup_rank(device: str) -> None:
    """What every rank (and the single-process reference inside rank 0) runs under: full
    fp32 matmul precision (no TF32) and, on CUDA, deterministic kernels, so the same inputs
    give the same bits in every process."""
    torch.set_float32_matmul_precision("highest")
    if torch.device(device).type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
        torch.use_deterministic_algorithms(True, warn_only=True)


def spawn(env: Any, fn: Callable[..., Any], *args: Any, timeout: float = TIMEOUT) -> list[Any]:
    """Run fn(rank, WORLD, env.device, *args) on WORLD ranks of `env.backend`, every rank on
    `env.device` (one GPU shared under "cuda:gloo"); `timeout` bounds each collective's wait."""
    return run_ranks(
        fn,
        WORLD,
        args=(env.device, *args),
        backend=env.backend,
        device=env.device,
        timeout=timeout,
    )
