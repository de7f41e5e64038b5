"""Model descriptions (small JSON files from published configurations) and the list of
matrices an optimizer sees in such a model.

A description uses the key names of the Hugging Face `config.json` it was copied from, so a
new model is a copy-and-edit away. `expand()` turns it into `Matrix` records in parameter
order (embeddings, then each block, then the final norm and the head), with every routed
expert of a stacked `[E, out, in]` parameter as its own matrix, which is how Muon, the cost
model and the layer-wise optimizer treat experts.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from orthoptim.train.model import GPTConfig

# key → (type, required); every key a description may hold.
_SCHEMA: dict[str, tuple[type | tuple[type, ...], bool]] = {
    "name": (str, True),
    "source": (str, False),
    "published_total_params": ((int, float), False),
    "published_active_params": ((int, float), False),
    "vocab_size": (int, True),
    "hidden_size": (int, True),
    "num_hidden_layers": (int, True),
    "num_attention_heads": (int, True),
    "num_key_value_heads": (int, False),
    "head_dim": (int, False),
    "attention": (str, False),
    "fused_qkv": (bool, False),
    "qk_norm": (bool, False),
    "q_lora_rank": (int, False),
    "kv_lora_rank": (int, False),
    "qk_nope_head_dim": (int, False),
    "qk_rope_head_dim": (int, False),
    "v_head_dim": (int, False),
    "mlp": (str, False),
    "intermediate_size": (int, True),
    "n_routed_experts": (int, False),
    "num_experts_per_tok": (int, False),
    "moe_intermediate_size": (int, False),
    "n_shared_experts": (int, False),
    "first_k_dense_replace": (int, False),
    "norm": (str, False),
    "bias": (bool, False),
    "max_position_embeddings": (int, False),
    "tie_word_embeddings": (bool, False),
    "default_tokens_per_step": (int, False),
    "seq_len": (int, False),
}

ATTENTIONS = ("gqa", "mla")
MLPS = ("swiglu", "gelu")
NORMS = ("rmsnorm", "layernorm")
MLA_KEYS = ("q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")


@dataclass(frozen=True)
class ModelDescription:
    """A transformer's shape, as read from a description file (see `load_model`)."""

    name: str
    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    intermediate_size: int
    num_key_value_heads: int = 0
    head_dim: int = 0
    attention: str = "gqa"
    fused_qkv: bool = False
    qk_norm: bool = False
    q_lora_rank: int = 0
    kv_lora_rank: int = 0
    qk_nope_head_dim: int = 0
    qk_rope_head_dim: int = 0
    v_head_dim: int = 0
    mlp: str = "swiglu"
    n_routed_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    n_shared_experts: int = 0
    first_k_dense_replace: int = 0
    norm: str = "rmsnorm"
    bias: bool = False
    max_position_embeddings: int = 0
    tie_word_embeddings: bool = False
    default_tokens_per_step: int = 0
    # the sequence length the model was (pre-)trained at: `orthoptim plan --seq-len`'s
    # default for the activations (0: not known, activations not counted without the flag)
    seq_len: int = 0
    source: str = ""
    published_total_params: float = 0.0
    published_active_params: float = 0.0
    extra: dict[str, Any] = field(default_factory=dict, compare=False)

    @property
    def is_moe(self) -> bool:
        return self.n_routed_experts > 0

    def is_moe_layer(self, layer: int) -> bool:
        return self.is_moe and layer >= self.first_k_dense_replace


@dataclass(frozen=True)
class Matrix:
    """One unit the optimizer updates: a whole matrix, one routed expert, or a vector.

    `shape` is the full (unsharded) shape of the unit. `param` names the parameter it belongs
    to and `part` the slice `[start, stop)` of a stacked expert parameter's leading dim.
    `tp_dim` is the dim tensor parallelism splits (0 column-parallel, 1 row-parallel, None
    replicated). `lookup` marks embedding tables used only as lookups (no matmul flops).
    """

    param: str
    shape: tuple[int, ...]
    kind: str
    layer: int | None = None
    tp_dim: int | None = None
    expert: int | None = None
    part: tuple[int, int] | None = None
    active_fraction: float = 1.0
    lookup: bool = False

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def name(self) -> str:
        return self.param if self.expert is None else f"{self.param}[{self.expert}]"


