"""`orthoptim routing`: print where `build_optimizer` sends each parameter of a model, and why."""

from __future__ import annotations

import argparse
import importlib
import os
import sys
from collections.abc import Callable
from typing import Any

from torch import nn

from orthoptim.optim.routing import explain_routing
from orthoptim.train.hf import PRESETS, hf_config, require_transformers

# Tiny Hugging Face classifiers, built from configs (no download): (config class, model class,
# kw). The causal LMs are `orthoptim train --hf-config`'s presets (`orthoptim.train.hf`).
_SMALL = dict(hidden_size=16, intermediate_size=32, num_attention_heads=2, num_hidden_layers=1)
HF_CLASSIFIERS: dict[str, tuple[str, str, dict[str, Any]]] = {
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
HF_MODELS = (*PRESETS, *HF_CLASSIFIERS)


def hf_model(name: str) -> nn.Module:
    """A small Hugging Face model of family `name` (one of `HF_MODELS`), randomly
    initialised from its config; needs `transformers` (`pip install orthoptim[hf]`)."""
    if name not in HF_MODELS:
        raise ValueError(f"--hf-config must be one of {sorted(HF_MODELS)}, got {name!r}")
    transformers = require_transformers()
    if name in PRESETS:
        return transformers.AutoModelForCausalLM.from_config(hf_config(name, seq_len=128))
    config_cls, model_cls, kw = HF_CLASSIFIERS[name]
    return getattr(transformers, model_cls)(getattr(transformers, config_cls)(**kw))


def model_from_factory(spec: str) -> nn.Module:
    """The model `module:factory` names: `factory()` imported from `module` (found on the
    path or, as `python -m` finds it, in the current folder)."""
    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        raise SystemExit(f"--model must be module:factory (e.g. mypkg.models:build), got {spec!r}")
    if os.getcwd() not in sys.path and "" not in sys.path:
        sys.path.insert(0, os.getcwd())  # modules of the current folder, as `python -m` finds
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
    try:
        model = hf_model(args.hf_config) if args.hf_config else model_from_factory(args.model)
    except ValueError as exc:
        print(f"orthoptim routing: error: {exc}", file=sys.stderr)
        return 2
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
        "--hf-config", choices=sorted(HF_MODELS), help="a small Hugging Face model of this family"
    )
    which.add_argument("--model", metavar="MODULE:FACTORY", help="a model built by factory()")
    p.add_argument(
        "--optimizer",
        default="muon",
        choices=["muon", "soap", "adamw"],
        help="the matrix optimizer build_optimizer routes to (default muon)",
    )
    p.set_defaults(func=run)
