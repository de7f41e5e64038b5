"""A small decoder-only transformer over bytes: the model `orthoptim train` optimizes.

Pre-norm blocks (RMSNorm → causal self-attention with rotary embeddings → RMSNorm → MLP),
an untied output head named `lm_head`. `build_optimizer`'s default routing sends the
embedding, the head and every norm gain to AdamW.

Two layouts: the default keeps Q, K, V and the two (GELU) MLP matrices separate Linear layers;
`fused=True` stores one `qkv` matrix and a SwiGLU MLP with one `gate_up` matrix, and the model
reports the row blocks of those matrices through `split_spec()` so that Muon orthogonalizes
q, k, v (and gate, up) on their own. `n_kv_head` < `n_head` is grouped-query attention.
`moe` replaces the MLP by top-k routed SwiGLU experts stored as 3-D [E, out, in] parameters.

MuonClip protocol (see `orthoptim.optim.qk_clip`): `record_attention_logits(True)` makes every
attention layer keep the largest pre-softmax logit per head seen in training forwards (this
costs one extra q·kᵀ per layer, so it is off by default); `attention_max_logits()` returns and
resets them; `qk_clip_heads()` says where each head's query and key rows live.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from orthoptim.optim.muon import Split, qkv_split
from orthoptim.optim.qk_clip import QKHeads

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor.parallel import ParallelStyle

VOCAB_SIZE = 256  # byte-level tokens


@dataclass(frozen=True)
class MoEConfig:
    """Routed experts: each token goes to its `top_k` of `n_expert` SwiGLU experts of hidden
    size `hidden`, weighted by the renormalised router probabilities."""

    n_expert: int = 8
    top_k: int = 2
    hidden: int = 256

    def __post_init__(self) -> None:
        for name in ("n_expert", "top_k", "hidden"):
            if getattr(self, name) < 1:
                raise ValueError(f"MoEConfig.{name} must be >= 1, got {getattr(self, name)}")
        if self.top_k > self.n_expert:
            raise ValueError(
                f"MoEConfig.top_k ({self.top_k}) must be <= n_expert ({self.n_expert})"
            )


@dataclass(frozen=True)
class GPTConfig:
    """Shape of the model. `seq_len` is the context length the loop trains at.

    `n_kv_head` (None: `n_head`) key/value heads; `fused`: one qkv matrix and a SwiGLU MLP with
    one gate/up matrix; `moe`: routed experts instead of the MLP; `qk_clip`: the MuonClip
    threshold τ the training loop applies by default (None: no clipping).
    """

    n_layer: int = 4
    n_head: int = 4
    d_model: int = 128
    mlp_ratio: int = 4
    seq_len: int = 128
    vocab_size: int = VOCAB_SIZE
    rope_base: float = 10000.0
    n_kv_head: int | None = None
    fused: bool = False
    moe: MoEConfig | None = None
    qk_clip: float | None = None

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_head

    @property
    def kv_heads(self) -> int:
        return self.n_head if self.n_kv_head is None else self.n_kv_head

    def __post_init__(self) -> None:
        for name in ("n_layer", "n_head", "d_model", "mlp_ratio", "seq_len", "vocab_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"GPTConfig.{name} must be >= 1, got {getattr(self, name)}")
        if self.d_model % self.n_head or (self.d_model // self.n_head) % 2:
            raise ValueError(
                f"GPTConfig: d_model ({self.d_model}) must split into n_head ({self.n_head}) "
                "heads of even size (rotary embeddings rotate pairs of channels)"
            )
        if not 1 <= self.kv_heads <= self.n_head or self.n_head % self.kv_heads:
            raise ValueError(
                f"GPTConfig.n_kv_head ({self.n_kv_head}) must divide n_head ({self.n_head})"
            )

    def as_dict(self) -> dict[str, float]:
        return asdict(self)


# `tiny` trains in a minute or two on 2 CPU cores; `small` is a laptop-sized experiment;
# `base` is GPU-sized: 10 layers x 1024 wide x 16 heads of 64, context 1024, 126,374,912
# parameters (GPT-2 small's 124M, with its 38M-parameter word embedding moved into the
# transformer, since bytes need only 256 rows). Its 16 heads and 4096 MLP channels split
# evenly over --tp 2, 4, 8 or 16.
CONFIGS: dict[str, GPTConfig] = {
    "tiny": GPTConfig(n_layer=4, n_head=4, d_model=128, seq_len=128),
    "small": GPTConfig(n_layer=6, n_head=6, d_model=384, seq_len=256),
    "base": GPTConfig(n_layer=10, n_head=16, d_model=1024, seq_len=1024),
    # Mixture of experts with fused QKV (grouped-query) and gate/up, trained with MuonClip.
    "tiny-moe": GPTConfig(
        n_layer=2,
        n_head=4,
        n_kv_head=2,
        d_model=128,
        seq_len=128,
        fused=True,
        moe=MoEConfig(n_expert=8, top_k=2, hidden=256),
        qk_clip=100.0,
    ),
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
    """Rotate channel pairs (first half, second half) of x [B, H, T, D] by position angle.

    The result has x's dtype (under bf16 autocast q and k stay bf16, like v); the fp32 tables
    promote the rotation itself to fp32."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1).type_as(x)


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.n_head, self.n_kv, self.head_dim = cfg.n_head, cfg.kv_heads, cfg.head_dim
        q_rows, kv_rows = cfg.n_head * cfg.head_dim, cfg.kv_heads * cfg.head_dim
        self.fused = cfg.fused
        if cfg.fused:
            self.qkv = nn.Linear(cfg.d_model, q_rows + 2 * kv_rows, bias=False)
        else:
            self.q = nn.Linear(cfg.d_model, q_rows, bias=False)
            self.k = nn.Linear(cfg.d_model, kv_rows, bias=False)
            self.v = nn.Linear(cfg.d_model, kv_rows, bias=False)
        self.proj = nn.Linear(cfg.d_model, cfg.d_model, bias=False)
        self.record_logits = False
        self.max_logits: Tensor | None = None

    def split_spec(self) -> dict[str, Split]:
        """Row blocks of the fused qkv weight (q, k, v), relative to this module."""
        if not self.fused:
            return {}
        return {"qkv.weight": qkv_split(self.n_head, self.head_dim, self.n_kv)}

    def qk_heads(self, prefix: str) -> QKHeads:
        """Where the query and key rows of each head live."""
        if self.fused:
            w = f"{prefix}qkv.weight"
            return QKHeads(
                w, w, self.n_head, self.n_kv, self.head_dim, 0, self.n_head * self.head_dim
            )
        return QKHeads(
            f"{prefix}q.weight", f"{prefix}k.weight", self.n_head, self.n_kv, self.head_dim
        )

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        B, T, _ = x.shape
        hd = self.head_dim
        if self.fused:
            q, k, v = self.qkv(x).split([self.n_head * hd, self.n_kv * hd, self.n_kv * hd], -1)
        else:
            q, k, v = self.q(x), self.k(x), self.v(x)
        # -1 heads: under tensor parallelism q, k, v hold this rank's share of the heads.
        q = q.view(B, T, -1, hd).transpose(1, 2)
        k = k.view(B, T, -1, hd).transpose(1, 2)
        v = v.view(B, T, -1, hd).transpose(1, 2)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        if self.n_kv != self.n_head:
            k = k.repeat_interleave(self.n_head // self.n_kv, dim=1)
            v = v.repeat_interleave(self.n_head // self.n_kv, dim=1)
        if self.record_logits and self.training:
            self._record(q, k)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(B, T, -1))

    @torch.no_grad()
    def _record(self, q: Tensor, k: Tensor) -> None:
        """Keep the largest causal pre-softmax logit per head (the extra q·kᵀ)."""
        T = q.shape[2]
        logits = (q @ k.transpose(-2, -1)) / math.sqrt(self.head_dim)
        future = torch.ones(T, T, dtype=torch.bool, device=q.device).triu(1)
        top = logits.masked_fill(future, float("-inf")).amax(dim=(0, 2, 3)).float()
        self.max_logits = top if self.max_logits is None else torch.maximum(self.max_logits, top)


class MLP(nn.Module):
    """GELU MLP (fc, proj), or with `fused` a SwiGLU MLP with one gate/up matrix."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        hidden = cfg.mlp_ratio * cfg.d_model
        self.fused = cfg.fused
        if cfg.fused:
            self.gate_up = nn.Linear(cfg.d_model, 2 * hidden, bias=False)
        else:
            self.fc = nn.Linear(cfg.d_model, hidden, bias=False)
        self.proj = nn.Linear(hidden, cfg.d_model, bias=False)

    def split_spec(self) -> dict[str, Split]:
        if not self.fused:
            return {}
        half = self.gate_up.out_features // 2
        return {"gate_up.weight": (half, half)}

    def forward(self, x: Tensor) -> Tensor:
        if self.fused:
            gate, up = self.gate_up(x).chunk(2, dim=-1)
            return self.proj(F.silu(gate) * up)
        return self.proj(F.gelu(self.fc(x)))


class MoE(nn.Module):
    """Top-k routed SwiGLU experts; expert weights are 3-D [E, out, in] parameters, so Muon
    orthogonalizes every expert on its own (and gate and up separately, via `split_spec`)."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        assert cfg.moe is not None
        m = cfg.moe
        self.top_k = m.top_k
        self.router = nn.Linear(cfg.d_model, m.n_expert, bias=False)
        self.experts_gate_up = nn.Parameter(torch.empty(m.n_expert, 2 * m.hidden, cfg.d_model))
        self.experts_down = nn.Parameter(torch.empty(m.n_expert, cfg.d_model, m.hidden))

    def split_spec(self) -> dict[str, Split]:
        half = self.experts_gate_up.shape[1] // 2
        return {"experts_gate_up": (half, half)}

    def forward(self, x: Tensor) -> Tensor:
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        probs = self.router(x).float().softmax(dim=-1)
        weight, chosen = probs.topk(self.top_k, dim=-1)
        weight = (weight / weight.sum(dim=-1, keepdim=True)).to(x.dtype)
        out = torch.zeros_like(x)
        for e in range(self.experts_gate_up.shape[0]):
            rows, slot = (chosen == e).nonzero(as_tuple=True)
            if rows.numel() == 0:
                continue
            gate, up = (x[rows] @ self.experts_gate_up[e].T).chunk(2, dim=-1)
            y = (F.silu(gate) * up) @ self.experts_down[e].T
            out.index_add_(0, rows, y * weight[rows, slot, None])
        return out.view(shape)


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.attn_norm = nn.RMSNorm(cfg.d_model)
        self.attn = CausalSelfAttention(cfg)
        self.mlp_norm = nn.RMSNorm(cfg.d_model)
        self.mlp: nn.Module = MoE(cfg) if cfg.moe is not None else MLP(cfg)

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
        cos, sin = rotary_tables(cfg.seq_len, cfg.head_dim, cfg.rope_base)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)
        self._init_weights()

    def _init_weights(self) -> None:
        std = 0.02
        for name, p in self.named_parameters():
            if p.ndim < 2:
                continue
            nn.init.normal_(p, mean=0.0, std=std)
            if name.endswith(("proj.weight", "experts_down")):
                # Residual-branch outputs scaled by depth (GPT-2): the stream's variance stays flat.
                p.data.mul_(1.0 / math.sqrt(2 * self.cfg.n_layer))

    def split_spec(self) -> dict[str, Split]:
        """Row blocks of every fused matrix (for `Muon(split=...)`; `build_optimizer` reads it)."""
        spec: dict[str, Split] = {}
        for name, module in self.named_modules():
            own = getattr(module, "split_spec", None)
            if module is not self and callable(own):
                spec.update({f"{name}.{k}": v for k, v in own().items()})
        return spec

    def record_attention_logits(self, on: bool = True) -> None:
        """Start (or stop) keeping per-head max logits in training forwards (costs a q·kᵀ)."""
        for block in self.blocks:
            block.attn.record_logits = on
            block.attn.max_logits = None

    def attention_max_logits(self) -> dict[str, Tensor | None]:
        """Layer → the largest pre-softmax logit per query head since the last call (None:
        no training forward), then reset."""
        out: dict[str, Tensor | None] = {}
        for i, block in enumerate(self.blocks):
            out[f"blocks.{i}.attn"] = block.attn.max_logits
            block.attn.max_logits = None
        return out

    def qk_clip_heads(self) -> dict[str, QKHeads]:
        """Layer → where its heads' query and key rows live."""
        return {
            f"blocks.{i}.attn": block.attn.qk_heads(f"blocks.{i}.attn.")
            for i, block in enumerate(self.blocks)
        }

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
        # float32 at least (bf16 logits rise to it; float64 stays)
        logits = logits.to(torch.promote_types(logits.dtype, torch.float32))
        return F.cross_entropy(logits.view(-1, logits.shape[-1]), targets.reshape(-1))