def shipped_models() -> list[str]:
    """Names of the model descriptions shipped with orthoptim."""
    folder = resources.files("orthoptim") / "models"
    return sorted(p.name[: -len(".json")] for p in folder.iterdir() if p.name.endswith(".json"))


# `--model train:NAME` is `orthoptim train --config NAME`'s GPT; the prefix keeps these apart
# from the shipped files (`gpt-small` there is GPT-2 small, not `--config small`).
TRAIN_PREFIX = "train:"
# Global tokens per step assumed for the built-in GPTs: GPT-2's half-million-token batch.
_TRAIN_TOKENS_PER_STEP = 524288


def builtin_models() -> list[str]:
    """`--model` names of `orthoptim train --config`'s GPTs (`train:base`, ...)."""
    from orthoptim.train.model import CONFIGS

    return [TRAIN_PREFIX + name for name in CONFIGS]


def train_model(name: str) -> ModelDescription:
    """The description of `orthoptim train --config NAME`'s GPT, read from
    `orthoptim.train.model.CONFIGS` (the one source of its shape)."""
    from orthoptim.train.model import CONFIGS

    if name not in CONFIGS:
        raise ValueError(
            f"--model {TRAIN_PREFIX}{name}: unknown config {name!r}; built-in: "
            f"{', '.join(builtin_models())}"
        )
    return gpt_description(
        CONFIGS[name],
        TRAIN_PREFIX + name,
        f"orthoptim train --config {name} (orthoptim.train.model.CONFIGS[{name!r}])",
    )


def gpt_description(cfg: GPTConfig, name: str, source: str = "") -> ModelDescription:
    """The description of `orthoptim.train.model.GPT(cfg)`: its shape, and `cfg.seq_len` as
    the sequence length."""
    raw: dict[str, Any] = dict(
        name=name,
        source=source or f"orthoptim.train.model.GPT({cfg})",
        vocab_size=cfg.vocab_size,
        hidden_size=cfg.d_model,
        num_hidden_layers=cfg.n_layer,
        num_attention_heads=cfg.n_head,
        num_key_value_heads=cfg.kv_heads,
        head_dim=cfg.head_dim,
        fused_qkv=cfg.fused,
        mlp="swiglu" if cfg.fused else "gelu",
        intermediate_size=cfg.mlp_ratio * cfg.d_model,
        default_tokens_per_step=_TRAIN_TOKENS_PER_STEP,
        seq_len=cfg.seq_len,
    )
    if cfg.moe is not None:
        raw.update(
            n_routed_experts=cfg.moe.n_expert,
            num_experts_per_tok=cfg.moe.top_k,
            moe_intermediate_size=cfg.moe.hidden,
        )
    return model_from_dict(raw, f"--model {name}")


def load_model(name_or_path: str | Path) -> ModelDescription:
    """A shipped description by name (`kimi-k2`, ...), `orthoptim train --config NAME`'s GPT
    as `train:NAME`, or a JSON file of the same schema."""
    path = Path(name_or_path)
    if str(name_or_path).startswith(TRAIN_PREFIX):
        return train_model(str(name_or_path)[len(TRAIN_PREFIX) :])
    if path.suffix == ".json" or path.exists():
        if not path.is_file():
            raise FileNotFoundError(f"--model: no such description file {str(path)!r}")
        text = path.read_text()
        origin = str(path)
    else:
        names = shipped_models()
        if str(name_or_path) not in names:
            raise ValueError(
                f"--model: unknown model {str(name_or_path)!r}; shipped: {', '.join(names)}; "
                f"built-in: {', '.join(builtin_models())}; or pass a path to a .json description"
            )
        text = (resources.files("orthoptim") / "models" / f"{name_or_path}.json").read_text()
        origin = f"shipped model {name_or_path!r}"
    try:
        raw = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"{origin}: not valid JSON ({exc})") from exc
    return model_from_dict(raw, origin)


