"""Default routing over common model layouts: embeddings, heads, positional tables and vectors
to AdamW, hidden matrices to Muon, experts recognised as experts. Each case states by hand
which matrices go to AdamW and which parameters are expert stacks (the oracle); everything
else with >= 2 dims must go to Muon and everything with < 2 dims to AdamW."""

from __future__ import annotations

import importlib.util
import math

import pytest
import torch
from torch import nn

from orthoptim import build_optimizer, explain_routing, routing_table
from orthoptim.cli import main
from orthoptim.optim.muon import LR_SCALE_ALIASES, LR_SCALES, Muon, lr_scale_factor
from orthoptim.optim.routing import ModelRoute
from orthoptim.parallel.assignment import units_from_model

HAS_TRANSFORMERS = importlib.util.find_spec("transformers") is not None
needs_hf = pytest.mark.skipif(
    not HAS_TRANSFORMERS,
    reason="transformers is not installed (pip install 'orthoptim[hf]'); .ci/run installs it",
)

D, T, V = 16, 8, 64  # width, context, vocabulary (V = 4·D: nanoGPT's c_fc has V outputs)


class NanoBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(D)
        self.attn = nn.ModuleDict(dict(c_attn=nn.Linear(D, 3 * D), c_proj=nn.Linear(D, D)))
        self.ln_2 = nn.LayerNorm(D)
        self.mlp = nn.ModuleDict(dict(c_fc=nn.Linear(D, 4 * D), c_proj=nn.Linear(4 * D, D)))


class NanoGPT(nn.Module):
    """nanoGPT's layout; `head` renames lm_head (a name outside HEAD_NAMES)."""

    def __init__(self, tied: bool, head: str = "lm_head") -> None:
        super().__init__()
        self.transformer = nn.ModuleDict(
            dict(
                wte=nn.Embedding(V, D),
                wpe=nn.Embedding(T, D),
                h=nn.ModuleList(NanoBlock() for _ in range(2)),
                ln_f=nn.LayerNorm(D),
            )
        )
        setattr(self, head, nn.Linear(D, V, bias=False))
        if tied:
            self.transformer.wte.weight = getattr(self, head).weight


class MinGPT(nn.Module):
    """minGPT's layout: a raw (1, T, d) positional table, blocks in an nn.Sequential."""

    def __init__(self) -> None:
        super().__init__()
        self.tok_emb = nn.Embedding(V, D)
        self.pos_emb = nn.Parameter(torch.zeros(1, T, D))
        self.blocks = nn.Sequential(NanoBlock(), NanoBlock())
        self.ln_f = nn.LayerNorm(D)
        self.head = nn.Linear(D, V, bias=False)


