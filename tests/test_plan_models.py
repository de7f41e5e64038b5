"""How `orthoptim plan` names a model besides a shipped or JSON description:
`--model train:NAME` (`orthoptim train --config NAME`'s GPT, read from `CONFIGS`) and
`--hf-config SPEC` (a Hugging Face config, as `orthoptim train --hf-config` takes it). Each
is checked against the real module's parameter count (built on the meta device: shapes only)
and against the shipped description of the same published model."""

from __future__ import annotations

import json
import sys
from dataclasses import replace

import pytest
import torch

from orthoptim.cli import main
from orthoptim.plan.model import (
    builtin_models,
    expand,
    hf_model,
    load_model,
    param_counts,
    shipped_models,
)
from orthoptim.train.model import CONFIGS, GPT


def _numel(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_train_config_counts_equal_the_real_gpt(name: str) -> None:
    with torch.device("meta"):
        real = GPT(CONFIGS[name])
    desc = load_model(f"train:{name}")
    assert desc.name == f"train:{name}"
    counts = param_counts(expand(desc))
    assert counts["total"] == _numel(real)
    if CONFIGS[name].moe is None:
        assert counts["active"] == counts["total"]


def test_built_in_names_are_listed_and_do_not_clash_with_shipped_files() -> None:
    assert builtin_models() == [f"train:{n}" for n in CONFIGS]
    assert not set(builtin_models()) & set(shipped_models())
    assert "gpt-base" not in shipped_models()  # the hand copy of train:base is gone
    with pytest.raises(ValueError, match=r"unknown config 'huge'.*train:base"):
        load_model("train:huge")
    with pytest.raises(ValueError, match=r"built-in: .*train:tiny"):
        load_model("no-such-model")


# Qwen/Qwen3-30B-A3B's config.json (the source of the shipped qwen3-30b-a3b description).
QWEN3_30B_A3B = {
    "architectures": ["Qwen3MoeForCausalLM"],
    "attention_bias": False,
    "attention_dropout": 0.0,
    "bos_token_id": 151643,
    "decoder_sparse_step": 1,
    "eos_token_id": 151645,
    "head_dim": 128,
    "hidden_act": "silu",
    "hidden_size": 2048,
    "initializer_range": 0.02,
    "intermediate_size": 6144,
    "max_position_embeddings": 40960,
    "max_window_layers": 48,
    "mlp_only_layers": [],
    "model_type": "qwen3_moe",
    "moe_intermediate_size": 768,
    "norm_topk_prob": True,
    "num_attention_heads": 32,
    "num_experts": 128,
    "num_experts_per_tok": 8,
    "num_hidden_layers": 48,
    "num_key_value_heads": 4,
    "output_router_logits": False,
    "rms_norm_eps": 1e-06,
    "rope_scaling": None,
    "rope_theta": 1000000.0,
    "router_aux_loss_coef": 0.001,
    "sliding_window": None,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "transformers_version": "4.51.0",
    "use_cache": True,
    "use_sliding_window": False,
    "vocab_size": 151936,
}

# openai-community/gpt2's config.json (the source of the shipped gpt-small description).
GPT2 = {
    "activation_function": "gelu_new",
    "architectures": ["GPT2LMHeadModel"],
    "attn_pdrop": 0.1,
    "bos_token_id": 50256,
    "embd_pdrop": 0.1,
    "eos_token_id": 50256,
    "initializer_range": 0.02,
    "layer_norm_epsilon": 1e-05,
    "model_type": "gpt2",
    "n_ctx": 1024,
    "n_embd": 768,
    "n_head": 12,
    "n_layer": 12,
    "n_positions": 1024,
    "resid_pdrop": 0.1,
    "summary_activation": None,
    "summary_first_dropout": 0.1,
    "summary_proj_to_labels": True,
    "summary_type": "cls_index",
    "summary_use_proj": True,
    "task_specific_params": {"text-generation": {"do_sample": True, "max_length": 50}},
    "vocab_size": 50257,
}


def _write(tmp_path, raw: dict, folder: str) -> str:
    (tmp_path / folder).mkdir()
    (tmp_path / folder / "config.json").write_text(json.dumps(raw))
    return str(tmp_path / folder)


def _hf_numel(config) -> int:
    transformers = pytest.importorskip("transformers")
    with torch.device("meta"):
        return _numel(transformers.AutoModelForCausalLM.from_config(config))


@pytest.mark.parametrize(
    ("raw", "shipped"),
    [(QWEN3_30B_A3B, "qwen3-30b-a3b"), (GPT2, "gpt-small")],
    ids=["qwen3-30b-a3b", "gpt-small"],
)
def test_hf_config_json_equals_the_shipped_description(tmp_path, raw, shipped) -> None:
    transformers = pytest.importorskip("transformers")
    folder = _write(tmp_path, raw, shipped)
    desc = hf_model(folder)
    assert desc.name == shipped
    counts = param_counts(expand(desc))
    assert counts == param_counts(expand(load_model(shipped)))
    config = transformers.AutoConfig.from_pretrained(folder, local_files_only=True)
    assert counts["total"] == _hf_numel(config)
    by_file = hf_model(f"{folder}/config.json")
    assert replace(by_file, source=desc.source) == desc


@pytest.mark.parametrize("preset", ["gpt2", "llama", "qwen3_moe"])
def test_hf_presets_count_as_train_builds_them(preset: str) -> None:
    """Each of `orthoptim train --hf-config`'s presets, over the 256-byte vocabulary; the
    oracle is train's own config at a 1,024-byte context (GPT-2's position table, which the
    plan keeps at the preset's 1,024 positions)."""
    pytest.importorskip("transformers")
    from orthoptim.train.hf import PRESETS, hf_config

    assert preset in PRESETS
    desc = hf_model(preset)
    assert desc.vocab_size == 256
    assert param_counts(expand(desc))["total"] == _hf_numel(hf_config(preset, 1024))


@pytest.mark.parametrize(
    ("change", "words"),
    [
        ({"shared_expert_intermediate_size": 512}, "key 'shared_expert_intermediate_size'"),
        ({"attention_bias": True}, "attention_bias = True"),
        ({"mlp_only_layers": [0]}, "mlp_only_layers = [0]"),
        ({"decoder_sparse_step": 2}, "decoder_sparse_step = 2"),
        ({"model_type": "deepseek_v3"}, "model_type 'deepseek_v3' is not mapped"),
    ],
    ids=lambda x: str(x)[:30],
)
def test_hf_config_refuses_what_it_cannot_map(tmp_path, change, words) -> None:
    pytest.importorskip("transformers")
    folder = _write(tmp_path, {**QWEN3_30B_A3B, **change}, "m")
    with pytest.raises(ValueError, match="--hf-config") as err:
        hf_model(folder)
    assert words in str(err.value)
    with pytest.raises(ValueError, match="not a preset"):
        hf_model(str(tmp_path / "missing"))


def test_hf_config_without_transformers_names_the_extra(tmp_path, monkeypatch) -> None:
    monkeypatch.setitem(sys.modules, "transformers", None)
    with pytest.raises(ValueError, match=r"pip install 'orthoptim\[hf\]'"):
        hf_model(_write(tmp_path, QWEN3_30B_A3B, "q"))


def test_cli_hf_config_and_train_model(tmp_path, capsys) -> None:
    pytest.importorskip("transformers")
    folder = _write(tmp_path, QWEN3_30B_A3B, "qwen3-30b-a3b")
    # a config.json has no training sequence length: the shipped description's, given
    hf_flags = ["--dp", "8", "--ep", "8", "--seq-len", "4096", "--json"]
    assert main(["plan", "--hf-config", folder, *hf_flags]) == 0
    via_hf = json.loads(capsys.readouterr().out)
    assert main(["plan", "--model", "qwen3-30b-a3b", "--dp", "8", "--ep", "8", "--json"]) == 0
    shipped = json.loads(capsys.readouterr().out)
    assert via_hf["model"]["params_total"] == shipped["model"]["params_total"]
    assert via_hf["memory_per_rank"] == shipped["memory_per_rank"]
    assert main(["plan", "--model", "train:tiny", "--dp", "2", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["model"]["name"] == "train:tiny"
    with pytest.raises(SystemExit):
        main(["plan", "--model", "train:tiny", "--hf-config", "llama", "--dp", "2"])
    assert "not allowed with argument" in capsys.readouterr().err
    assert main(["plan", "--hf-config", str(tmp_path / "none"), "--dp", "2"]) == 2
    assert "not a preset" in capsys.readouterr().err