# --hf-config: the Hugging Face config keys each family's shape is read from (model_type's
# own config class fills the defaults), and the keys that do not change the parameters.
_HF_LLAMA_KEYS = (
    "vocab_size",
    "hidden_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "intermediate_size",
    "tie_word_embeddings",
)
_HF_MOE_KEYS = ("num_experts", "num_experts_per_tok", "moe_intermediate_size")
_HF_KEYS: dict[str, tuple[str, ...]] = {
    "gpt2": (
        "vocab_size",
        "n_embd",
        "n_layer",
        "n_head",
        "n_inner",
        "n_positions",
        "n_ctx",
        "tie_word_embeddings",
    ),
    "llama": _HF_LLAMA_KEYS,
    "mistral": _HF_LLAMA_KEYS,
    "qwen3": _HF_LLAMA_KEYS,
    "qwen3_moe": _HF_LLAMA_KEYS + _HF_MOE_KEYS,
}
# Keys read only to refuse a value the planner's layouts do not have (see `_hf_refuse`).
_HF_CHECKED = ("attention_bias", "mlp_bias", "decoder_sparse_step", "mlp_only_layers")
# max_position_embeddings is a rotary context in the llama families (no table); GPT-2's
# table is n_positions.
_HF_SHAPELESS = frozenset(
    [
        "model_type",
        "architectures",
        "torch_dtype",
        "dtype",
        "transformers_version",
        "bos_token_id",
        "eos_token_id",
        "pad_token_id",
        "rope_theta",
        "rope_scaling",
        "rope_parameters",
        "rms_norm_eps",
        "layer_norm_epsilon",
        "initializer_range",
        "hidden_act",
        "activation_function",
        "attention_dropout",
        "resid_pdrop",
        "embd_pdrop",
        "attn_pdrop",
        "summary_type",
        "summary_use_proj",
        "summary_activation",
        "summary_proj_to_labels",
        "summary_first_dropout",
        "task_specific_params",
        "use_cache",
        "use_sliding_window",
        "sliding_window",
        "max_window_layers",
        "max_position_embeddings",
        "layer_types",
        "norm_topk_prob",
        "output_router_logits",
        "router_aux_loss_coef",
        "pretraining_tp",
        "scale_attn_weights",
        "scale_attn_by_inverse_layer_idx",
        "reorder_and_upcast_attn",
    ]
)


