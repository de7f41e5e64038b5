"""The start-of-run routing summary (`orthoptim.parallel.routing_report`): one record per
trainable parameter (optimizer, base LR, LR scale, orientation, owner rank) checked against
expectations computed here from shapes and from the ranks that really hold the state, and
`orthoptim train` writing it to `routing.json` with a one-line-per-class table on stdout."""

from __future__ import annotations

import json
import math
import re

import pytest
import torch
from torch import nn

import models.fsdp as fsdp_model
from orthoptim import FSDPOptimizer
from orthoptim.cli import main
from orthoptim.optim.hybrid import build_optimizer
from orthoptim.optim.muon import Muon
from orthoptim.parallel import LayerwiseDistributedOptimizer
from orthoptim.parallel.routing_report import (
    TRANSPOSED,
    read_routing,
    routing_report,
    summarize_routing,
)
from orthoptim.train.model import CONFIGS, GPT

from distributed import run_ranks


def keller(rows: int, cols: int) -> float:
    """Jordan's Muon scale, by hand: √max(1, rows/cols)."""
    return math.sqrt(max(1.0, rows / cols))


def test_hybrid_records_match_the_shapes_by_hand():
    """The MoE GPT (fused QKV and gate/up blocks, 3-D experts) under `build_optimizer`:
    every matrix Muon's with keller factors computed from its [out, in] blocks, everything
    else AdamW at its own LR with no scale, every owner "all"; a bare Muon over the matrices
    reports the same scales and leaves the rest as stepped by no optimizer."""
    model = GPT(CONFIGS["tiny-moe"])
    opt = build_optimizer(model, "muon", lr=0.02, adamw_lr=3e-3)
    records = {r.name: r for r in routing_report(opt, model)}
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    assert list(records) == trainable
    split = model.split_spec()
    matrices = {
        "blocks.0.attn.qkv.weight",
        "blocks.0.mlp.experts_down",
        "blocks.1.attn.proj.weight",
    }
    for name, p in model.named_parameters():
        r = records[name]
        assert r.owner == "all" and r.shape == tuple(p.shape)
        if p.ndim < 2 or name in ("embed.weight", "lm_head.weight"):  # tables and vectors
            assert (r.optimizer, r.lr, r.lr_scale, r.orientation) == ("adamw", 3e-3, "none", "-")
            assert r.lr_scale_factors == (1.0,)
            continue
        want = ("muon", 0.02, "keller", "[out, in]")
        assert (r.optimizer, r.lr, r.lr_scale, r.orientation) == want
        cols = p.shape[-1]
        rows = split.get(name, (p.shape[-2],))
        assert r.lr_scale_factors == pytest.approx([keller(b, cols) for b in rows]), name
        matrices.discard(name)
    assert not matrices  # the named ones were checked as matrices
    # the fused gate/up of an expert: two [256, 128] blocks, √2 each
    assert records["blocks.0.mlp.experts_gate_up"].lr_scale_factors == pytest.approx((2**0.5,) * 2)

    named = [(n, p) for n, p in model.named_parameters() if records[n].optimizer == "muon"]
    bare = {r.name: r for r in routing_report(Muon(named, lr=0.05, split=split), model)}
    for name, r in bare.items():
        if records[name].optimizer == "muon":
            assert (r.optimizer, r.lr) == ("muon", 0.05)
            assert r.lr_scale_factors == records[name].lr_scale_factors
        else:
            assert (r.optimizer, r.owner) == ("none", "-")