def compile_blocks(model: GPT) -> GPT:
    """Compile every transformer block with torch.compile, in place (regional compilation):
    the embedding, final norm, head and loss stay eager.

    In place (`nn.Module.compile`): the modules and parameters stay the objects an optimizer
    already holds, and state-dict keys do not change, so checkpoints move freely between
    compiled and eager runs. Identical blocks share one compiled graph. Forward pre-hooks on
    the blocks' submodules (the layer-wise optimizer's waits for parameter gathers) are traced
    with the block; dynamo guards on the Python state they read, so a hook with work to do
    forces a recompile: finish such work before calling the model (the training loop calls
    `wait_for_params()` first, which leaves the hooks nothing to do). Python-side state in
    the forward (MuonClip's logit recording) is traced the same way."""
    for block in model.blocks:
        block.compile()
    return model


def check_tensor_parallel(cfg: GPTConfig, tp: int) -> None:
    """Refuse a tensor-parallel size or a layout `parallelize` cannot split: the heads (query
    and key/value) and the MLP channels must divide evenly; fused projections and experts
    are not split by tensor parallelism here."""
    if cfg.fused or cfg.moe is not None:
        raise ValueError(
            f"--tp {tp} needs a config with separate Q/K/V and a dense MLP (fused projections "
            "and experts are not tensor-parallel here); use --config tiny or small"
        )
    if cfg.n_head % tp or cfg.kv_heads % tp or (cfg.mlp_ratio * cfg.d_model) % tp:
        raise ValueError(
            f"--tp {tp} must divide the model's {cfg.n_head} attention heads ({cfg.kv_heads} "
            f"key/value heads) and its {cfg.mlp_ratio * cfg.d_model} MLP channels"
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