def hf_model(spec: str) -> ModelDescription:
    """The description of a Hugging Face config: one of `orthoptim train --hf-config`'s
    presets (planned as train builds it, over the 256-byte vocabulary) or a config.json (or
    its folder), planned as written (its own vocabulary). Needs `transformers` for the
    defaults of keys a config leaves out."""
    from orthoptim.train.hf import BYTE_VOCAB, PRESETS, config_path, require_transformers

    transformers = require_transformers()
    if spec in PRESETS:
        raw = {**PRESETS[spec], "vocab_size": BYTE_VOCAB}
        origin = f"--hf-config {spec} (preset of orthoptim.train.hf.PRESETS)"
    else:
        path = config_path(spec)
        try:
            raw = json.loads(path.read_text())
        except json.JSONDecodeError as exc:
            raise ValueError(f"--hf-config {spec}: not valid JSON ({exc})") from exc
        if not isinstance(raw, dict):
            raise ValueError(f"--hf-config {spec}: expected a JSON object")
        origin = f"--hf-config {spec}"
    kind = raw.get("model_type")
    if kind not in _HF_KEYS:
        raise ValueError(
            f"{origin}: model_type {kind!r} is not mapped onto the planner's layouts "
            f"(mapped: {', '.join(_HF_KEYS)}); write a description instead (--model my.json, "
            "docs/planner.md)"
        )
    unknown = sorted(set(raw) - set(_HF_KEYS[kind]) - set(_HF_CHECKED) - _HF_SHAPELESS)
    if unknown:
        raise ValueError(
            f"{origin}: key {unknown[0]!r} of a {kind} config has no counterpart in the "
            f"planner's layouts (unmapped: {unknown}); write a description instead "
            "(--model my.json, docs/planner.md)"
        )
    fields = {k: v for k, v in raw.items() if k != "model_type"}
    try:
        c = transformers.AutoConfig.for_model(kind, **fields)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"{origin}: transformers refuses the config: {exc}") from exc
    _hf_refuse(c, origin)
    name = (
        spec if spec in PRESETS else (path.parent.name if path.name == "config.json" else path.stem)
    )
    if kind == "gpt2":
        desc: dict[str, Any] = dict(
            vocab_size=c.vocab_size,
            hidden_size=c.n_embd,
            num_hidden_layers=c.n_layer,
            num_attention_heads=c.n_head,
            intermediate_size=c.n_inner or 4 * c.n_embd,
            fused_qkv=True,
            mlp="gelu",
            norm="layernorm",
            bias=True,
            max_position_embeddings=c.n_positions,
        )
    else:
        desc = dict(
            vocab_size=c.vocab_size,
            hidden_size=c.hidden_size,
            num_hidden_layers=c.num_hidden_layers,
            num_attention_heads=c.num_attention_heads,
            num_key_value_heads=c.num_key_value_heads or c.num_attention_heads,
            head_dim=getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads,
            intermediate_size=c.intermediate_size,
            qk_norm=kind.startswith("qwen3"),
        )
        if kind == "qwen3_moe":
            desc.update(
                n_routed_experts=c.num_experts,
                num_experts_per_tok=c.num_experts_per_tok,
                moe_intermediate_size=c.moe_intermediate_size,
            )
    desc.update(name=str(name), source=origin, tie_word_embeddings=bool(c.tie_word_embeddings))
    return model_from_dict(desc, origin)


def _hf_refuse(c: Any, origin: str) -> None:
    """Refuse a config whose value of a checked key the planner's layouts cannot express."""
    for key, fine in (("attention_bias", False), ("mlp_bias", False), ("decoder_sparse_step", 1)):
        value = getattr(c, key, fine)
        if value != fine:
            raise ValueError(
                f"{origin}: {key} = {value!r} is not in the planner's layouts (only {fine!r}); "
                "write a description instead (--model my.json)"
            )
    if getattr(c, "mlp_only_layers", None):
        raise ValueError(
            f"{origin}: mlp_only_layers = {c.mlp_only_layers!r} (dense layers among the MoE "
            "ones) is not in the planner's layouts (only []); write a description instead"
        )


def model_from_dict(raw: dict[str, Any], origin: str = "model description") -> ModelDescription:
    """Validate a description dict (keys as in `_SCHEMA`) and build a `ModelDescription`."""
    if not isinstance(raw, dict):
        raise ValueError(f"{origin}: expected a JSON object, got {type(raw).__name__}")
    unknown = sorted(set(raw) - set(_SCHEMA))
    if unknown:
        raise ValueError(
            f"{origin}: unknown key(s) {unknown}; allowed keys: {', '.join(sorted(_SCHEMA))}"
        )
    for key, (typ, required) in _SCHEMA.items():
        if key not in raw:
            if required:
                raise ValueError(f"{origin}: missing required key {key!r}")
            continue
        value = raw[key]
        if not isinstance(value, typ) or (isinstance(value, bool) and typ in (int, (int, float))):
            raise ValueError(f"{origin}: {key!r} must be {typ}, got {value!r}")
        if isinstance(value, int | float) and not isinstance(value, bool) and value < 0:
            raise ValueError(f"{origin}: {key!r} must be >= 0, got {value}")
    desc = ModelDescription(**raw)
    _check(desc, origin)
    return desc