class Embed(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.W_E = nn.Parameter(torch.randn(V, D))


class PosEmbed(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.W_pos = nn.Parameter(torch.randn(T, D))


class LensAttention(nn.Module):
    def __init__(self, heads: int = 2, d_head: int = 4) -> None:
        super().__init__()
        for w in ("W_Q", "W_K", "W_V"):
            setattr(self, w, nn.Parameter(torch.randn(heads, D, d_head)))
            setattr(self, "b" + w[1:], nn.Parameter(torch.zeros(heads, d_head)))
        self.W_O = nn.Parameter(torch.randn(heads, d_head, D))
        self.b_O = nn.Parameter(torch.zeros(D))


class LensBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(D)
        self.attn = LensAttention()
        self.W_in = nn.Parameter(torch.randn(D, 4 * D))
        self.b_in = nn.Parameter(torch.zeros(4 * D))
        self.W_out = nn.Parameter(torch.randn(4 * D, D))


class Unembed(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.W_U = nn.Parameter(torch.randn(D, V))
        self.b_U = nn.Parameter(torch.zeros(V))


class LensModel(nn.Module):
    """TransformerLens' layout: every weight a raw nn.Parameter, attention weights 3-D
    [heads, d_model, d_head] (per-head matrices, not experts)."""

    def __init__(self) -> None:
        super().__init__()
        self.embed, self.pos_embed = Embed(), PosEmbed()
        self.blocks = nn.ModuleList(LensBlock() for _ in range(2))
        self.unembed = Unembed()


class BasicBlock(nn.Module):
    def __init__(self, c: int) -> None:
        super().__init__()
        self.conv1, self.bn1 = nn.Conv2d(c, c, 3, padding=1, bias=False), nn.BatchNorm2d(c)
        self.conv2, self.bn2 = nn.Conv2d(c, c, 3, padding=1, bias=False), nn.BatchNorm2d(c)


class ResNet(nn.Module):
    """A ResNet's layout: stem conv, blocks in nn.Sequential, a classifier `fc`."""

    def __init__(self, c: int = 8, classes: int = 10) -> None:
        super().__init__()
        self.conv1, self.bn1 = nn.Conv2d(3, c, 7, stride=2, bias=False), nn.BatchNorm2d(c)
        self.layer1 = nn.Sequential(BasicBlock(c), BasicBlock(c))
        self.avgpool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(c, classes)


def _expect(model, adamw_matrices: set[str], experts: set[str] = frozenset()):
    """Check the default routing of `model` against the hand-written oracle, and that
    build_optimizer, explain_routing and units_from_model agree with it."""
    named = dict(model.named_parameters())
    assert adamw_matrices <= set(named) and set(experts) <= set(named)
    want = {n: "adamw" if p.ndim < 2 or n in adamw_matrices else "muon" for n, p in named.items()}
    rows = explain_routing(model, quiet=True)
    got = {r.name: r.optimizer for r in rows}
    wrong = {n: (got[n], w) for n, w in want.items() if got[n] != w}
    assert not wrong, f"(got, want) per misrouted parameter: {wrong}"
    assert routing_table(build_optimizer(model)) == want
    assert {u.name: u.kind for u in units_from_model(model)} == want
    rule = ModelRoute(model)
    assert {n for n, p in named.items() if rule.is_expert(n, p)} == set(experts)
    split = units_from_model(model, split_experts=1)
    assert {u.name for u in split if u.part is not None} == set(experts)
    return {r.name: r.reason for r in rows}


@pytest.mark.parametrize("tied", [True, False])
def test_nanogpt(tied):
    model = NanoGPT(tied)
    heads = set() if tied else {"lm_head.weight"}
    _expect(model, {"transformer.wte.weight", "transformer.wpe.weight", *heads})


def test_head_outside_name_list_and_vocab_sized_hidden_layers():
    """c_fc (D → 4D = V) and c_attn (D → 3D) stay matrices; the unnamed head is found as the
    last Linear, not by its output size."""
    model = NanoGPT(tied=False, head="to_logits")
    reasons = _expect(
        model, {"transformer.wte.weight", "transformer.wpe.weight", "to_logits.weight"}
    )
    assert "last matrix" in reasons["to_logits.weight"]
    v3 = NanoGPT(tied=False, head="to_logits")
    v3.transformer.wte = nn.Embedding(3 * D, D)  # vocabulary = c_attn's 3D outputs
    v3.to_logits = nn.Linear(D, 3 * D, bias=False)
    _expect(v3, {"transformer.wte.weight", "transformer.wpe.weight", "to_logits.weight"})


def test_mingpt_raw_positional_table():
    reasons = _expect(MinGPT(), {"tok_emb.weight", "pos_emb", "head.weight"})
    assert "positional" in reasons["pos_emb"]


def test_transformerlens_style_raw_parameters():
    model = LensModel()
    adamw = {"embed.W_E", "pos_embed.W_pos", "unembed.W_U"}
    adamw |= {f"blocks.{i}.attn.b_{x}" for i in range(2) for x in "QKV"}
    reasons = _expect(model, adamw)
    assert "not an expert" in reasons["blocks.0.attn.W_Q"]


def test_resnet_classifier_head_and_input_conv():
    reasons = _expect(ResNet(), {"fc.weight"})
    assert "conv" in reasons["conv1.weight"]  # the input convolution goes to Muon (a choice)


class DeclaredExperts(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(V, D)
        self.w_up = nn.Parameter(torch.randn(4, 2 * D, D))  # declared below
        self.per_head = nn.Parameter(torch.randn(2, D, D))  # 3-D, not declared
        self.moe = nn.ModuleDict(dict(experts=nn.ParameterList([torch.randn(4, D, D)])))
        self.lm_head = nn.Linear(D, V)

    def expert_params(self) -> list[str]:
        return ["w_up"]


def test_experts_only_when_the_model_says_so():
    _expect(DeclaredExperts(), {"embed.weight", "lm_head.weight"}, {"w_up", "moe.experts.0"})


def test_builtin_moe_gpt_experts():
    from orthoptim.train.model import GPT, GPTConfig, MoEConfig

    cfg = GPTConfig(n_layer=1, n_head=2, d_model=16, seq_len=8, moe=MoEConfig(n_expert=4))
    model = GPT(cfg)
    experts = {n for n in dict(model.named_parameters()) if ".experts_" in n}
    assert len(experts) == 2
    _expect(model, {"embed.weight", "lm_head.weight"}, experts)


def _hf(name):
    from orthoptim.train.routing_cli import hf_model

    torch.manual_seed(0)
    return hf_model(name)


def _blocks(model, *suffixes):
    return {n for n in dict(model.named_parameters()) if n.endswith(suffixes)}


@needs_hf
def test_hf_gpt2_tied():
    model = _hf("gpt2")
    reasons = _expect(model, {"transformer.wte.weight", "transformer.wpe.weight"})
    assert "tied" in reasons["transformer.wte.weight"]


@needs_hf
def test_hf_llama():
    _expect(_hf("llama"), {"model.embed_tokens.weight", "lm_head.weight"})


@needs_hf
def test_hf_qwen3_moe_experts():
    model = _hf("qwen3_moe")
    experts = {n for n, p in model.named_parameters() if ".experts." in n and p.ndim == 3}
    # transformers >= 5 stores each layer's experts as 3-D stacks; 4.x as one Linear each
    # (2-D matrices under `experts`: Muon, nothing to split).
    _expect(model, {"model.embed_tokens.weight", "lm_head.weight"}, experts)


@needs_hf
def test_hf_bert_sequence_classification():
    model = _hf("bert")
    tables = _blocks(model, "_embeddings.weight")
    assert len(tables) == 3  # word, position, token type
    _expect(model, tables | {"classifier.weight"})


@needs_hf
def test_hf_vit_tokens_and_positional_table():
    model = _hf("vit")
    tables = {"vit.embeddings.cls_token", "vit.embeddings.position_embeddings"}
    reasons = _expect(model, tables | {"classifier.weight"})
    assert "input convolution" in reasons["vit.embeddings.patch_embeddings.projection.weight"]


@needs_hf
def test_hf_sequence_classification_score_head():
    import transformers

    cfg = transformers.LlamaConfig(
        hidden_size=16, intermediate_size=32, num_attention_heads=2, num_key_value_heads=1,
        num_hidden_layers=1, vocab_size=V, num_labels=3, pad_token_id=0,
    )  # fmt: skip
    model = transformers.LlamaForSequenceClassification(cfg)
    _expect(model, {"model.embed_tokens.weight", "score.weight"})


def test_route_override_and_explain_output(capsys):
    model = MinGPT()
    rows = explain_routing(model, route=lambda n, p: n == "head.weight", lr=0.02)
    assert [r.name for r in rows if r.optimizer == "muon"] == ["head.weight"]
    assert all(r.reason == "route= override" for r in rows)
    out = capsys.readouterr().out
    assert "pos_emb" in out and "1×8×16" in out and "route= override" in out
    with pytest.raises(ValueError, match="optimizer must be one of"):
        explain_routing(model, optimizer="lion", quiet=True)


def test_cli_routing_model_factory(capsys):
    assert main(["routing", "--model", "test_routing:MinGPT"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].split()[:4] == ["parameter", "shape", "optimizer", "reason"]
    pos = next(line for line in out if line.startswith("pos_emb"))
    assert pos.split()[2] == "adamw"
    with pytest.raises(SystemExit, match="--model"):
        main(["routing", "--model", "test_routing:Nope"])


@needs_hf
def test_cli_routing_hf_config(capsys):
    assert main(["routing", "--hf-config", "qwen3_moe"]) == 0
    out = capsys.readouterr().out
    assert "expert stack" in out and "lm_head.weight" in out


# ------------------------------------------------------------------------------ LR scales


@pytest.mark.parametrize(
    ("name", "rows", "cols", "expected"),
    [
        # (name as typed, rows, cols, the formula of the library that spells it so)
        ("keller", 256, 64, math.sqrt(max(1, 256 / 64))),
        ("shape_scaling", 256, 64, math.sqrt(max(1, 256 / 64))),  # Emerging-Optimizers
        ("original", 64, 256, math.sqrt(max(1, 64 / 256))),  # torch.optim.Muon
        ("unit_rms_norm", 64, 256, math.sqrt(64 / 256)),  # Emerging-Optimizers
        ("spectral", 64, 256, math.sqrt(max(64, 256))),  # Emerging-Optimizers
        ("match_adamw_rms", 64, 256, 0.2 * math.sqrt(max(64, 256))),  # Moonlight
        ("match_rms_adamw", 64, 256, 0.2 * math.sqrt(max(64, 256))),  # torch.optim.Muon
        ("none", 64, 256, 1.0),
    ],
)
def test_lr_scale_names_match_their_libraries(name, rows, cols, expected):
    assert lr_scale_factor(name, rows, cols) == pytest.approx(expected)


def test_lr_scale_alias_stored_under_published_name():
    assert set(LR_SCALE_ALIASES.values()) <= set(LR_SCALES)
    opt = Muon([nn.Parameter(torch.randn(4, 4))], lr_scale="shape_scaling")
    assert opt.param_groups[0]["lr_scale"] == "keller"
    with pytest.raises(ValueError, match=r"lr_scale must be one of .*unit_rms_norm"):
        Muon([nn.Parameter(torch.randn(4, 4))], lr_scale="rms")
