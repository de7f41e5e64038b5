"""Mixture of experts, fused projections and MuonClip: batched experts against a loop over
experts, split (fused) matrices against separate matrices, expert slices owned by different
ranks against the single-process optimizer, QK-clip on a synthetic attention case and under
the layer-wise optimizer, and `orthoptim train --config tiny-moe` over 2 ranks."""

from __future__ import annotations

import json

import pytest
import torch
from torch import nn

from models.ep import Experts, rank_experts
from orthoptim import LayerwiseDistributedOptimizer, Muon, QKClip, build_optimizer
from orthoptim import checkpoint as ckpt
from orthoptim.cli import main
from orthoptim.optim.muon import qkv_split
from orthoptim.optim.qk_clip import clip_factors
from orthoptim.train.model import CONFIGS, GPT, GPTConfig

from distributed import run_ranks


def _grads(shape, steps, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(shape, generator=g) for _ in range(steps)]


def _run(params, grads_per_step, **kw):
    """Step Muon over `params` (name → Parameter) with the given gradients."""
    opt = Muon(list(params.items()), lr=0.1, momentum=0.9, **kw)
    for grads in grads_per_step:
        for name, p in params.items():
            p.grad = grads[name].clone()
        opt.step()
    return {n: p.detach() for n, p in params.items()}


def _blocks(t, sizes):
    return list(t.split(list(sizes), dim=-2))


# ---------------------------------------------------------------- Muon: experts and split


