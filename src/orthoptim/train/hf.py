"""Hugging Face `transformers` causal language models for `orthoptim train --hf-config`.

`build_hf_model(spec, seq_len)` makes a model from a config with no download: a preset name
(`gpt2`, `llama`, `qwen3_moe`: small sizes) or the path of a `config.json` (or of a folder
holding one). The vocabulary is always the corpus's 256 bytes; the model's position table
must cover `seq_len`. `HFCausalLM` wraps it with the built-in GPT's interface: `model(x, y)`
is the mean next-byte cross-entropy and `model.blocks` lists the decoder layers (what FSDP2
shards one by one and `compile_blocks` compiles).

`transformers` is the optional extra `pip install 'orthoptim[hf]'`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch.nn.functional as F
from torch import Tensor, nn

BYTE_VOCAB = 256

# Small models of each family: two decoder layers of width 64, dropout off (so that every
# layout of a run computes the same function).
PRESETS: dict[str, dict[str, Any]] = {
    "gpt2": dict(
        model_type="gpt2", n_embd=64, n_layer=2, n_head=4, resid_pdrop=0.0, embd_pdrop=0.0,
        attn_pdrop=0.0, tie_word_embeddings=True,
    ),
    "llama": dict(
        model_type="llama", hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False,
    ),
    "qwen3_moe": dict(
        model_type="qwen3_moe", hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        num_experts=4, num_experts_per_tok=2, tie_word_embeddings=False,
    ),
}  # fmt: skip
# Where each family's config keeps its context length.
_POSITION_KEYS = ("n_positions", "max_position_embeddings")


def require_transformers() -> Any:
    """The `transformers` module, or a ValueError saying how to install it."""
    try:
        import transformers
    except ImportError as exc:
        raise ValueError(
            "--hf-config needs Hugging Face transformers: pip install 'orthoptim[hf]'"
        ) from exc
    return transformers


def config_path(spec: str) -> Path:
    """The config.json that `--hf-config spec` names (the file, or the folder holding it)."""
    path = Path(spec)
    if path.is_dir():
        path = path / "config.json"
    if not path.is_file():
        raise ValueError(
            f"--hf-config {spec}: not a preset ({', '.join(PRESETS)}) and no config.json there"
        )
    return path


def hf_config(spec: str, seq_len: int) -> Any:
    """The `transformers` config of `spec` (a preset name, or a config.json or its folder),
    with the byte vocabulary and a context of at least `seq_len`."""
    transformers = require_transformers()
    if spec in PRESETS:
        preset = dict(PRESETS[spec])
        kind = preset.pop("model_type")
        config = transformers.AutoConfig.for_model(kind, **preset)
        for key in _POSITION_KEYS:
            if hasattr(config, key):
                setattr(config, key, max(seq_len, 128))
    else:
        path = config_path(spec)
        try:
            config = transformers.AutoConfig.from_pretrained(str(path), local_files_only=True)
        except (OSError, ValueError, KeyError) as exc:
            raise ValueError(f"--hf-config {spec}: not a config transformers reads: {exc}") from exc
    config.vocab_size = BYTE_VOCAB
    for key in _POSITION_KEYS:
        context = getattr(config, key, None)
        if isinstance(context, int) and context < seq_len:
            raise ValueError(
                f"--hf-config {spec}: {key} = {context} is shorter than the training sequence "
                f"({seq_len} bytes)"
            )
    return config


def _decoder_layers(model: nn.Module) -> nn.ModuleList:
    """The decoder layers of a causal LM: the longest ModuleList of its base model."""
    lists = [m for m in model.modules() if isinstance(m, nn.ModuleList)]
    if not lists:
        raise ValueError(f"{type(model).__name__} has no list of decoder layers")
    return max(lists, key=len)


class HFCausalLM(nn.Module):
    """A `transformers` causal LM with the built-in GPT's interface (see the module doc)."""

    def __init__(self, config: Any) -> None:
        super().__init__()
        transformers = require_transformers()
        self.model = transformers.AutoModelForCausalLM.from_config(config)
        # not a registered child: the layers' parameters keep their one name under `model`
        object.__setattr__(self, "_blocks", _decoder_layers(self.model))

    @property
    def blocks(self) -> nn.ModuleList:
        return self._blocks

    def forward(self, x: Tensor, y: Tensor) -> Tensor:
        logits = self.model(input_ids=x, use_cache=False).logits
        return F.cross_entropy(logits.float().flatten(0, 1), y.flatten())

    def get_input_embeddings(self) -> nn.Module:
        return self.model.get_input_embeddings()

    def get_output_embeddings(self) -> nn.Module | None:
        return self.model.get_output_embeddings()


def build_hf_model(spec: str, seq_len: int) -> HFCausalLM:
    """`HFCausalLM` of `spec` (see `hf_config`), initialised from torch's global generator."""
    return HFCausalLM(hf_config(spec, seq_len))