def test_a_conv1d_weight_is_reported_transposed_with_the_scale_of_its_map():
    """GPT-2's `Conv1D` weights are stored [in, out]: Muon steps them transposed, so c_fc
    [32, 128] is the map [128, 32] with keller √4 = 2 (as stored it would be 1); SOAP does
    not flip them and says so."""
    transformers = pytest.importorskip("transformers")
    cfg = transformers.GPT2Config(n_embd=32, n_layer=1, n_head=2, vocab_size=64, n_positions=16)
    model = transformers.GPT2LMHeadModel(cfg)
    records = {r.name: r for r in routing_report(build_optimizer(model, "muon"), model)}
    fc = records["transformer.h.0.mlp.c_fc.weight"]
    assert fc.shape == (32, 128) and fc.orientation == TRANSPOSED
    assert fc.lr_scale_factors == pytest.approx((keller(128, 32),)) == (2.0,)
    attn = records["transformer.h.0.attn.c_attn.weight"]  # [32, 96]: the map [96, 32]
    assert attn.orientation == TRANSPOSED and attn.lr_scale_factors == pytest.approx((3**0.5,))
    proj = records["transformer.h.0.mlp.c_proj.weight"]  # [128, 32]: the map [32, 128]
    assert proj.orientation == TRANSPOSED and proj.lr_scale_factors == (1.0,)
    soap = {r.name: r for r in routing_report(build_optimizer(model, "soap"), model)}
    assert soap["transformer.h.0.mlp.c_fc.weight"].orientation == "[in, out] stepped as stored"


