"""A small decoder-only transformer over bytes: the model `orthoptim train` optimizes.

Pre-norm blocks (RMSNorm → causal self-attention with rotary embeddings → RMSNorm → MLP),
an untied output head named `lm_head`. Q, K, V and the attention output are separate
Linear layers, as are the two MLP matrices, so every hidden matrix is a whole matrix for
Muon, and `build_optimizer`'s default routing sends the embedding, the head and every
norm gain to AdamW.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import Tensor, nn

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor.parallel import ParallelStyle

VOCAB_SIZE = 256  # byte-level tokens


@dataclass(frozen=True)
class GPTConfig:
    """Shape of the model. `seq_len` is the context length the loop trains at."""

    n_layer: int = 4
    n_head: int = 4
    d_model: int = 128
    mlp_ratio: int = 4
    seq_len: int = 128
    vocab_size: int = VOCAB_SIZE
    rope_base: float = 10000.0

    def __post_init__(self) -> None:
        for name in ("n_layer", "n_head", "d_model", "mlp_ratio", "seq_len", "vocab_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"GPTConfig.{name} must be >= 1, got {getattr(self, name)}")
        if self.d_model % self.n_head or (self.d_model // self.n_head) % 2:
            raise ValueError(
                f"GPTConfig: d_model ({self.d_model}) must split into n_head ({self.n_head}) "
                "heads of even size (rotary embeddings rotate pairs of channels)"
            )

    def as_dict(self) -> dict[str, float]:
        return asdict(self)


# `tiny` trains in a minute or two on 2 CPU cores; `small` is a laptop-sized experiment.
CONFIGS: dict[str, GPTConfig] = {
    "tiny": GPTConfig(n_layer=4, n_head=4, d_model=128, seq_len=128),
    "small": GPTConfig(n_layer=6, n_head=6, d_model=384, seq_len=256),
}


def get_config(name: str) -> GPTConfig:
    """The named model config; a clear error lists the known names."""
    if name not in CONFIGS:
        raise ValueError(f"--config must be one of {sorted(CONFIGS)}, got {name!r}")
    return CONFIGS[name]


def rotary_tables(seq_len: int, head_dim: int, base: float) -> tuple[Tensor, Tensor]:
    """cos and sin tables [seq_len, head_dim/2] of rotary position embeddings."""
    inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
    angles = torch.outer(torch.arange(seq_len, dtype=torch.float32), inv_freq)
    return angles.cos(), angles.sin()


def apply_rotary(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate channel pairs (first half, second half) of x [B, H, T, D] by position angle."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1)


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.head_dim = cfg.d_model // cfg.n_head
        self.q = nn.Linear(cfg.d_model, cfg.d_model, bias=False)
        self.k = nn.Linear(cfg.d_model, cfg.d_model, bias=False)
        self.v = nn.Linear(cfg.d_model, cfg.d_model, bias=False)
        self.proj = nn.Linear(cfg.d_model, cfg.d_model, bias=False)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        B, T, _ = x.shape
        # -1 heads: under tensor parallelism q, k, v hold this rank's share of the heads.
        shape = (B, T, -1, self.head_dim)
        q = self.q(x).view(shape).transpose(1, 2)
        k = self.k(x).view(shape).transpose(1, 2)
        v = self.v(x).view(shape).transpose(1, 2)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(B, T, -1))


class MLP(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.fc = nn.Linear(cfg.d_model, cfg.mlp_ratio * cfg.d_model, bias=False)
        self.proj = nn.Linear(cfg.mlp_ratio * cfg.d_model, cfg.d_model, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        return self.proj(F.gelu(self.fc(x)))


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.attn_norm = nn.RMSNorm(cfg.d_model)
        self.attn = CausalSelfAttention(cfg)
        self.mlp_norm = nn.RMSNorm(cfg.d_model)
        self.mlp = MLP(cfg)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        x = x + self.attn(self.attn_norm(x), cos, sin)
        return x + self.mlp(self.mlp_norm(x))


class GPT(nn.Module):
    """Byte-level GPT. `forward(idx, targets=None)` returns logits, or the mean loss."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.embed = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.norm = nn.RMSNorm(cfg.d_model)
        self.lm_head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        cos, sin = rotary_tables(cfg.seq_len, cfg.d_model // cfg.n_head, cfg.rope_base)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)
        self._init_weights()

    def _init_weights(self) -> None:
        std = 0.02
        for name, p in self.named_parameters():
            if p.ndim < 2:
                continue
            nn.init.normal_(p, mean=0.0, std=std)
            if name.endswith("proj.weight"):
                # Residual-branch outputs scaled by depth (GPT-2): the stream's variance stays flat.
                p.data.mul_(1.0 / math.sqrt(2 * self.cfg.n_layer))

    def forward(self, idx: Tensor, targets: Tensor | None = None) -> Tensor:
        T = idx.shape[1]
        if self.cfg.seq_len < T:
            raise ValueError(f"sequence length {T} exceeds the model's seq_len {self.cfg.seq_len}")
        cos, sin = self.rope_cos[:T], self.rope_sin[:T]
        x = self.embed(idx)
        for block in self.blocks:
            x = block(x, cos, sin)
        logits = self.lm_head(self.norm(x))
        if targets is None:
            return logits
        return F.cross_entropy(logits.float().view(-1, logits.shape[-1]), targets.reshape(-1))


def check_tensor_parallel(cfg: GPTConfig, tp: int) -> None:
    """Refuse a tensor-parallel size that does not split the heads and the MLP evenly."""
    if cfg.n_head % tp or (cfg.mlp_ratio * cfg.d_model) % tp:
        raise ValueError(
            f"--tp {tp} must divide the model's {cfg.n_head} attention heads and its "
            f"{cfg.mlp_ratio * cfg.d_model} MLP channels; pick a divisor of {cfg.n_head}"
        )


def parallelize(model: GPT, tp_mesh: DeviceMesh) -> GPT:
    """Megatron-style tensor parallelism over `tp_mesh`: Q, K, V and the MLP's first matrix
    column-parallel (each rank a block of heads / channels), the attention output and the
    MLP's second matrix row-parallel (one all-reduce after each). The embedding, the head and
    the norms stay replicated. Parameters become DTensors; the model is changed in place."""
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    check_tensor_parallel(model.cfg, tp_mesh.size())
    plan: dict[str, ParallelStyle] = {}
    for i in range(model.cfg.n_layer):
        for name in ("attn.q", "attn.k", "attn.v", "mlp.fc"):
            plan[f"blocks.{i}.{name}"] = ColwiseParallel()
        for name in ("attn.proj", "mlp.proj"):
            plan[f"blocks.{i}.{name}"] = RowwiseParallel()
    return parallelize_module(model, tp_mesh, plan)
