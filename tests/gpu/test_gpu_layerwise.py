"""LayerwiseDistributedOptimizer at 2 ranks sharing one GPU against the single-process
`build_optimizer` run on the same device (computed inside rank 0, so it runs in the same
kind of process, same kernels and threads), all in ONE spawned run:

- Muon (hybrid with AdamW) and plain AdamW, float64 models and float64 Newton-Schulz, on the
  same global batch split over the ranks;
- SOAP on identical gradients (every rank takes the whole batch);
- bf16 parameter gathers; expert slices of a small MoE GPT owned by different ranks
  (`split_experts=True`); QK-clip with a low τ (it must clip);
- the default Newton-Schulz dtype ("auto": bf16 on CUDA) against fp32 Newton-Schulz.
"""

from __future__ import annotations

import pytest
import torch

from orthoptim import LayerwiseDistributedOptimizer, QKClip, build_optimizer
from orthoptim.newton_schulz import resolve_ns_dtype
from orthoptim.train.model import GPT, GPTConfig, MoEConfig

from ._models import (
    WORLD,
    assert_close_rel,
    assert_replicas_equal,
    make_model,
    params,
    rel_errors,
    setup_rank,
    spawn,
    to_cpu,
    train,
)

F64 = torch.float64
STEPS = 5
KW = {
    "muon": dict(optimizer="muon", lr=0.02, adamw_lr=3e-3, weight_decay=0.01, ns_dtype=F64),
    "adamw": dict(optimizer="adamw", lr=3e-3),
    # eigenbases refreshed every other step, so refreshes happen within the run
    "soap": dict(optimizer="soap", lr=3e-3, adamw_lr=3e-3, precondition_frequency=2),
}

# float64 end to end (models, gradients, Newton-Schulz, Adam): the 2-rank gradient is the mean
# of two half-batch gradients, equal to the full-batch one up to float64 rounding (~1e-16
# relative per operation). Five Newton-Schulz steps amplify a perturbation by at most the
# quintic's slope at 0 per step (a ≈ 4.1, so ≤ 4.1⁵ ≈ 1.2e3) and a few optimizer steps add
# their own factor; 1e-10 leaves > 10³ of room for that and still fails anything run in
# float32 (≈ 1e-7 per operation). Measured on CPU: ≤ 1e-15.
F64_RTOL = 1e-10
# bf16 gathers: every replica holds parameters rounded to 8 bits (2⁻⁹ ≈ 2e-3 relative), and
# forwards on rounded weights move the gradients by as much; 3 steps stay within 2e-2 (as
# tests/test_layerwise.py's fp32 version). Measured on CPU: 3.8e-3.
BF16_GATHER_RTOL = 2e-2
# The MoE GPT and the QK-clip GPT compute their loss, router softmax and recorded logits in
# float32 (the model casts). Their inputs agree to float64 rounding, so the float32 values
# agree except where a value sits on a float32 rounding boundary (2⁻²⁴ ≈ 6e-8 relative then);
# 1e-6 bounds that after a few steps. Measured on CPU: ≤ 2e-14.
F32_CAST_RTOL = 1e-6
# Default Newton-Schulz dtype on CUDA (bf16) against fp32 Newton-Schulz, on what the
# optimizer moved the Muon matrices (P_3 − P_0): bf16 keeps 8 bits (2⁻⁹ relative rounding of
# every product's output, fp32 accumulation); docs/optimizers.md measures the bf16 polar
# factor within 0.6–3 % (Frobenius) of the fp32 one at condition 10–100 and 6–20 % at 1e3,
# the loss being
# the directions of tiny singular values. A bound of 0.25 holds those; a floor of 1e-4 shows
# the iteration really ran in bf16 (fp32 agrees to ~1e-6). Measured on CPU (explicit bf16):
# 1.5–2.2 %.
BF16_NS_RTOL, BF16_NS_FLOOR = 0.25, 1e-4
BF16_STEPS = 3


# ---------------------------------------------------------------- GPT models (train/model.py)

MOE_CFG = GPTConfig(
    n_layer=1, n_head=2, n_kv_head=1, d_model=32, seq_len=16, vocab_size=64, fused=True,
    moe=MoEConfig(n_expert=4, top_k=2, hidden=32),
)  # fmt: skip
QK_CFG = GPTConfig(n_layer=2, n_head=2, d_model=16, seq_len=8, vocab_size=64)
GPT_BATCH = 4  # global; 2 per rank
QK_TAU = 10.0


def gpt_batch(cfg, step, device, rank=None):
    g = torch.Generator().manual_seed(100 + step)
    idx = torch.randint(0, cfg.vocab_size, (GPT_BATCH, cfg.seq_len), generator=g)
    if rank is not None:
        per = GPT_BATCH // WORLD
        idx = idx[rank * per : (rank + 1) * per]
    return idx.to(device)


def make_gpt(cfg, device, hot_qk=False):
    torch.manual_seed(1)
    model = GPT(cfg)
    if hot_qk:  # logits far above τ, so QK-clip has heads to clip
        with torch.no_grad():
            for name, p in model.named_parameters():
                if name.endswith(("attn.q.weight", "attn.k.weight")):
                    p.mul_(25.0)
    return model.to(device=device, dtype=F64)


