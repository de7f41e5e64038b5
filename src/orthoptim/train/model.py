"""A small decoder-only transformer over bytes: the model `orthoptim train` optimizes.

Pre-norm blocks (RMSNorm → causal self-attention with rotary embeddings → RMSNorm → MLP),
an untied output head named `lm_head`. `build_optimizer`'s default routing sends the
embedding, the head and every norm gain to AdamW.

Two layouts: the default keeps Q, K, V and the two (GELU) MLP matrices separate Linear layers;
`fused=True` stores one `qkv` matrix and a SwiGLU MLP with one `gate_up` matrix, and the model
reports the row blocks of those matrices through `split_spec()` so that Muon orthogonalizes
q, k, v (and gate, up) on their own. `n_kv_head` < `n_head` is grouped-query attention.
`moe` replaces the MLP by top-k routed SwiGLU experts stored as 3-D [E, out, in] parameters;
`expert_parallelize` spreads them over an expert-parallel group (each rank E/ep experts, tokens
dispatched by all-to-all), and `full_expert_state_dict` / `load_expert_state_dict` move the
state between such a model and the full one.

MuonClip protocol (see `orthoptim.optim.qk_clip`): `record_attention_logits(True)` makes every
attention layer keep the largest pre-softmax logit per head seen in training forwards (this
costs one extra q·kᵀ per layer, so it is off by default); `attention_max_logits()` returns and
resets them; `qk_clip_heads()` says where each head's query and key rows live.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.distributed import ProcessGroup

from orthoptim import collectives as C
from orthoptim import host
from orthoptim.comm_bytes import CommStats
from orthoptim.optim.muon import Split, qkv_split
from orthoptim.optim.qk_clip import QKHeads

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor.parallel import ParallelStyle

VOCAB_SIZE = 256  # byte-level tokens


@dataclass(frozen=True)
class MoEConfig:
    """Routed experts: each token goes to its `top_k` of `n_expert` SwiGLU experts of hidden
    size `hidden`, weighted by the renormalised router probabilities.

    `capacity_factor` None (the default): dropless, every expert computes every (token,
    choice) routed to it. A number c: an expert takes at most ceil(c · T · top_k / n_expert)
    of the T tokens of one forward (per rank: each rank drops among its own tokens before
    dispatch), first choices before second choices, earlier tokens first; a dropped (token,
    choice) contributes zero (the residual stream carries the token on) and is counted in
    `MoE.dropped`. `aux_loss_coef`: weight of the Switch load-balancing loss
    n_expert · Σ_e f_e · P_e (f_e: the fraction of routed choices that picked e, P_e: the mean
    router probability of e) added to the training loss; 0 (the default) leaves it out."""

    n_expert: int = 8
    top_k: int = 2
    hidden: int = 256
    capacity_factor: float | None = None
    aux_loss_coef: float = 0.0

    def __post_init__(self) -> None:
        for name in ("n_expert", "top_k", "hidden"):
            if getattr(self, name) < 1:
                raise ValueError(f"MoEConfig.{name} must be >= 1, got {getattr(self, name)}")
        if self.top_k > self.n_expert:
            raise ValueError(
                f"MoEConfig.top_k ({self.top_k}) must be <= n_expert ({self.n_expert})"
            )
        if self.capacity_factor is not None and not self.capacity_factor > 0:
            raise ValueError(
                f"MoEConfig.capacity_factor must be > 0 (or None: dropless), got "
                f"{self.capacity_factor}"
            )
        if not self.aux_loss_coef >= 0:
            raise ValueError(f"MoEConfig.aux_loss_coef must be >= 0, got {self.aux_loss_coef}")


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


def _at_least_fp32(t: Tensor) -> Tensor:
    """`t` in float32, or in its own dtype when that is wider (float64 stays float64)."""
    return t.to(torch.promote_types(t.dtype, torch.float32))


def lm_loss(logits: Tensor, targets: Tensor) -> Tensor:
    """The mean next-token cross-entropy of logits [B, T, V] against targets [B, T], in
    float32 at least (bf16 logits are taken to float32; float64 stays): the loss of
    `GPT.forward(idx, targets)` and of a pipeline's last stage."""
    flat = _at_least_fp32(logits).view(-1, logits.shape[-1])
    return F.cross_entropy(flat, targets.reshape(-1))