def _check(d: ModelDescription, origin: str) -> None:
    def need(cond: bool, msg: str) -> None:
        if not cond:
            raise ValueError(f"{origin}: {msg}")

    need(d.attention in ATTENTIONS, f"'attention' must be one of {ATTENTIONS}, got {d.attention!r}")
    need(d.mlp in MLPS, f"'mlp' must be one of {MLPS}, got {d.mlp!r}")
    need(d.norm in NORMS, f"'norm' must be one of {NORMS}, got {d.norm!r}")
    for key in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads"):
        need(getattr(d, key) > 0, f"{key!r} must be > 0")
    if d.attention == "mla":
        missing = [k for k in MLA_KEYS if getattr(d, k) <= 0 and k != "q_lora_rank"]
        need(not missing, f"attention 'mla' needs {missing} > 0")
        need(not d.fused_qkv, "'fused_qkv' applies to attention 'gqa' only")
    else:
        kv = d.num_key_value_heads or d.num_attention_heads
        need(
            d.num_attention_heads % kv == 0,
            f"num_attention_heads {d.num_attention_heads} is not a multiple of "
            f"num_key_value_heads {kv}",
        )
        need(
            d.head_dim > 0 or d.hidden_size % d.num_attention_heads == 0,
            "give 'head_dim' (hidden_size is not a multiple of num_attention_heads)",
        )
    if d.is_moe:
        need(
            d.moe_intermediate_size > 0,
            "a MoE model ('n_routed_experts' > 0) needs 'moe_intermediate_size' > 0",
        )
        need(
            0 < d.num_experts_per_tok <= d.n_routed_experts,
            "'num_experts_per_tok' must be in [1, n_routed_experts]",
        )
        need(
            d.first_k_dense_replace <= d.num_hidden_layers,
            "'first_k_dense_replace' exceeds num_hidden_layers",
        )
    else:
        need(d.n_shared_experts == 0, "'n_shared_experts' needs 'n_routed_experts' > 0")


def expand(d: ModelDescription) -> list[Matrix]:
    """Every unit the optimizer sees in `d`, in parameter order.

    Matrices go to Muon except the embedding, the output head and every vector (norm gains,
    biases), which go to AdamW — the routing of `orthoptim.build_optimizer`. The MoE router
    (`mlp.gate`, [E, hidden]) is an ordinary hidden matrix there, so it is a Muon unit.
    """
    h = d.hidden_size
    units: list[Matrix] = []

    def add(
        param: str,
        shape: tuple[int, ...],
        layer: int | None = None,
        tp_dim: int | None = None,
        kind: str | None = None,
        **kw: Any,
    ) -> None:
        k = kind or ("muon" if len(shape) >= 2 else "adamw")
        units.append(Matrix(param, shape, k, layer, tp_dim if len(shape) >= 2 else None, **kw))

    def linear(param: str, out: int, inp: int, layer: int, tp_dim: int | None) -> None:
        add(f"{param}.weight", (out, inp), layer, tp_dim)
        if d.bias:
            add(f"{param}.bias", (out,), layer)

    def norm(param: str, size: int, layer: int | None) -> None:
        add(f"{param}.weight", (size,), layer)
        if d.norm == "layernorm":
            add(f"{param}.bias", (size,), layer)

    add(
        "embed_tokens.weight", (d.vocab_size, h), None, 0, "adamw", lookup=not d.tie_word_embeddings
    )
    if d.max_position_embeddings:
        add("embed_positions.weight", (d.max_position_embeddings, h), kind="adamw", lookup=True)
    for i in range(d.num_hidden_layers):
        p = f"layers.{i}"
        norm(f"{p}.input_layernorm", h, i)
        _attention(d, f"{p}.self_attn", i, linear, norm)
        norm(f"{p}.post_attention_layernorm", h, i)
        if d.is_moe_layer(i):
            _moe(d, f"{p}.mlp", i, add, linear)
        else:
            _mlp(d, f"{p}.mlp", d.intermediate_size, i, linear)
    norm("norm", h, None)
    if not d.tie_word_embeddings:
        add("lm_head.weight", (d.vocab_size, h), None, 0, "adamw")
    return units


