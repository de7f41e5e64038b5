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
from typing import Any

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


def load_model(name_or_path: str | Path) -> ModelDescription:
    """A shipped description by name (`kimi-k2`, ...) or a JSON file of the same schema."""
    path = Path(name_or_path)
    if path.suffix == ".json" or path.exists():
        if not path.is_file():
            raise FileNotFoundError(f"--model: no such description file {str(path)!r}")
        text = path.read_text()
        origin = str(path)
    else:
        names = shipped_models()
        if str(name_or_path) not in names:
            raise ValueError(
                f"--model: unknown model {str(name_or_path)!r}; shipped: {', '.join(names)}, "
                "or pass a path to a .json description"
            )
        text = (resources.files("orthoptim") / "models" / f"{name_or_path}.json").read_text()
        origin = f"shipped model {name_or_path!r}"
    try:
        raw = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"{origin}: not valid JSON ({exc})") from exc
    return model_from_dict(raw, origin)


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
