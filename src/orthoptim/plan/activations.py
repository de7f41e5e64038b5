"""Activation memory per rank: the bytes a transformer's forward saves for its backward.

The figure is derived from what `orthoptim.train.model.GPT`'s forward saves (counted by
unique storage with `torch.autograd.graph.saved_tensors_hooks`, `tests/test_activations.py`)
and applied to a description's shapes. Per token of one micro-batch, with `p` the bytes of
the activation dtype (the parameter dtype: the model computes in it), 4 for float32 and 8
for int64 (d = head_dim, a = heads, f = the MLP width, H = an expert's width, k = top-k):

    RMSNorm of width n    4n (its float32 input) + 4n (normalized) + 4 (1/rms) + p·n (output)
    attention (GQA)       p·(q, k and v as attention reads them: a·d each, keys and values
                          repeated to every query head; v keeps its projection's output, all
                          of q, k and v when fused, unless repeated) + p·(attention output
                          a·d and its copy the output projection reads: 2·a·d) + 4a (the
                          flash log-sum-exp); no s x s score matrix (SDPA's flash path)
    qk_norm               an RMSNorm of width d per query and key/value head
    attention (MLA)       the same pattern on its shapes: RMSNorms of q_lora_rank and
                          kv_lora_rank, p·qk_rope_head_dim (the rotary key), q and k of
                          a·(nope + rope), the key/value up-projection's output a·(nope + v),
                          the attention output and its copy 2·a·v_head_dim, 4a
    MLP                   SwiGLU 4f·p (gate and up, silu(gate), the product); GELU 2f·p
    routed experts        4E (router probabilities, float32) + 8k (choices) + 4(k + 1) (the
                          renormalised weights); per routed (token, choice) row 16 (its
                          token and choice indices) + p·(3h + 4H + 1) (the row, gate/up,
                          silu, the product, the expert's output, the weighted output, the
                          weight); SwiGLU experts (GELU: 2H); shared experts as an MLP
    one layer             two RMSNorms of h + attention + MLP (or routed experts)
    first stage           + 8 (the token ids the embedding's backward reads)
    last stage            + an RMSNorm of h + 4V (the float32 log-softmax of the loss) + 8
                          (the targets)

Assumptions (say so where a figure is quoted):

* Tensor parallelism with Megatron's sequence parallelism: every saved tensor, the norms'
  and the layer input included, is split over the `tp` ranks (sequence shards outside the
  tensor-parallel regions, head or channel shards inside; the vocabulary-parallel loss
  splits V), so a rank holds 1/tp of each term.
* Routed experts: routing balanced, so a rank's experts compute b·s·k rows per MoE layer
  (its EP group's tokens routed to its E/ep experts), 1/tp of them under tensor parallelism.
* Pipeline parallelism, 1F1B: stage s of pp holds pp − s micro-batches in flight (the first
  stage pp, the last one); no interleaving.
* `recompute`: "none" keeps everything above; "selective" recomputes the core attention
  (Megatron's default `recompute_modules=["core_attn"]`): the checkpoint keeps q, k and v,
  the attention output and its log-sum-exp are not kept; "full" keeps each layer's input
  (p·h per token) and rematerializes one layer at a time in backward, whose activations of
  one micro-batch come on top (`recompute_transient`).
* torch's composite RMSNorm (what the CPU path saves); a fused norm kernel saves less (its
  normalized copy). LayerNorm descriptions are counted as RMSNorm, biases not at all.
* `orthoptim train` with float32 parameters under bf16 autocast keeps extra bf16 casts of
  each projection's input; the estimate is the parameter dtype's.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Literal, get_args

from orthoptim.plan.model import ModelDescription

Recompute = Literal["none", "selective", "full"]
RECOMPUTES: tuple[Recompute, ...] = get_args(Recompute)

_F32 = 4
_I64 = 8


def _norm(width: float, p: int) -> float:
    """Bytes per token an RMSNorm of `width` saves."""
    return 2 * _F32 * width + _F32 + p * width


def _attention(d: ModelDescription, p: int) -> dict[str, float]:
    """Per-token bytes of the attention block: what the core (SDPA) alone keeps (`core`:
    its output and log-sum-exp) and the rest (`inputs`: q, k, v, projections' inputs)."""
    a = d.num_attention_heads
    if d.attention == "mla":
        qk = d.qk_nope_head_dim + d.qk_rope_head_dim
        rest = _norm(d.kv_lora_rank, p) + p * d.qk_rope_head_dim
        if d.q_lora_rank:
            rest += _norm(d.q_lora_rank, p)
        rest += p * (2 * a * qk + a * (d.qk_nope_head_dim + d.v_head_dim) + a * d.v_head_dim)
        return {"inputs": rest, "core": p * a * d.v_head_dim + _F32 * a}
    hd = d.head_dim or d.hidden_size // a
    kv = d.num_key_value_heads or a
    v = a * hd if kv < a else ((a + 2 * kv) * hd if d.fused_qkv else kv * hd)
    rest = p * (2 * a * hd + v + a * hd)
    if d.qk_norm:
        rest += (a + kv) * _norm(hd, p)
    return {"inputs": rest, "core": p * a * hd + _F32 * a}


def _mlp(d: ModelDescription, width: int, p: int) -> float:
    return (4 if d.mlp == "swiglu" else 2) * width * p


def _experts(d: ModelDescription, p: int) -> float:
    """Per-token bytes of a routed-experts layer (its rows: top-k per token)."""
    k, h, e = d.num_experts_per_tok, d.hidden_size, d.n_routed_experts
    inner = (4 if d.mlp == "swiglu" else 2) * d.moe_intermediate_size
    router = _F32 * e + _I64 * k + _F32 * (k + 1)
    rows = k * (2 * _I64 + p * (3 * h + inner + 1))
    shared = _mlp(d, d.moe_intermediate_size * d.n_shared_experts, p)
    return router + rows + shared


def layer_terms(d: ModelDescription, layer: int, dtype_bytes: int) -> dict[str, float]:
    """Bytes per token one layer of `d` saves for backward, by term: "norms" (the two
    RMSNorms), "attention" (without its core), "attention_core" (what the core attention
    alone keeps: its output and log-sum-exp), "mlp" (the MLP or the routed experts, router
    and shared experts included). Activations in `dtype_bytes` (4: float32, 2: bf16)."""
    attn = _attention(d, dtype_bytes)
    moe = d.is_moe_layer(layer)
    return {
        "norms": 2 * _norm(d.hidden_size, dtype_bytes),
        "attention": attn["inputs"],
        "attention_core": attn["core"],
        "mlp": _experts(d, dtype_bytes) if moe else _mlp(d, d.intermediate_size, dtype_bytes),
    }


def layer_bytes(
    d: ModelDescription,
    layer: int,
    micro_batch: int,
    seq_len: int,
    dtype_bytes: int = 4,
    recompute: Recompute = "none",
    tp: int = 1,
) -> float:
    """Bytes layer `layer` keeps for backward on one rank for one micro-batch of
    `micro_batch` sequences of `seq_len` tokens (`layer_terms`; 1/tp of it, see the module's
    assumptions): everything ("none"), all but the core attention ("selective"), or the
    layer's input alone ("full")."""
    if recompute not in RECOMPUTES:
        raise ValueError(f"--recompute must be one of {RECOMPUTES}, got {recompute!r}")
    tokens = micro_batch * seq_len
    if recompute == "full":
        return tokens * dtype_bytes * d.hidden_size / tp
    terms = layer_terms(d, layer, dtype_bytes)
    if recompute == "selective":
        terms.pop("attention_core")
    return tokens * sum(terms.values()) / tp


def edge_bytes(
    d: ModelDescription,
    micro_batch: int,
    seq_len: int,
    dtype_bytes: int = 4,
    first: bool = True,
    last: bool = True,
    tp: int = 1,
) -> float:
    """Bytes outside the layers for one micro-batch on one rank: the token ids on the
    `first` stage, the final RMSNorm, the loss's float32 log-softmax and the targets on the
    `last` (1/tp of them)."""
    per_token = (_I64 if first else 0.0) + (
        _norm(d.hidden_size, dtype_bytes) + _F32 * d.vocab_size + _I64 if last else 0.0
    )
    return micro_batch * seq_len * per_token / tp


def stage_activations(
    d: ModelDescription,
    layers: Sequence[int],
    stage: int,
    pp: int,
    micro_batch: int,
    seq_len: int,
    dtype_bytes: int = 4,
    recompute: Recompute = "none",
    tp: int = 1,
) -> dict[str, float]:
    """The activations of pipeline stage `stage` of `pp` holding `layers`, on one rank:
    per micro-batch (`per_micro_batch`), the micro-batches 1F1B keeps in flight there
    (`in_flight`, pp − stage), what they hold together (`held`), the one layer's
    rematerialized activations during its backward under "full" (`recompute_transient`,
    0 otherwise) and the rank's peak (`bytes`: held + transient)."""
    if not 0 <= stage < pp:
        raise ValueError(f"stage {stage} must be in [0, {pp})")
    args = (micro_batch, seq_len, dtype_bytes)
    per_mb = sum(layer_bytes(d, i, *args, recompute, tp) for i in layers)
    per_mb += edge_bytes(d, *args, first=stage == 0, last=stage == pp - 1, tp=tp)
    in_flight = pp - stage
    transient = (
        max((layer_bytes(d, i, *args, "none", tp) for i in layers), default=0.0)
        if recompute == "full"
        else 0.0
    )
    held = in_flight * per_mb
    return {
        "per_micro_batch": per_mb,
        "in_flight": in_flight,
        "held": held,
        "recompute_transient": transient,
        "bytes": held + transient,
    }


def activation_figures(
    d: ModelDescription,
    stages: Sequence[Sequence[int]],
    micro_batch: int,
    seq_len: int,
    dtype_bytes: int = 4,
    recompute: Recompute = "none",
    tp: int = 1,
) -> dict[str, Any]:
    """`stage_activations` of every stage (`stages[s]`: the layers stage s holds), as the
    plan's JSON: the settings, `per_stage` and the largest figure (`max_bytes`)."""
    pp = len(stages)
    per_stage = [
        stage_activations(d, layers, s, pp, micro_batch, seq_len, dtype_bytes, recompute, tp)
        for s, layers in enumerate(stages)
    ]
    return {
        "micro_batch": micro_batch,
        "seq_len": seq_len,
        "recompute": recompute,
        "dtype_bytes": dtype_bytes,
        "per_stage": per_stage,
        "bytes_per_stage": [s["bytes"] for s in per_stage],
        "max_bytes": max(s["bytes"] for s in per_stage),
    }