def _attention(d: ModelDescription, p: str, i: int, linear: Any, norm: Any) -> None:
    h, heads = d.hidden_size, d.num_attention_heads
    if d.attention == "mla":
        qk = d.qk_nope_head_dim + d.qk_rope_head_dim
        if d.q_lora_rank:
            linear(f"{p}.q_a_proj", d.q_lora_rank, h, i, None)
            norm(f"{p}.q_a_layernorm", d.q_lora_rank, i)
            linear(f"{p}.q_b_proj", heads * qk, d.q_lora_rank, i, 0)
        else:
            linear(f"{p}.q_proj", heads * qk, h, i, 0)
        linear(f"{p}.kv_a_proj_with_mqa", d.kv_lora_rank + d.qk_rope_head_dim, h, i, None)
        norm(f"{p}.kv_a_layernorm", d.kv_lora_rank, i)
        linear(f"{p}.kv_b_proj", heads * (d.qk_nope_head_dim + d.v_head_dim), d.kv_lora_rank, i, 0)
        linear(f"{p}.o_proj", h, heads * d.v_head_dim, i, 1)
        return
    hd = d.head_dim or h // heads
    kv = d.num_key_value_heads or heads
    if d.fused_qkv:
        linear(f"{p}.qkv_proj", (heads + 2 * kv) * hd, h, i, 0)
    else:
        linear(f"{p}.q_proj", heads * hd, h, i, 0)
        linear(f"{p}.k_proj", kv * hd, h, i, 0)
        linear(f"{p}.v_proj", kv * hd, h, i, 0)
    if d.qk_norm:
        norm(f"{p}.q_norm", hd, i)
        norm(f"{p}.k_norm", hd, i)
    linear(f"{p}.o_proj", h, heads * hd, i, 1)


def _mlp(d: ModelDescription, p: str, inter: int, i: int, linear: Any) -> None:
    h = d.hidden_size
    if d.mlp == "swiglu":
        linear(f"{p}.gate_proj", inter, h, i, 0)
        linear(f"{p}.up_proj", inter, h, i, 0)
    else:
        linear(f"{p}.fc_in", inter, h, i, 0)
    linear(f"{p}.down_proj" if d.mlp == "swiglu" else f"{p}.fc_out", h, inter, i, 1)


def _moe(d: ModelDescription, p: str, i: int, add: Any, linear: Any) -> None:
    h, e, inter = d.hidden_size, d.n_routed_experts, d.moe_intermediate_size
    add(f"{p}.gate.weight", (e, h), i, None)
    active = d.num_experts_per_tok / e
    projections = (
        [("gate_proj", (inter, h)), ("up_proj", (inter, h)), ("down_proj", (h, inter))]
        if d.mlp == "swiglu"
        else [("fc_in", (inter, h)), ("fc_out", (h, inter))]
    )
    for proj, shape in projections:
        for x in range(e):
            add(
                f"{p}.experts.{proj}",
                shape,
                i,
                None,
                expert=x,
                part=(x, x + 1),
                active_fraction=active,
            )
    if d.n_shared_experts:
        _mlp(d, f"{p}.shared_experts", inter * d.n_shared_experts, i, linear)


def param_counts(units: list[Matrix]) -> dict[str, float]:
    """Total parameters, active parameters per token (routed experts weighted by top-k / E),
    and the parameters that do matmul work per token (active minus lookup-only embeddings)."""
    total = sum(u.numel for u in units)
    active = sum(u.numel * u.active_fraction for u in units)
    matmul = sum(u.numel * u.active_fraction for u in units if not u.lookup)
    return {"total": total, "active": active, "matmul_active": matmul}