def test_batched_experts_equal_a_loop_over_experts():
    W = torch.randn(5, 12, 8)
    grads = _grads(W.shape, 3)
    out = _run({"w": nn.Parameter(W.clone())}, [{"w": g} for g in grads], lr_scale="sqrt_max_dim")
    loop = _run(
        {f"w{e}": nn.Parameter(W[e].clone()) for e in range(5)},
        [{f"w{e}": g[e] for e in range(5)} for g in grads],
        lr_scale="sqrt_max_dim",
    )
    for e in range(5):
        torch.testing.assert_close(out["w"][e], loop[f"w{e}"], atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("per_head", [False, True])
def test_split_qkv_equals_separate_matrices(per_head):
    # Grouped-query sizes: 4 query heads, 2 key/value heads of 6 rows; d_model 24.
    sizes = qkv_split(4, 6, n_kv_head=2, per_head=per_head)
    assert sum(sizes) == 4 * 6 + 2 * 2 * 6 and len(sizes) == (8 if per_head else 3)
    W = torch.randn(sum(sizes), 24)
    grads = _grads(W.shape, 3, seed=1)
    fused = _run(
        {"qkv": nn.Parameter(W.clone())},
        [{"qkv": g} for g in grads],
        split={"qkv": sizes},
        lr_scale="sqrt_max_dim",  # depends on each block's shape: checks the per-block scale
        weight_decay=0.1,
    )
    parts = {f"b{i}": nn.Parameter(b.clone()) for i, b in enumerate(_blocks(W, sizes))}
    separate = _run(
        parts,
        [{f"b{i}": b for i, b in enumerate(_blocks(g, sizes))} for g in grads],
        lr_scale="sqrt_max_dim",
        weight_decay=0.1,
    )
    for i, block in enumerate(_blocks(fused["qkv"], sizes)):
        torch.testing.assert_close(block, separate[f"b{i}"], atol=1e-6, rtol=1e-6)
    whole = _run({"qkv": nn.Parameter(W.clone())}, [{"qkv": g} for g in grads])
    assert not torch.allclose(whole["qkv"], fused["qkv"], atol=1e-3)  # the split matters


def test_split_of_3d_experts_is_per_expert_per_block():
    W = torch.randn(3, 10, 4)  # fused gate/up experts: 5 + 5 rows each
    grads = _grads(W.shape, 2, seed=2)
    fused = _run({"gu": nn.Parameter(W.clone())}, [{"gu": g} for g in grads], split={"gu": (5, 5)})
    for e in range(3):
        for half in (slice(0, 5), slice(5, 10)):
            ref = _run({"x": nn.Parameter(W[e, half].clone())}, [{"x": g[e, half]} for g in grads])
            torch.testing.assert_close(fused["gu"][e, half], ref["x"], atol=1e-6, rtol=1e-6)


def test_split_errors_name_the_parameter():
    w = nn.Parameter(torch.randn(8, 4))
    with pytest.raises(ValueError, match=r"split\['w'\] = \(3, 3\) sums to 6 rows.*8 rows"):
        Muon([("w", w)], split={"w": (3, 3)})
    with pytest.raises(ValueError, match="named parameters"):
        Muon([w], split={"w": (4, 4)})
    with pytest.raises(ValueError, match="positive row sizes"):
        Muon([("w", w)], split={"w": (8, 0)})
    model = GPT(GPTConfig(n_layer=1, n_head=2, d_model=16, seq_len=8, fused=True))
    with pytest.raises(ValueError, match="'nope', which is not a parameter"):
        build_optimizer(model, split={"nope": (1,)})
    with pytest.raises(ValueError, match="'embed.weight', which is not routed to Muon"):
        build_optimizer(model, split={"embed.weight": (1,)})


def test_build_optimizer_detects_the_gpt_fused_layers():
    cfg = CONFIGS["tiny-moe"]
    model = GPT(cfg)
    opt = build_optimizer(model)
    split = opt.param_groups[0]["split"]
    hd, h = cfg.head_dim, cfg.moe.hidden
    assert split["blocks.0.attn.qkv.weight"] == (4 * hd, 2 * hd, 2 * hd)
    assert split["blocks.1.mlp.experts_gate_up"] == (h, h)
    assert model.blocks[0].mlp.experts_gate_up.shape == (8, 2 * h, cfg.d_model)
    table = {n: g["optimizer"] for g in opt.param_groups for n in g["param_names"]}
    assert table["blocks.0.attn.qkv.weight"] == "muon"  # 256 rows = vocab, still not a head
    assert table["lm_head.weight"] == "adamw"
    dense = GPT(GPTConfig(n_layer=1, n_head=2, d_model=16, seq_len=8, fused=True))
    assert set(dense.split_spec()) == {"blocks.0.attn.qkv.weight", "blocks.0.mlp.gate_up.weight"}
    assert build_optimizer(GPT(CONFIGS["tiny"])).param_groups[0]["split"] == {}


# ---------------------------------------------------------------- QK-clip


def _attn_logits(model, x):
    model.attention_max_logits()
    model(x)
    return model.attention_max_logits()


@pytest.mark.parametrize(
    "cfg",
    [
        GPTConfig(n_layer=2, n_head=4, d_model=32, seq_len=16),
        GPTConfig(n_layer=2, n_head=4, n_kv_head=2, d_model=32, seq_len=16, fused=True),
    ],
    ids=["separate", "fused-gqa"],
)
def test_qk_clip_bounds_max_logit_and_leaves_other_heads(cfg):
    torch.manual_seed(0)
    model = GPT(cfg)
    clip = QKClip(model, tau=100.0)
    x = torch.randint(0, 256, (2, 16))
    before = _attn_logits(model, x)
    heads = model.qk_clip_heads()
    # Hot heads in the last layer only (clipping a layer changes the inputs of later ones);
    # under GQA head 0 shares its key head with head 1, which stays below tau.
    hot = {"blocks.0.attn": [], "blocks.1.attn": [0, 2]}
    with torch.no_grad():  # push chosen heads to a max logit of 150 (logits are linear in q)
        for layer, hs in hot.items():
            h = heads[layer]
            w = dict(model.named_parameters())[h.q_weight]
            for i in hs:
                rows = slice(h.q_row0 + i * h.head_dim, h.q_row0 + (i + 1) * h.head_dim)
                w[rows] *= 150.0 / before[layer][i]
    pushed = _attn_logits(model, x)
    weights = {n: p.detach().clone() for n, p in model.named_parameters()}
    model(x)
    stats = clip.step()
    assert stats == {"max_logit": pytest.approx(150.0, rel=1e-4), "clipped_heads": 2.0}
    after = _attn_logits(model, x)
    for layer, m in after.items():
        for i in range(cfg.n_head):
            if i in hot[layer]:
                assert pushed[layer][i] > 149 and m[i] == pytest.approx(100.0, rel=1e-4)
            else:
                assert m[i] == pytest.approx(float(pushed[layer][i]), rel=1e-5)
    assert max(float(m.max()) for m in after.values()) <= 100.0 * (1 + 1e-5)
    changed = {n for n, p in model.named_parameters() if not torch.equal(p, weights[n])}
    h = heads["blocks.1.attn"]
    assert changed == {h.q_weight, h.k_weight}
    if cfg.n_kv_head is None:  # one key head per query head: untouched heads stay bitwise
        for i in (1, 3):
            rows = slice(i * h.head_dim, (i + 1) * h.head_dim)
            assert torch.equal(model.get_parameter(h.q_weight)[rows], weights[h.q_weight][rows])
            assert torch.equal(model.get_parameter(h.k_weight)[rows], weights[h.k_weight][rows])


def test_clip_factors_split_and_gqa():
    q, k = clip_factors(torch.tensor([400.0, 50.0]), tau=100.0, alpha=0.5, n_kv_head=2)
    torch.testing.assert_close(q, torch.tensor([0.5, 1.0], dtype=torch.float64))
    torch.testing.assert_close(k, torch.tensor([0.5, 1.0], dtype=torch.float64))
    q, k = clip_factors(torch.tensor([400.0, 50.0]), tau=100.0, alpha=1.0, n_kv_head=1)
    torch.testing.assert_close(q * k, torch.tensor([0.25, 1.0], dtype=torch.float64))
    torch.testing.assert_close(k, torch.tensor([1.0], dtype=torch.float64))
    q, k = clip_factors(torch.tensor([400.0, 50.0]), tau=100.0, alpha=0.5, n_kv_head=1)
    torch.testing.assert_close(q * k, torch.tensor([0.25, 1.0], dtype=torch.float64))
    with pytest.raises(ValueError, match="tau"):
        QKClip(GPT(CONFIGS["tiny"]), tau=0.0)
    with pytest.raises(TypeError, match="record_attention_logits"):
        QKClip(nn.Linear(2, 2))


# ---------------------------------------------------------------- distributed


def _ref_step(loss_fn, opt, batches):
    """Single-process oracle of one data-parallel step: the mean of every rank's loss."""
    loss = sum(loss_fn(b) for b in batches) / len(batches)
    loss.backward()
    opt.step()
    opt.zero_grad()


def _gpt_batches(world_size, step):
    g = torch.Generator().manual_seed(100 + step)
    return [torch.randint(0, 64, (2, 8), generator=g) for _ in range(world_size)]


def _moe_ranks(rank, world_size):
    out = {}
    # 1. Expert slices of one 3-D parameter owned by different ranks.
    kw = dict(lr=0.05, split={"experts": (5, 5)}, weight_decay=0.01)
    torch.manual_seed(0)
    ref = Experts()
    model = Experts()
    model.load_state_dict(ref.state_dict())
    ref_opt = build_optimizer(ref, **kw)
    opt = LayerwiseDistributedOptimizer(model, split_experts=True, bucket_mb=1e-4, **kw)
    out["expert_owners"] = {n: r for n, r in opt.owner_of.items() if n.startswith("experts")}
    for step in range(3):
        g = torch.Generator().manual_seed(step)
        batches = [torch.randn(8, 6, generator=g) for _ in range(world_size)]
        _ref_step(ref, ref_opt, batches)
        model(batches[rank]).backward()
        opt.step()
        opt.zero_grad()
    opt.wait_for_params()
    out["experts"] = (model.experts.detach().clone(), ref.experts.detach().clone())
    owned = {k.split("/")[2] for k in ckpt.sharded_state_dict(opt) if k.startswith("optim/state/")}
    out["expert_state_keys"] = sorted(owned)
    out["full"] = opt.state_dict()  # slices joined: build_optimizer's format
    out["ref_full"] = ref_opt.state_dict()

    # 2. QK-clip with q and k of a layer owned by different ranks; logits pushed over tau.
    cfg = GPTConfig(n_layer=2, n_head=2, d_model=16, seq_len=8, vocab_size=64)
    torch.manual_seed(1)
    ref = GPT(cfg)
    with torch.no_grad():
        for name, p in ref.named_parameters():
            if name.endswith(("attn.q.weight", "attn.k.weight")):
                p.mul_(25.0)
    model = GPT(cfg)
    model.load_state_dict(ref.state_dict())
    ref_opt = build_optimizer(ref, lr=0.01)
    ref_clip = QKClip(ref, tau=10.0, reduce_max=lambda t: t)  # this process's reference
    opt = LayerwiseDistributedOptimizer(model, lr=0.01)
    clip = QKClip(model, tau=10.0, optimizer=opt)
    out["qk_owners"] = {
        n: opt.owner_of[n] for n in ("blocks.0.attn.q.weight", "blocks.0.attn.k.weight")
    }
    out["stats"] = []
    for step in range(2):
        batches = _gpt_batches(world_size, step)
        _ref_step(lambda b: ref(b, b), ref_opt, batches)
        model(batches[rank], batches[rank]).backward()
        opt.step()
        opt.zero_grad()
        out["stats"].append((clip.step(), ref_clip.step()))
    out["gpt"] = {n: p.detach().clone() for n, p in model.named_parameters()}
    out["gpt_ref"] = {n: p.detach().clone() for n, p in ref.named_parameters()}
    try:  # under 2 ranks, with no way to agree: refused, not left to drift apart
        QKClip(GPT(cfg), tau=10.0)
    except ValueError as exc:
        out["qk_refused"] = str(exc)
    return out


def full_experts(sd):
    """The momentum of `experts` in a full state dict."""
    names = {n: i for g in sd["param_groups"] for i, n in zip(g["params"], g["param_names"])}
    return sd["state"][names["experts"]]["momentum_buffer"]


def test_expert_slices_and_qk_clip_across_two_ranks():
    r0, r1 = run_ranks(_moe_ranks, 2)
    # The experts of the one 3-D tensor are spread over both ranks, and match the oracle.
    assert set(r0["expert_owners"]) == {f"experts[{e}:{e + 1}]" for e in range(4)}
    assert set(r0["expert_owners"].values()) == {0, 1}
    mine = [sorted(n for n, r in r0["expert_owners"].items() if r == rank) for rank in (0, 1)]
    assert [k for k in r0["expert_state_keys"] if k.startswith("experts")] == mine[0]
    assert [k for k in r1["expert_state_keys"] if k.startswith("experts")] == mine[1]
    for r in (r0, r1):
        got, ref = r["experts"]
        torch.testing.assert_close(got, ref, atol=2e-6, rtol=1e-5)
    assert torch.equal(r0["experts"][0], r1["experts"][0])
    # The full dict joins the slices of both owners into the parameter's entry, as the
    # single-process optimizer holds it; loading cuts them again (round trip at 1 rank).
    full, ref_full = r0["full"], r0["ref_full"]
    assert full["param_groups"][0]["param_names"] == ref_full["param_groups"][0]["param_names"]
    for i, st in ref_full["state"].items():
        torch.testing.assert_close(
            full["state"][i]["momentum_buffer"], st["momentum_buffer"], atol=1e-6, rtol=1e-5
        )
    torch.manual_seed(0)
    model = Experts()
    lw = LayerwiseDistributedOptimizer(
        model, split_experts=True, lr=0.05, split={"experts": (5, 5)}, weight_decay=0.01
    )
    lw.load_state_dict(full)
    expert1 = lw._slot_by_name("experts[1:2]").data
    assert torch.equal(lw.state[expert1]["momentum_buffer"], full_experts(full)[1:2])
    again = lw.state_dict()
    for i, st in full["state"].items():
        for k, v in st.items():
            assert torch.equal(again["state"][i][k], v), (i, k)
    # QK-clip: q and k on different owners; every replica equals the single-process run.
    assert "optimizer=" in r0["qk_refused"] and "reduce_max=" in r0["qk_refused"]
    q_owner, k_owner = r0["qk_owners"].values()
    assert q_owner != k_owner
    for dist_stats, ref_stats in r0["stats"] + r1["stats"]:
        assert dist_stats["clipped_heads"] == ref_stats["clipped_heads"] > 0
        assert dist_stats["max_logit"] == pytest.approx(ref_stats["max_logit"], rel=1e-4)
    for name, ref in r0["gpt_ref"].items():
        assert torch.equal(r0["gpt"][name], r1["gpt"][name]), name
        torch.testing.assert_close(r0["gpt"][name], ref, atol=2e-5, rtol=1e-4)


# ---------------------------------------------------------------- end to end


def test_train_tiny_moe_two_ranks(tmp_path):
    out = tmp_path / "moe"
    argv = ["train", "--config", "tiny-moe", "--nproc", "2", "--steps", "6", "--batch", "2",
            "--eval-every", "6", "--eval-batches", "2", "--ckpt-every", "6", "--warmup", "1",
            "--out", str(out), "--no-progress"]  # fmt: skip
    assert main(argv) == 0
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    train = [r["train_loss"] for r in rows if "train_loss" in r]
    vals = [r["val_loss"] for r in rows if "val_loss" in r]
    assert len(train) == 6 and train[-1] < train[0] and vals[-1] < vals[0]
    assert all("max_logit" in r and "clipped_heads" in r for r in rows if "train_loss" in r)
    assert (out / "checkpoints/step_000006/optim.pt").is_file()  # the full dict, from rank 0


def test_split_expert_checkpoints_reshard_across_splits(tmp_path):
    """DCP checkpoints of expert slices load with another split, without split, and into the
    single-process optimizer (slices cut and joined by name); and the reverse."""
    kw = dict(lr=0.05, split={"experts": (5, 5)}, weight_decay=0.01)

    def trained(split_experts):
        torch.manual_seed(0)
        model = Experts()
        opt = LayerwiseDistributedOptimizer(model, split_experts=split_experts, **kw)
        for step in range(2):
            model(torch.randn(8, 6, generator=torch.Generator().manual_seed(step))).backward()
            opt.step()
            opt.zero_grad()
        ckpt.save_sharded(tmp_path / str(split_experts), opt, model)
        return opt.state_dict()

    def same(a, b):
        assert a["state"].keys() == b["state"].keys()
        for i, st in a["state"].items():
            for k, v in st.items():
                assert torch.equal(b["state"][i][k], v), (i, k)

    for saved_split, load_splits in ((True, (False, 2)), (False, (True,))):
        want = trained(saved_split)
        for split in (*load_splits, None):
            torch.manual_seed(1)
            model = Experts()
            if split is None:
                opt = build_optimizer(model, **kw)
            else:
                opt = LayerwiseDistributedOptimizer(model, split_experts=split, **kw)
            ckpt.load_sharded(tmp_path / str(saved_split), opt, model)
            same(want, ckpt.full_state_dict(opt))


def _expert_group_ranks(rank, world_size):
    """Expert data parallelism of one rank per expert group: every rank holds its own experts
    (as under expert parallelism), dense weights are shared and averaged over both ranks."""
    import torch.distributed as dist

    groups = [dist.new_group([r]) for r in range(world_size)]
    kw = dict(lr=0.05, weight_decay=0.01)
    refs = rank_experts(world_size)
    model = Experts()
    model.load_state_dict(refs[rank].state_dict())
    ref_opts = [build_optimizer(m, **kw) for m in refs]
    opt = LayerwiseDistributedOptimizer(
        model, expert_group=groups[rank], split_experts=True, bucket_mb=1e-4, **kw
    )
    for step in range(2):
        g = torch.Generator().manual_seed(step)
        batches = [torch.randn(8, 6, generator=g) for _ in range(world_size)]
        for m, b in zip(refs, batches):
            m(b).backward()
        mean = sum(m.inp.weight.grad for m in refs) / world_size
        for m, o in zip(refs, ref_opts):
            m.inp.weight.grad = mean.clone()
            o.step()
            o.zero_grad()
        model(batches[rank]).backward()
        opt.step()
        opt.zero_grad()
    opt.wait_for_params()
    with pytest.raises(NotImplementedError, match="expert_group"):
        opt.state_dict()
    return {
        "got": {n: p.detach().clone() for n, p in model.named_parameters()},
        "ref": {n: p.detach().clone() for n, p in refs[rank].named_parameters()},
        "owners": dict(opt.owner_of),
        "stats": opt.comm_stats(),
        "expected": opt.expected_comm_bytes(),
    }


def test_expert_group_separate_from_dense_group():
    results = run_ranks(_expert_group_ranks, 2)
    for r in results:
        for name, ref in r["ref"].items():
            torch.testing.assert_close(r["got"][name], ref, atol=2e-6, rtol=1e-5)
        # every expert is owned by the only rank of its group; nothing of them moves
        assert all(o == 0 for n, o in r["owners"].items() if n.startswith("experts"))
        stats = {k: v for k, v in r["stats"].items() if k != "total"}
        assert stats == r["expected"] and set(stats) == {"reduce", "broadcast", "all_reduce"}
    assert not torch.equal(results[0]["got"]["experts"], results[1]["got"]["experts"])
    assert torch.equal(results[0]["got"]["inp.weight"], results[1]["got"]["inp.weight"])


def test_fsdp_optimizer_orthogonalizes_split_blocks_like_muon():
    from orthoptim import FSDPOptimizer

    cfg = GPTConfig(n_layer=1, n_head=2, n_kv_head=1, d_model=16, seq_len=8, fused=True)
    torch.manual_seed(0)
    models = [GPT(cfg) for _ in range(3)]
    for m in models[1:]:
        m.load_state_dict(models[0].state_dict())
    kw = dict(lr=0.02, lr_scale="sqrt_max_dim", weight_decay=0.01)
    opts = [
        FSDPOptimizer(models[0], **kw),  # world size 1, plain model: split from split_spec()
        build_optimizer(models[1], **kw),
        build_optimizer(models[2], split={}, **kw),
    ]
    for step in range(2):
        x = torch.randint(0, 256, (2, 8), generator=torch.Generator().manual_seed(step))
        for m, o in zip(models, opts):
            m(x, x).backward()
            o.step()
            o.zero_grad()
    got, ref, whole = (dict(m.named_parameters()) for m in models)
    for name in got:
        torch.testing.assert_close(got[name], ref[name], atol=1e-6, rtol=1e-6)
    qkv = "blocks.0.attn.qkv.weight"
    assert not torch.allclose(got[qkv], whole[qkv], atol=1e-4)


def test_zero_grad_to_zeros_steps_like_set_to_none_with_expert_slices():
    """`zero_grad(set_to_none=False)` over expert slices (gradients that are views) zeroes
    them in place, as torch's does, and the next steps equal those after set_to_none=True."""

    def trained(set_to_none: bool) -> dict:
        torch.manual_seed(0)
        model = Experts()
        opt = LayerwiseDistributedOptimizer(model, split_experts=True, lr=0.05)
        for step in range(3):
            model(torch.randn(8, 6, generator=torch.Generator().manual_seed(step))).backward()
            opt.step()
            opt.zero_grad(set_to_none=set_to_none)
        return {n: p.detach().clone() for n, p in model.named_parameters()}

    zeros, nones = trained(False), trained(True)
    for name in nones:
        assert torch.equal(zeros[name], nones[name]), name
