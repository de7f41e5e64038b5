"""`orthoptim routing`: print where `build_optimizer` sends each parameter of a model, and why."""

from __future__ import annotations

import argparse
import importlib
from collections.abc import Callable
from typing import Any

from torch import nn

from orthoptim.optim.routing import explain_routing

# Tiny Hugging Face models, built from configs (no download): (config class, model class, kw).
_SMALL = dict(hidden_size=16, intermediate_size=32, num_attention_heads=2, num_hidden_layers=1)
_DECODER = dict(_SMALL, num_key_value_heads=1, vocab_size=64, bos_token_id=0, eos_token_id=0)
HF_CONFIGS: dict[str, tuple[str, str, dict[str, Any]]] = {
    "gpt2": (
        "GPT2Config",
        "GPT2LMHeadModel",
        dict(
            n_layer=1,
            n_embd=16,
            n_head=2,
            vocab_size=64,
            n_positions=32,
            bos_token_id=0,
            eos_token_id=0,
        ),
    ),
    "llama": ("LlamaConfig", "LlamaForCausalLM", _DECODER),
    "qwen3_moe": (
        "Qwen3MoeConfig",
        "Qwen3MoeForCausalLM",
        dict(_DECODER, moe_intermediate_size=8, num_experts=4, num_experts_per_tok=2, head_dim=8),
    ),
    "bert": (
        "BertConfig",
        "BertForSequenceClassification",
        dict(_SMALL, vocab_size=64, num_labels=3),
    ),
    "vit": (
        "ViTConfig",
        "ViTForImageClassification",
        dict(_SMALL, image_size=16, patch_size=4, num_labels=3),
    ),
}


def hf_model(name: str) -> nn.Module:
    """A tiny Hugging Face model of family `name` (a key of `HF_CONFIGS`), randomly
    initialised from its config; needs `transformers` (`pip install orthoptim[hf]`)."""
    if name not in HF_CONFIGS:
        raise ValueError(f"--hf-config must be one of {sorted(HF_CONFIGS)}, got {name!r}")
    try:
        import transformers
    except ImportError as exc:
        raise SystemExit("--hf-config needs transformers: pip install 'orthoptim[hf]'") from exc
    config_cls, model_cls, kw = HF_CONFIGS[name]
    config = getattr(transformers, config_cls)(**kw)
    return getattr(transformers, model_cls)(config)


def model_from_factory(spec: str) -> nn.Module:
    """The model `module:factory` names: `factory()` imported from `module`."""
    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        raise SystemExit(f"--model must be module:factory (e.g. mypkg.models:build), got {spec!r}")
    try:
        factory: Callable[[], Any] = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as exc:
        raise SystemExit(f"--model {spec}: cannot import {attr} from {module_name}: {exc}") from exc
    model = factory()
    if not isinstance(model, nn.Module):
        raise SystemExit(
            f"--model {spec}: {attr}() returned {type(model).__name__}, not an nn.Module"
        )
    return model


def run(args: argparse.Namespace) -> int:
    """Build the model the arguments name and print its routing table."""
    model = hf_model(args.hf_config) if args.hf_config else model_from_factory(args.model)
    explain_routing(model, optimizer=args.optimizer)
    return 0


def add_parser(subparsers: Any) -> None:
    """Register `orthoptim routing`."""
    p = subparsers.add_parser(
        "routing",
        help="print where build_optimizer sends each parameter of a model, and why",
        description=__doc__,
    )
    which = p.add_mutually_exclusive_group(required=True)
    which.add_argument(
        "--hf-config", choices=sorted(HF_CONFIGS), help="a tiny Hugging Face model of this family"
    )
    which.add_argument("--model", metavar="MODULE:FACTORY", help="a model built by factory()")
    p.add_argument("--optimizer", default="muon", choices=["muon", "soap", "adamw"])
    p.set_defaults(func=run)