class MoE(nn.Module):
    """Top-k routed SwiGLU experts; expert weights are 3-D [E, out, in] parameters, so Muon
    orthogonalizes every expert on its own (and gate and up separately, via `split_spec`).

    After `expert_parallelize` the layer holds experts [ep_rank·E/ep, (ep_rank+1)·E/ep) only
    and its forward dispatches each (token, choice) to the rank holding its expert with an
    all-to-all over the expert-parallel group (and the results back with another); the router
    stays replicated. What the last forward did: `tokens_per_expert` (the (token, choice)
    pairs each local expert computed), `dropped` (pairs over capacity; None: dropless),
    `aux_loss` (the unweighted load-balancing loss of a training forward; None: not computed).
    """

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        assert cfg.moe is not None
        m = cfg.moe
        self.top_k, self.n_expert = m.top_k, m.n_expert
        self.capacity_factor, self.aux_loss_coef = m.capacity_factor, m.aux_loss_coef
        self.router = nn.Linear(cfg.d_model, m.n_expert, bias=False)
        self.experts_gate_up = nn.Parameter(torch.empty(m.n_expert, 2 * m.hidden, cfg.d_model))
        self.experts_down = nn.Parameter(torch.empty(m.n_expert, cfg.d_model, m.hidden))
        self.ep_group: ProcessGroup | None = None
        self.ep_rank, self.ep_size = 0, 1
        self.stats_groups: list[Any] = []  # the balancing loss sums routing counts over these
        self.comm_stats: CommStats | None = None
        self.tokens_per_expert: Tensor | None = None
        self.dropped: Tensor | None = None
        self.aux_loss: Tensor | None = None

    def split_spec(self) -> dict[str, Split]:
        half = self.experts_gate_up.shape[1] // 2
        return {"experts_gate_up": (half, half)}

    @property
    def expert_offset(self) -> int:
        """The global index of this rank's first expert (0 without expert parallelism)."""
        return self.ep_rank * (self.n_expert // self.ep_size)

    def forward(self, x: Tensor) -> Tensor:
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        probs = _at_least_fp32(self.router(x)).softmax(dim=-1)
        weight, chosen = probs.topk(self.top_k, dim=-1)
        weight = (weight / weight.sum(dim=-1, keepdim=True)).to(x.dtype)
        compute = self.training and self.aux_loss_coef > 0
        self.aux_loss = self._balance_loss(probs, chosen) if compute else None
        keep = self._within_capacity(chosen)
        if self.ep_size == 1:
            out = self._local_experts(x, weight, chosen, keep)
        else:
            out = self._dispatch(x, weight, chosen, keep)
        return out.view(shape)

    def _expert(self, e: int, x: Tensor) -> Tensor:
        """Local expert e (an index into this rank's stacks) on the rows of x."""
        gate, up = (x @ self.experts_gate_up[e].T).chunk(2, dim=-1)
        return (F.silu(gate) * up) @ self.experts_down[e].T

    def _local_experts(
        self, x: Tensor, weight: Tensor, chosen: Tensor, keep: Tensor | None
    ) -> Tensor:
        out = torch.zeros_like(x)
        for e in range(self.experts_gate_up.shape[0]):
            hit = chosen == e if keep is None else (chosen == e) & keep
            rows, slot = hit.nonzero(as_tuple=True)
            if rows.numel() == 0:
                continue
            out.index_add_(0, rows, self._expert(e, x[rows]) * weight[rows, slot, None])
        routed = chosen if keep is None else chosen[keep]
        self.tokens_per_expert = torch.bincount(routed.reshape(-1), minlength=self.n_expert)
        return out

    def _dispatch(self, x: Tensor, weight: Tensor, chosen: Tensor, keep: Tensor | None) -> Tensor:
        """Expert parallelism: (token, choice) pairs sorted by expert, the counts exchanged
        (one all-gather of E integers), the rows sent to their experts' ranks and the results
        back (an all-to-all each way, both differentiable), then weighted and summed per
        token here, where the router's weights live."""
        n, me, local = self.ep_size, self.ep_rank, self.n_expert // self.ep_size
        token = torch.arange(x.shape[0], device=x.device).repeat_interleave(self.top_k)
        expert, w = chosen.reshape(-1), weight.reshape(-1)
        if keep is not None:
            kept = keep.reshape(-1)
            token, expert, w = token[kept], expert[kept], w[kept]
        order = torch.argsort(expert, stable=True)
        token, expert, w = token[order], expert[order], w[order]
        counts = torch.bincount(expert, minlength=self.n_expert)
        every = counts.new_empty(n * self.n_expert)
        with C.phase("expert dispatch counts (all-gather)", self.ep_group):
            C.all_gather(every, counts, self.ep_group, self.comm_stats, kind="expert_counts")
        every = host.read(every, "expert dispatch counts").view(n, n, local)
        send = every[me].sum(1).tolist()  # rows to each rank
        mine = every[:, me]  # [source rank, local expert]: rows arriving here
        arrive = mine.sum(1).tolist()
        with C.phase("expert dispatch (all-to-all)", self.ep_group):
            got = C.all_to_all_rows(
                x[token], arrive, send, self.ep_group, self.comm_stats, "expert_dispatch"
            )
        # arrived rows are grouped by source, then by expert: regroup them by expert
        which = torch.arange(local, device=x.device).repeat(n)
        by_expert = torch.argsort(
            which.repeat_interleave(mine.reshape(-1).to(x.device)), stable=True
        )
        sizes = mine.sum(0).tolist()
        parts = got[by_expert].split(sizes)
        y = torch.cat([self._expert(e, part) for e, part in enumerate(parts)])
        y = y[torch.argsort(by_expert)]
        self.tokens_per_expert = mine.sum(0)
        with C.phase("expert combine (all-to-all)", self.ep_group):
            back = C.all_to_all_rows(
                y, send, arrive, self.ep_group, self.comm_stats, "expert_combine"
            )
        return torch.zeros_like(x).index_add_(0, token, back * w[:, None])

    def _within_capacity(self, chosen: Tensor) -> Tensor | None:
        """Which (token, choice) pairs fit their expert's capacity (None: dropless). Queues
        fill first choices of every token, then second choices, in token order."""
        if self.capacity_factor is None:
            self.dropped = None
            return None
        tokens, k = chosen.shape
        capacity = math.ceil(self.capacity_factor * tokens * k / self.n_expert)
        queue = chosen.T.reshape(-1)  # every token's first choice, then every second choice
        order = torch.argsort(queue, stable=True)
        counts = torch.bincount(queue, minlength=self.n_expert)
        first = counts.cumsum(0) - counts  # where each expert's run starts in `order`
        place = torch.empty_like(queue)  # position of each pair in its expert's queue
        place[order] = torch.arange(queue.numel(), device=queue.device) - first[queue[order]]
        keep = (place < capacity).view(k, tokens).T
        self.dropped = (~keep).sum()
        return keep

    def _balance_loss(self, probs: Tensor, chosen: Tensor) -> Tensor:
        """n_expert · Σ_e f_e · P_e. The routing counts behind f (no gradient) are summed over
        `stats_groups` (set by `expert_parallelize`; none: this rank's own), so f is the
        global batch's; P is this rank's mean probability, so the mean of the ranks' losses
        (and of their gradients) is the single-process loss on the global batch."""
        counts = torch.bincount(chosen.reshape(-1), minlength=self.n_expert).to(probs.dtype)
        for group in self.stats_groups:
            with C.phase("router load-balancing counts (all-reduce)", group):
                C.all_reduce(counts, group=group, stats=self.comm_stats, kind="router_counts")
        f = counts / counts.sum()
        return self.n_expert * (f * probs.mean(dim=0)).sum()


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
        self.dispatch_stats: CommStats | None = None  # set by expert_parallelize
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

    def numbered_blocks(self) -> list[tuple[int, Block]]:
        """(index in the full model, block) of every block this module holds."""
        return list(enumerate(self.blocks))

    def attention_max_logits(self) -> dict[str, Tensor | None]:
        """Layer → the largest pre-softmax logit per query head since the last call (None:
        no training forward), then reset."""
        out: dict[str, Tensor | None] = {}
        for i, block in self.numbered_blocks():
            out[f"blocks.{i}.attn"] = block.attn.max_logits
            block.attn.max_logits = None
        return out

    def qk_clip_heads(self) -> dict[str, QKHeads]:
        """Layer → where its heads' query and key rows live."""
        return {
            f"blocks.{i}.attn": block.attn.qk_heads(f"blocks.{i}.attn.")
            for i, block in self.numbered_blocks()
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
        loss = lm_loss(logits, targets)
        aux = self.router_aux_loss()
        return loss if aux is None else loss + aux

    def moe_layers(self) -> dict[str, MoE]:
        """Name → every routed-experts layer (empty for a dense model)."""
        return {n: m for n, m in self.named_modules() if isinstance(m, MoE)}

    def router_aux_loss(self) -> Tensor | None:
        """Σ over MoE layers of aux_loss_coef · the load-balancing loss of the last training
        forward (what `forward(idx, targets)` adds to the loss); None when there is none (a
        dense model, an evaluation forward, aux_loss_coef 0)."""
        layers = self.moe_layers().values()
        terms = [m.aux_loss_coef * m.aux_loss for m in layers if m.aux_loss is not None]
        return torch.stack(terms).sum() if terms else None

    def dropped_tokens(self) -> int:
        """(token, choice) pairs the last forward dropped over expert capacity, all layers
        summed on this rank (0 when dropless)."""
        drops = [m.dropped for m in self.moe_layers().values() if m.dropped is not None]
        return int(host.read(torch.stack(drops).sum(), "dropped tokens")) if drops else 0

    def expert_parallel_slices(self) -> dict[str, tuple[int, int, int]]:
        """Parameter name → (start, stop, n_expert): the global experts [start, stop) the
        local stack holds, for every expert parameter cut by `expert_parallelize` (empty
        otherwise). Checkpoints read it to store the stacks as slices of the full tensors."""
        out: dict[str, tuple[int, int, int]] = {}
        for name, m in self.moe_layers().items():
            if m.ep_size > 1:
                lo = m.expert_offset
                for p in ("experts_gate_up", "experts_down"):
                    out[f"{name}.{p}"] = (lo, lo + m.n_expert // m.ep_size, m.n_expert)
        return out


def expert_parallelize(
    model: GPT,
    ep_group: ProcessGroup | None,
    ep_rank: int,
    ep_size: int,
    stats_group: Any = "ep",
    stats: CommStats | None = None,
) -> GPT:
    """Expert parallelism over `ep_group` (`ep_size` ranks; this one is `ep_rank`), in place:
    every MoE layer keeps only its experts [ep_rank·E/ep, (ep_rank+1)·E/ep) as
    `experts_gate_up` / `experts_down` (same names, shape [E/ep, ...]) and dispatches tokens
    to them with all-to-all (see `MoE`). Call it on every rank of the group before building
    the optimizer (the expert parameters are new tensors). The all-to-all's backward sums the
    expert gradients over the ep group: divide them by the data-parallel size (not by edp),
    after summing over the expert data-parallel group, to get the single-process gradient.

    `stats_group`: the group over which the load-balancing loss sums its routing counts:
    "ep" (the default) `ep_group` (with `ep_size` 1: this rank's own counts); or a process
    group (None: the default group, every rank, as everywhere in orthoptim). Give the
    data-parallel group (`ParallelMesh.dp_group`) when it is larger than the ep group, so
    that the loss is the global batch's; with `ep_size` 1 only this is set (plain data
    parallelism with a global balancing loss). `stats`: the `CommStats` every layer's
    dispatch bytes go to (default a new one), kept as `model.dispatch_stats`. With the mesh
    of `orthoptim.parallel.layout`:
    `expert_parallelize(model, mesh.ep_group, mesh.coord.ep, mesh.dims.ep, mesh.dp_group)`.
    """
    layers = model.moe_layers()
    if not 0 <= ep_rank < ep_size:
        raise ValueError(f"expert_parallelize: ep_rank must be in [0, {ep_size}), got {ep_rank}")
    if not layers:
        raise ValueError(
            f"--ep {ep_size} needs a mixture-of-experts model (this one has no MoE layers): "
            "use --config tiny-moe, or drop --ep"
        )
    n_expert = next(iter(layers.values())).n_expert
    if ep_size < 1 or n_expert % ep_size:
        raise ValueError(
            f"--ep {ep_size} must divide the model's {n_expert} experts per layer: use an --ep "
            f"among {[d for d in range(1, n_expert + 1) if n_expert % d == 0]}"
        )
    if isinstance(stats_group, str) and stats_group != "ep":
        raise ValueError(
            f"expert_parallelize: stats_group must be 'ep' or a process group, got {stats_group!r}"
        )
    group_rank, group_size = C.world(ep_group)
    if ep_size > 1 and (group_size, group_rank) != (ep_size, ep_rank):
        raise ValueError(
            f"expert_parallelize: ep_group has {group_size} ranks and this is its rank "
            f"{group_rank}, but ep_size={ep_size}, ep_rank={ep_rank}; pass the ep group of "
            "the mesh (ParallelMesh.ep_group) and its size and rank"
        )
    stats = stats if stats is not None else CommStats()
    local = n_expert // ep_size
    for name, m in layers.items():
        if m.ep_size != 1:
            raise ValueError(f"expert_parallelize: {name} is expert-parallel already")
        m.ep_group, m.ep_rank, m.ep_size = ep_group, ep_rank, ep_size
        if isinstance(stats_group, str):  # "ep": none when the ep group is this rank alone
            m.stats_groups = [ep_group] if ep_size > 1 else []
        else:
            m.stats_groups = [stats_group]
        m.comm_stats = stats
        if ep_size > 1:
            lo = ep_rank * local
            for p in ("experts_gate_up", "experts_down"):
                full = getattr(m, p)
                setattr(
                    m, p, nn.Parameter(full.detach()[lo : lo + local].clone(), full.requires_grad)
                )
    model.dispatch_stats = stats
    return model


def full_expert_state_dict(model: GPT, stats: CommStats | None = None) -> dict[str, Tensor]:
    """`model.state_dict()` as the full (single-process) model's: every expert stack cut by
    `expert_parallelize` is all-gathered over its ep group into the [E, ...] tensor (a new
    tensor; the other entries share the parameters' storage, as in `state_dict()`).
    Collective over the ep group (a plain state dict without expert parallelism)."""
    sd = model.state_dict()
    layers = model.moe_layers()
    for name, (_, _, n_expert) in model.expert_parallel_slices().items():
        m = layers[name.rpartition(".")[0]]
        local = sd[name].contiguous()
        out = local.new_empty(n_expert, *local.shape[1:])
        with C.phase(f"full expert state of {name} (all-gather)", m.ep_group):
            C.all_gather(out.view(-1), local.view(-1), m.ep_group, stats)
        sd[name] = out
    return sd


def load_expert_state_dict(model: GPT, sd: dict[str, Tensor], strict: bool = True) -> None:
    """Load a full model's state dict (`full_expert_state_dict`, or a single-process model's)
    into `model`: each expert-parallel stack takes its slice [start, stop) of the [E, ...]
    tensor. No communication."""
    cut = dict(sd)
    for name, (lo, hi, n_expert) in model.expert_parallel_slices().items():
        if name in cut:
            if cut[name].shape[0] != n_expert:
                raise ValueError(
                    f"load_expert_state_dict: {name} holds {cut[name].shape[0]} experts; the "
                    f"full model's {n_expert} are needed to cut this rank's [{lo}:{hi}]"
                )
            cut[name] = cut[name][lo:hi]
    model.load_state_dict(cut, strict=strict)


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
