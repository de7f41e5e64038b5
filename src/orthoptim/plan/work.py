"""A step's forward and backward work on one GPU beyond the 6·N·D matmul flops: what the
step-time model (`plan.steptime`) prices when a profile measured the rates for it.

Per GPU and step, from a description and a layout (`work_figures`):

* attention's score and value products, 6·s·a·(d_qk + d_v) flops per token and layer
  forward and backward (PaLM's 12·s·h for d_qk = d_v; causal masking not subtracted: the
  CPU path computes the full product);
* the saved activations (`plan.activations`, in the parameter dtype, no recompute): the
  bytes the non-matmul work of forward and backward (norms, activations, softmax, residuals,
  autograd's copies) reads and writes in proportion to, priced at a profile's measured
  `activation_gb_per_s`;
* tensor parallelism's activation all-reduces (`orthoptim.train.model.parallelize`,
  Megatron's layout without sequence parallelism): one after each row-parallel matrix
  forward (the attention output and the MLP's second), one for the input gradient of each
  column-parallel one backward (q, k and v, or the fused qkv, and the MLP's first), each of
  the rank's tokens × hidden in the parameter dtype: one per split linear layer, whose
  fixed cost (DTensor's dispatch, the all-reduce's latency) a profile may measure
  (`tp_us_per_linear`);
* expert parallelism's dispatch and combine (`orthoptim.train.model.MoE._dispatch`): per MoE
  layer an all-to-all each way forward and backward, each of the rank's tokens × top-k rows
  × hidden, the (ep − 1)/ep of them bound elsewhere under balanced routing, and one
  all-gather of the expert counts (int64).

Not counted: recomputation, pipeline sends, the loss's softmax beyond its saved bytes.
"""

from __future__ import annotations

from typing import Any

from orthoptim.comm_bytes import ring_all_reduce_bytes
from orthoptim.plan.activations import edge_bytes, layer_bytes
from orthoptim.plan.layouts import DTYPE_BYTES, Layout
from orthoptim.plan.model import ModelDescription, expand, param_counts


def attention_flops_per_token(desc: ModelDescription, seq_len: int) -> float:
    """Forward + backward flops of every layer's score and value products, per token."""
    a = desc.num_attention_heads
    if desc.attention == "mla":
        qk, v = desc.qk_nope_head_dim + desc.qk_rope_head_dim, desc.v_head_dim
    else:
        qk = v = desc.head_dim or desc.hidden_size // a
    return 6.0 * seq_len * a * (qk + v) * desc.num_hidden_layers


def flops_per_token(desc: ModelDescription, seq_len: int) -> float:
    """Forward + backward flops per token: 6 × the matmul parameters a token uses, plus
    attention's (`attention_flops_per_token`)."""
    matmul = param_counts(expand(desc))["matmul_active"]
    return 6.0 * matmul + attention_flops_per_token(desc, seq_len)


def activation_bytes_per_token(desc: ModelDescription, dtype_bytes: int) -> float:
    """Bytes every layer and the edges (embedding ids, final norm, loss) save per token."""
    layers = sum(layer_bytes(desc, i, 1, 1, dtype_bytes) for i in range(desc.num_hidden_layers))
    return layers + edge_bytes(desc, 1, 1, dtype_bytes)


def work_figures(desc: ModelDescription, layout: Layout, tokens: int) -> dict[str, Any]:
    """Per GPU and step of `tokens` global tokens: attention flops, saved-activation bytes,
    and the activation collectives of tensor and expert parallelism (calls, bytes each rank
    sends per call, of which kind over which group size). Zero where the sequence length is
    not known (neither the layout nor the description gives one)."""
    seq_len = layout.seq_len or desc.seq_len
    p = DTYPE_BYTES[layout.param_dtype]
    gpus = layout.gpus
    per_rank_tokens = tokens / layout.dp  # a data-parallel rank's share, every TP rank holds it
    layers = desc.num_hidden_layers / layout.pp  # a stage's share
    out: dict[str, Any] = {
        "seq_len": seq_len,
        "attention_flops_per_gpu": (
            attention_flops_per_token(desc, seq_len) * tokens / gpus if seq_len else 0.0
        ),
        "activation_bytes_per_gpu": (
            activation_bytes_per_token(desc, p) * tokens / gpus if seq_len else 0.0
        ),
        "collectives": [],
    }
    if layout.tp > 1:
        columns = 2 if desc.fused_qkv else 4
        out["collectives"].append(
            {
                "what": "tensor-parallel activation all-reduces",
                "kind": "all_reduce",
                "group": layout.tp,
                "split_linears": (columns + 2) * layers,
                "forward_calls": 2 * layers,
                "backward_calls": columns * layers,
                "bytes_per_call": ring_all_reduce_bytes(per_rank_tokens * desc.hidden_size * p,
                                                        layout.tp),
            }
        )  # fmt: skip
    if layout.ep > 1 and desc.is_moe:
        moe_layers = sum(desc.is_moe_layer(i) for i in range(desc.num_hidden_layers)) / layout.pp
        rows = per_rank_tokens / layout.tp * desc.num_experts_per_tok
        out["collectives"].append(
            {
                "what": "expert dispatch and combine all-to-alls",
                "kind": "all_to_all",
                "group": layout.ep,
                "forward_calls": 2 * moe_layers,
                "backward_calls": 2 * moe_layers,
                "bytes_per_call": rows * desc.hidden_size * p * (layout.ep - 1) / layout.ep,
            }
        )
        out["collectives"].append(
            {
                "what": "expert count all-gathers",
                "kind": "all_gather",
                "group": layout.ep,
                "forward_calls": moe_layers,
                "backward_calls": 0,
                "bytes_per_call": (layout.ep - 1) * desc.n_routed_experts * 8.0,
            }
        )
    return out