def train_gpt(model, opt, cfg, steps, device, rank=None, clip=None):
    stats = []
    for step in steps:
        x = gpt_batch(cfg, step, device, rank)
        model(x, x).backward()
        opt.step()
        opt.zero_grad()
        if clip is not None:
            stats.append(clip.step())
    wait = getattr(opt, "wait_for_params", None)
    if wait is not None:
        wait()
    return stats


# ---------------------------------------------------------------- the ranks


def _reference(config, device, steps=STEPS, **kw):
    model = make_model(device)
    train(model, build_optimizer(model, **KW[config], **kw), range(steps), device)
    return params(model)


def _ranks(rank, world_size, device):
    setup_rank(device)
    out, ref = {}, {}

    # Muon (hybrid) and AdamW on the global batch split over the ranks.
    for config in ("muon", "adamw"):
        if rank == 0:
            ref[config] = _reference(config, device)
        model = make_model(device)
        opt = LayerwiseDistributedOptimizer(model, **KW[config], bucket_mb=0.01)
        train(model, opt, range(STEPS), device, rank)
        out[config] = params(model)
        out[f"{config}_owners"] = dict(opt.owner_of)

    # SOAP: every rank takes the whole batch, so the averaged gradient is exactly the
    # single-process one ((g + g) / 2 = g in floating point). SOAP's first Adam steps in the
    # eigenbases of rank-deficient factors turn any rounding difference into an O(1) one, so
    # the check is bitwise on identical gradients (its maths are per parameter, unbatched).
    if rank == 0:
        ref["soap"] = _reference("soap", device, steps=4)
    model = make_model(device)
    opt = LayerwiseDistributedOptimizer(model, **KW["soap"], bucket_mb=0.01)
    train(model, opt, range(4), device)
    out["soap"] = params(model)
    out["soap_state_names"] = sorted(
        n for g in opt.param_groups for p, n in zip(g["params"], g["param_names"]) if p in opt.state
    )

    # bf16 gathers (several buckets: bucket_mb small).
    model = make_model(device)
    opt = LayerwiseDistributedOptimizer(
        model, **KW["muon"], gather_dtype=torch.bfloat16, bucket_mb=0.01
    )
    train(model, opt, range(3), device, rank)
    out["bf16_gather"] = params(model)
    if rank == 0:
        ref["muon_3"] = _reference("muon", device, steps=3)

    # Expert slices: each expert of the 3-D weights is its own unit, owned across ranks.
    kw = dict(lr=0.02, weight_decay=0.01, adamw_lr=3e-3, ns_dtype=F64)
    if rank == 0:
        model = make_gpt(MOE_CFG, device)
        train_gpt(model, build_optimizer(model, **kw), MOE_CFG, range(3), device)
        ref["moe"] = params(model)
    model = make_gpt(MOE_CFG, device)
    opt = LayerwiseDistributedOptimizer(model, split_experts=True, bucket_mb=1e-3, **kw)
    train_gpt(model, opt, MOE_CFG, range(3), device, rank)
    out["moe"] = params(model)
    out["moe_owners"] = {n: r for n, r in opt.owner_of.items() if "experts_" in n}
    out["moe_owned"] = sorted(
        n
        for g in opt.param_groups
        for p, n in zip(g["params"], g["param_names"])
        if "experts_" in n and p in opt.state
    )

    # QK-clip with τ far below the logits: both runs clip, and agree. The single-process
    # QKClip reduces over its own process only.
    kw = dict(lr=0.01, ns_dtype=F64)
    if rank == 0:
        model = make_gpt(QK_CFG, device, hot_qk=True)
        opt = build_optimizer(model, **kw)
        clip = QKClip(model, tau=QK_TAU, reduce_max=lambda t: t)
        ref["qk_stats"] = train_gpt(model, opt, QK_CFG, range(2), device, clip=clip)
        ref["qk"] = params(model)
    model = make_gpt(QK_CFG, device, hot_qk=True)
    opt = LayerwiseDistributedOptimizer(model, **kw)
    clip = QKClip(model, tau=QK_TAU, optimizer=opt)
    out["qk_stats"] = train_gpt(model, opt, QK_CFG, range(2), device, rank, clip)
    out["qk"] = params(model)
    out["qk_owners"] = {n: r for n, r in opt.owner_of.items() if ".attn.q" in n or ".attn.k" in n}

    # The default Newton-Schulz dtype: "auto" is bf16 on CUDA. On CPU "auto" is fp32, so the
    # CPU run asks for bf16 explicitly to exercise the same comparison.
    cuda = torch.device(device).type == "cuda"
    hybrid = dict(optimizer="muon", lr=0.02, adamw_lr=3e-3, weight_decay=0.01)
    out["auto_dtype"] = str(resolve_ns_dtype("auto", device, torch.float32))
    start = make_model(device, torch.float32)
    out["f32_start"] = params(start)
    if rank == 0:
        model = make_model(device, torch.float32)
        opt = build_optimizer(model, **hybrid, ns_dtype=torch.float32)
        train(model, opt, range(BF16_STEPS), device)
        ref["ns_fp32"] = params(model)
    model = make_model(device, torch.float32)
    extra = {} if cuda else {"ns_dtype": torch.bfloat16}
    opt = LayerwiseDistributedOptimizer(model, **hybrid, **extra, bucket_mb=0.01)
    out["ns_default_group_dtype"] = str(opt.param_groups[0].get("ns_dtype"))
    train(model, opt, range(BF16_STEPS), device, rank)
    out["ns_default"] = params(model)
    out["ns_muon_names"] = [
        n for g in opt.param_groups if g["optimizer"] == "muon" for n in g["param_names"]
    ]
    out["ref"] = ref
    return to_cpu(out)