class Experts(nn.Module):
    """Embedding, two Linears, a 3-D expert stack [4, 8, 8] (declared by its name), a norm and
    a head: matrices for both ranks to own, and experts to split between them."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(32, 8)
        self.up, self.down = nn.Linear(8, 16), nn.Linear(16, 8)
        self.experts = nn.Parameter(torch.randn(4, 8, 8) * 0.3)
        self.norm = nn.LayerNorm(8)
        self.head = nn.Linear(8, 32, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.emb(x)
        h = h + self.down(torch.relu(self.up(h)))
        h = h + torch.einsum("btd,eod->bto", h, self.experts) / 4
        return self.head(self.norm(h))


def _owners_and_state(rank, world_size):
    """This rank's report of the layer-wise driver (experts split one per unit) and of
    FSDP2, and the labels of what this rank holds optimizer state for after one step."""
    torch.manual_seed(0)
    model = Experts()
    opt = LayerwiseDistributedOptimizer(model, "muon", lr=0.02, split_experts=1, bucket_mb=1e-4)
    report = [r.as_dict() for r in routing_report(opt, model)]
    x = torch.randint(0, 32, (2, 6), generator=torch.Generator().manual_seed(rank))
    nn.functional.cross_entropy(model(x).flatten(0, 1), x.flatten()).backward()
    opt.step()
    opt.wait_for_params()
    held = {
        (n, p.numel())
        for g in opt.param_groups
        for p, n in zip(g["params"], g["param_names"])
        if opt.state.get(p)
    }
    fsdp = fsdp_model.sharded_model(world_size, torch.float32)
    fsdp_opt = FSDPOptimizer(fsdp, **fsdp_model.KW)
    return report, held, routing_report(fsdp_opt, fsdp), dict(fsdp_opt.owner_of)


@pytest.fixture(scope="module")
def two_ranks():
    return run_ranks(_owners_and_state, 2, timeout=120)


def _expert_owners(owner: str) -> dict[int, int]:
    """{expert: rank} from "0: experts 0-1, 3; 1: experts 2"."""
    out = {}
    for part in owner.split("; "):
        rank, spans = part.split(": experts ")
        for span in spans.split(", "):
            lo, _, hi = span.partition("-")
            out.update((e, int(rank)) for e in range(int(lo), int(hi or lo) + 1))
    return out


def test_layerwise_owner_ranks_are_the_ranks_holding_the_state(two_ranks):
    """At 2 gloo ranks, every rank reports the same routing; a matrix's owner is the one rank
    holding its momentum, each expert of the split stack is held by the rank its owner entry
    names, and a "sharded" parameter is held as runs that between the ranks cover it once."""
    (report, held0, _, _), (report1, held1, _, _) = two_ranks
    assert report == report1
    held = {0: held0, 1: held1}
    owners_seen = set()
    for r in report:
        name, numel = r["name"], math.prod(r["shape"])
        # the labels of this parameter's state: name, name[experts] or name{run}
        mine = re.compile(re.escape(name) + r"(\[.*\]|\{.*\})?")
        holders = {k: {lbl for lbl, _ in h if mine.fullmatch(lbl)} for k, h in held.items()}
        if r["owner"] == "sharded":
            assert r["optimizer"] == "adamw", name
            # runs name{lo:hi} (a run of the whole parameter goes by its name) that cover
            # the parameter once between them
            runs = [n for k, h in held.items() for lbl, n in h if lbl in holders[k]]
            assert sum(runs) == numel, (name, holders)
        elif r["owner"].isdigit():
            owner = int(r["owner"])
            owners_seen.add(owner)
            assert not holders[1 - owner], (name, holders)
            assert sum(n for lbl, n in held[owner] if lbl in holders[owner]) == numel, name
        else:
            assert name == "experts" and r["optimizer"] == "muon"
            want = _expert_owners(r["owner"])
            assert sorted(want) == [0, 1, 2, 3]
            got = {e: k for k, labels in holders.items() for lbl in labels
                   for e in range(*map(int, re.findall(r"\d+", lbl)))}  # fmt: skip
            assert got == want
            owners_seen |= set(want.values())
    assert owners_seen == {0, 1}
    matrices = [r for r in report if r["optimizer"] == "muon"]
    assert {r["name"] for r in matrices} == {"up.weight", "down.weight", "experts"}
    lines = summarize_routing(read_back(report)).splitlines()
    assert lines[-1].startswith("parameters per owner rank: rank 0: ")


def read_back(dicts):
    from orthoptim.parallel.routing_report import ParamRoute

    return [ParamRoute.from_dict(d) for d in dicts]


def test_fsdp_reports_sharded_elements_and_the_rank_of_each_matrix_step(two_ranks):
    """Under FSDP2 every parameter's elements are sharded over the ranks; a matrix's
    whole-matrix step runs on its owner, which the record names."""
    report, owner_of = two_ranks[0][2], two_ranks[0][3]
    assert {r.name for r in report} == set(owner_of) | {
        r.name for r in report if r.optimizer == "adamw"
    }
    for r in report:
        if r.optimizer == "adamw":
            assert r.owner == "sharded", r
        else:
            assert r.owner == f"sharded (directions on {owner_of[r.name]})", r
    assert {v for v in owner_of.values()} == {0, 1}


def test_train_writes_routing_json_and_prints_the_table(tmp_path, capsys):
    """A two-step `orthoptim train` run: routing.json lists every trainable parameter of the
    model with its routing, stdout has the table (a class line per kind), and --resume
    rewrites the file."""
    out = tmp_path / "run"
    argv = [
        "train", "--config", "tiny", "--nproc", "1", "--steps", "2", "--batch", "2",
        "--eval-every", "2", "--eval-batches", "1", "--ckpt-every", "1", "--warmup", "1",
        "--out", str(out), "--no-progress", "--param-dtype", "fp32",
    ]  # fmt: skip
    assert main([*argv, "--stop-after", "1"]) == 0
    text = capsys.readouterr().out
    model = GPT(CONFIGS["tiny"])
    trainable = {n: tuple(p.shape) for n, p in model.named_parameters() if p.requires_grad}
    records = read_routing(out)
    assert {r.name: r.shape for r in records} == trainable
    data = json.loads((out / "routing.json").read_text())
    assert len(data["parameters"]) == len(trainable)
    assert {r.optimizer for r in records} == {"muon", "adamw"}
    fc = next(r for r in records if r.name == "blocks.0.mlp.fc.weight")  # [512, 128]
    assert fc.lr_scale_factors == (keller(512, 128),) == (2.0,)
    assert f"routing of {len(trainable)} trainable parameters" in text
    assert re.search(r"^muon +\S+ +keller ×2 +\[out, in\] +all +4 ", text, re.M), text
    assert re.search(r"^adamw +\S+ +none +- +all ", text, re.M), text

    (out / "routing.json").write_text("{}")
    assert main([*argv, "--resume"]) == 0
    assert "routing of" in capsys.readouterr().out
    assert [r.name for r in read_routing(out)] == list(trainable)