@pytest.fixture(scope="module")
def runs(env):
    return spawn(env, _ranks)


@pytest.mark.parametrize("config", ["muon", "adamw"])
def test_matches_single_process_in_float64(runs, config):
    assert_replicas_equal(runs, config)
    ref = runs[0]["ref"][config]
    assert_close_rel(runs[0][config], ref, F64_RTOL, config)
    # the work is really split: under Muon both ranks own matrices; AdamW parameters have no
    # owner (-1), every rank steps its run of them (shard_adamw)
    owners = set(runs[0][f"{config}_owners"].values())
    assert owners == ({-1, *range(WORLD)} if config == "muon" else {-1}), owners
    # the run moved the parameters (the comparison is not trivially true)
    start = params(make_model("cpu"))
    assert (runs[0][config]["blocks.0.qkv.weight"] - start["blocks.0.qkv.weight"]).norm() > 1e-3


def test_soap_on_identical_gradients_is_bitwise_single_process(runs):
    assert_replicas_equal(runs, "soap")
    ref = runs[0]["ref"]["soap"]
    for n, p in runs[0]["soap"].items():
        assert torch.equal(p, ref[n]), f"{n}: {rel_errors({n: p}, {n: ref[n]})}"
    # each rank holds the state of what it owns only, and together all of it
    names = [set(r["soap_state_names"]) for r in runs]
    assert all(names) and not names[0] & names[1]


def test_bf16_gather(runs):
    assert_replicas_equal(runs, "bf16_gather")
    for n, p in runs[0]["bf16_gather"].items():
        assert torch.equal(p, p.bfloat16().to(p.dtype)), f"{n} is not bf16-representable"
    err = assert_close_rel(
        runs[0]["bf16_gather"], runs[0]["ref"]["muon_3"], BF16_GATHER_RTOL, "bf16 gather"
    )
    assert err > 0  # rounded, so not the float64 result


def test_split_experts_moe(runs):
    assert_replicas_equal(runs, "moe")
    assert_close_rel(runs[0]["moe"], runs[0]["ref"]["moe"], F32_CAST_RTOL, "moe")
    owners = runs[0]["moe_owners"]
    # every expert is its own unit, and the experts of one tensor live on both ranks
    gate_up = {n: r for n, r in owners.items() if "experts_gate_up" in n}
    assert len(gate_up) == MOE_CFG.moe.n_expert, gate_up
    assert set(gate_up.values()) == set(range(WORLD)), gate_up
    for rank, r in enumerate(runs):
        mine = {n for n, o in owners.items() if o == rank}
        assert set(r["moe_owned"]) == mine


def test_qk_clip_clips_and_matches(runs):
    ref_stats = runs[0]["ref"]["qk_stats"]
    assert all(s["clipped_heads"] > 0 for s in ref_stats), ref_stats
    for r in runs:
        for got, want in zip(r["qk_stats"], ref_stats, strict=True):
            assert got["clipped_heads"] == want["clipped_heads"], (got, want)
            assert got["max_logit"] == pytest.approx(want["max_logit"], rel=F32_CAST_RTOL)
            assert got["max_logit"] > QK_TAU
    # q and k of a layer on different owners: the clip edits weights a rank did not step
    owners = runs[0]["qk_owners"]
    assert owners["blocks.0.attn.q.weight"] != owners["blocks.0.attn.k.weight"], owners
    assert_replicas_equal(runs, "qk")
    assert_close_rel(runs[0]["qk"], runs[0]["ref"]["qk"], F32_CAST_RTOL, "qk-clip")


def test_default_newton_schulz_dtype(env, runs):
    r0 = runs[0]
    assert r0["auto_dtype"] == ("torch.bfloat16" if env.cuda else "torch.float32")
    want = "auto" if env.cuda else "torch.bfloat16"
    assert r0["ns_default_group_dtype"] == want
    assert_replicas_equal(runs, "ns_default")
    start, got, ref = r0["f32_start"], r0["ns_default"], r0["ref"]["ns_fp32"]
    errors = rel_errors(
        {n: got[n] - start[n] for n in r0["ns_muon_names"]},
        {n: ref[n] - start[n] for n in r0["ns_muon_names"]},
    )
    assert errors, "no Muon matrices"
    worst = max(errors.values())
    assert worst <= BF16_NS_RTOL, errors
    assert worst >= BF16_NS_FLOOR, f"bf16 Newton-Schulz should differ from fp32: {errors}"
