"""bfloat16 optimizer state (`state_dtype=torch.bfloat16`, `orthoptim.optim.lean`): the
stochastic rounding, Muon's momentum and AdamW's moments against float64 oracles within
bounds derived from bfloat16's rounding, determinism and resumption, checkpoints, the
layer-wise driver, `orthoptim train`'s flag, and the plan against the dry run."""

from __future__ import annotations

import io
import math

import pytest
import torch
from torch import nn

from models.checkpoint import KW, make_model, train
from orthoptim import build_optimizer
from orthoptim import checkpoint as ckpt
from orthoptim.optim.adamw import LeanAdamW
from orthoptim.optim.lean import STREAM_KEY, stochastic_round_
from orthoptim.optim.muon import Muon
from orthoptim.parallel import LayerwiseDistributedOptimizer
from orthoptim.safe_load import safe_load

from distributed import run_ranks

BF16 = torch.bfloat16
# float32's unit roundoff, and a bfloat16 ulp relative to the value it spaces, at most: 8
# significant bits. Stochastic rounding moves a value by less than one ulp (round to nearest:
# half of one, the 2^-8 relative of bfloat16's unit roundoff).
U32 = 2.0**-24
ULP16 = 2.0**-7


def _neighbours(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The bfloat16 values just below and above each float32 `x` in magnitude (truncating
    the low 16 bits, and one bfloat16 ulp above that)."""
    low = (x.view(torch.int32) & -(1 << 16)).view(torch.float32)
    high = ((x.view(torch.int32) & -(1 << 16)) + (1 << 16)).view(torch.float32)
    return low, high


def test_stochastic_rounding_is_unbiased_and_lands_on_a_neighbour() -> None:
    """Every rounding is one of the two bfloat16 neighbours of its value; the mean of N
    seeded roundings of each value is the value within 6 standard deviations of a mean of N
    Bernoulli draws between the neighbours (σ ≤ ulp / (2√N)). Round to nearest is off by up
    to half an ulp (≈ 64σ at N = 4096) and fails; so does truncation."""
    g = torch.Generator().manual_seed(0)
    n, values = 4096, 64
    x = (torch.rand(values, generator=g) * 2 - 1) * torch.logspace(-20, 20, values, 2.0)
    x = x.float()
    low, high = _neighbours(x)
    draws = x.repeat(n, 1)
    out = torch.empty_like(draws, dtype=BF16)
    stochastic_round_(out, draws, torch.Generator().manual_seed(1))
    rounded = out.float()
    assert ((rounded == low) | (rounded == high)).all()
    ulp = (high - low).abs().double()
    err = (rounded.double().mean(0) - x.double()).abs()
    assert (err <= 6 * ulp / (2 * math.sqrt(n))).all(), (err / ulp).max()
    # the bound tells the rounding apart from round to nearest on these values
    nearest = (x.to(BF16).double() - x.double()).abs()
    assert (nearest > 6 * ulp / (2 * math.sqrt(n))).float().mean() > 0.5


def _grads(shape: tuple[int, ...], steps: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    return [torch.randn(shape, generator=g) * (1 + t % 3) for t in range(steps)]


def test_bf16_muon_momentum_within_the_rounding_bound_of_a_float64_oracle() -> None:
    """Muon with bfloat16 momentum (an identity orthogonalizer, so the step is linear in the
    update) against float64 Muon maths, elementwise over 30 steps. Derived bound: each step
    the fp32 momentum m = lerp(M̃, G) is off the oracle's M* by A_t ≤ μ·B_{t-1} + 4u(|M*| +
    B_{t-1} + |G|) (u = 2^-24), the stored M̃ = round(m) by B_t ≤ A_t + 2^-7·(|M*| + A_t)
    (one bfloat16 ulp); the update (1−μ)G + μm by μ·A_t + 4u(|G| + |M*| + A_t), and the
    parameter accumulates lr times that plus u·|W| per step. Checked after every step."""
    mu, lr, steps = 0.9, 0.1, 30
    w0 = torch.randn(16, 32, generator=torch.Generator().manual_seed(3))
    p = nn.Parameter(w0.clone())
    opt = Muon(
        [("w", p)], lr=lr, momentum=mu, orthogonalizer=lambda m: m.clone(), lr_scale="none",
        state_dtype=BF16,
    )  # fmt: skip
    w_ref, m_ref = w0.double(), torch.zeros_like(w0, dtype=torch.float64)
    bound_m = torch.zeros_like(m_ref)
    bound_w = torch.zeros_like(m_ref)
    for grad in _grads(tuple(w0.shape), steps):
        p.grad = grad.clone()
        opt.step()
        g = grad.double()
        m_ref = mu * m_ref + (1 - mu) * g
        w_ref = w_ref - lr * ((1 - mu) * g + mu * m_ref)
        a = mu * bound_m + 4 * U32 * (m_ref.abs() + bound_m + g.abs())
        bound_m = a + ULP16 * (m_ref.abs() + a)
        update_err = mu * a + 4 * U32 * (g.abs() + m_ref.abs() + a)
        bound_w = bound_w + lr * update_err + U32 * w_ref.abs()
        # every step: the first ones' bounds are tight (no earlier rounding in them)
        assert ((opt.state[p]["momentum_buffer"].double() - m_ref).abs() <= bound_m).all()
        assert ((p.detach().double() - w_ref).abs() <= bound_w).all()
    assert opt.state[p]["momentum_buffer"].dtype == BF16


def _check_adamw_against_oracle(
    p: nn.Parameter, opt: torch.optim.Optimizer, steps: int, hypers: dict
) -> None:
    """Step `opt` over `p` and float64 AdamW maths side by side, checking after every step
    that the moments and the parameter are within their bounds of the oracle's. Bounds as the Muon
    test's per moment (β1 for m, β2 for v, 4u of the fp32 arithmetic, one bfloat16 ulp per
    stored value); the update m/(√(v/c₂) + ε) of this step's fp32 moments then lies in the
    box of m ± A^m, v ± A^v: its error is at most the largest over the box's corners (the
    ratio is monotone in m and in v), plus 8u of the fp32 ratio and u·|W| per step."""
    lr, (b1, b2), eps, wd = hypers["lr"], hypers["betas"], hypers["eps"], hypers["weight_decay"]
    w = p.detach().double().clone()
    m = torch.zeros_like(w)
    v = torch.zeros_like(w)
    bm, bv, bw = (torch.zeros_like(w) for _ in range(3))
    for t, grad in enumerate(_grads(tuple(p.shape), steps), start=1):
        p.grad = grad.clone()
        opt.step()
        g = grad.double()
        m = b1 * m + (1 - b1) * g
        v = b2 * v + (1 - b2) * g * g
        c1, c2 = 1 - b1**t, math.sqrt(1 - b2**t)
        ratio = m / ((v.sqrt() / c2) + eps)
        w = w * (1 - lr * wd) - lr / c1 * ratio
        am = b1 * bm + 4 * U32 * (m.abs() + bm + g.abs())
        av = b2 * bv + 4 * U32 * (v + bv + g * g)
        bm, bv = am + ULP16 * (m.abs() + am), av + ULP16 * (v + av)
        corners = [
            ((m + sm * am) / (((v + sv * av).clamp_min(0).sqrt() / c2) + eps) - ratio).abs()
            for sm in (-1, 1)
            for sv in (-1, 1)
        ]
        worst = torch.stack(corners).amax(0) + 8 * U32 * ratio.abs()
        bw = bw * (1 - lr * wd) + lr / c1 * worst + 2 * U32 * w.abs()
        state = opt.state[p]
        assert ((state["exp_avg"].double() - m).abs() <= bm).all(), t
        assert ((state["exp_avg_sq"].double() - v).abs() <= bv).all(), t
        assert ((p.detach().double() - w).abs() <= bw).all(), t


ADAMW = dict(lr=1e-2, betas=(0.9, 0.99), eps=1e-8, weight_decay=0.1)


def test_bf16_adamw_moments_within_the_rounding_bound_of_a_float64_oracle() -> None:
    """`LeanAdamW` with bfloat16 moments against float64 AdamW maths over 20 steps,
    elementwise within the bounds `_check_adamw_against_oracle` derives, after every step."""
    p = nn.Parameter(torch.randn(8, 24, generator=torch.Generator().manual_seed(5)))
    opt = LeanAdamW([("w", p)], state_dtype=BF16, **ADAMW)
    _check_adamw_against_oracle(p, opt, 20, ADAMW)
    assert opt.state[p]["exp_avg"].dtype == opt.state[p]["exp_avg_sq"].dtype == BF16


def test_lean_adamw_in_float32_is_torchs_adamw_and_none_keeps_torchs() -> None:
    """With float32 state `LeanAdamW` is torch's AdamW within float32 rounding (4 ulps of the
    parameter per step, relative: here it is bitwise); `build_optimizer` without
    `state_dtype` keeps torch's own AdamW, and takes `LeanAdamW` for bfloat16."""
    w0 = torch.randn(8, 24, generator=torch.Generator().manual_seed(5))
    a, b = nn.Parameter(w0.clone()), nn.Parameter(w0.clone())
    ours = LeanAdamW([("w", a)], state_dtype=torch.float32, **ADAMW)
    theirs = torch.optim.AdamW([b], **ADAMW)
    steps = 10
    for grad in _grads(tuple(w0.shape), steps):
        a.grad, b.grad = grad.clone(), grad.clone()
        ours.step()
        theirs.step()
    torch.testing.assert_close(a, b, rtol=4 * steps * U32, atol=0)
    torch.testing.assert_close(ours.state[a]["exp_avg_sq"], theirs.state[b]["exp_avg_sq"])
    model = nn.Sequential(nn.Embedding(10, 8), nn.Linear(8, 8), nn.Linear(8, 10))
    assert type(build_optimizer(model).inner["adamw"]) is torch.optim.AdamW
    lean = build_optimizer(model, state_dtype=BF16)
    assert type(lean.inner["adamw"]) is LeanAdamW
    with pytest.raises(ValueError, match="keeps float32 state"):
        build_optimizer(model, optimizer="soap", state_dtype=BF16)
    with pytest.raises(ValueError, match="state_dtype must be"):
        build_optimizer(model, state_dtype=torch.float16)


class Small(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(16, 12)
        self.fc1 = nn.Linear(12, 24)
        self.fc2 = nn.Linear(24, 12)
        self.head = nn.Linear(12, 16, bias=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.head(self.fc2(torch.relu(self.fc1(self.emb(idx)))))


def _run(model: nn.Module, opt: torch.optim.Optimizer, steps: range) -> None:
    for step in steps:
        idx = torch.randint(0, 16, (4, 6), generator=torch.Generator().manual_seed(step))
        loss = nn.functional.cross_entropy(model(idx).flatten(0, 1), idx.flatten())
        loss.backward()
        opt.step()
        opt.zero_grad()


def _fresh(seed: int = 0) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = Small()
    return model, build_optimizer(model, lr=0.02, state_dtype=BF16, rounding_seed=seed)


def _flat(model: nn.Module, opt: torch.optim.Optimizer) -> dict:
    out = {f"p/{n}": p.detach().clone() for n, p in model.named_parameters()}
    names = {id(p): n for n, p in model.named_parameters()}
    for p, st in opt.state.items():
        out |= {f"s/{names[id(p)]}/{k}": v for k, v in st.items()}
    return out


def _bitwise(a: dict, b: dict) -> bool:
    assert a.keys() == b.keys()
    return all(
        torch.equal(a[k], b[k]) and a[k].dtype == b[k].dtype if torch.is_tensor(a[k])
        else a[k] == b[k]
        for k in a
    )  # fmt: skip


def test_same_seed_is_bitwise_and_a_resumed_run_continues_the_stream() -> None:
    """Two runs with the same `rounding_seed` are bitwise equal whatever torch's global seed
    is; another seed rounds otherwise; a run resumed from its `state_dict()` (saved and read
    back as a checkpoint file is, weights only) ends bitwise where the uninterrupted run
    ends, its state in bfloat16 with the rounding streams in it."""
    results = []
    for global_seed in (1, 2):
        model, opt = _fresh()
        torch.manual_seed(global_seed)
        _run(model, opt, range(6))
        results.append(_flat(model, opt))
    assert _bitwise(results[0], results[1])
    model, opt = _fresh(seed=1)
    _run(model, opt, range(6))
    assert not _bitwise(results[0], _flat(model, opt))

    model, opt = _fresh()
    _run(model, opt, range(3))
    buf = io.BytesIO()
    torch.save({"model": model.state_dict(), "opt": opt.state_dict()}, buf)
    buf.seek(0)
    saved = safe_load(buf, "the test's checkpoint")
    for st in saved["opt"]["state"].values():
        assert {v.dtype for v in st.values() if torch.is_tensor(v)} == {BF16}
        assert STREAM_KEY in st
    assert all(g["state_dtype"] == BF16 for g in saved["opt"]["param_groups"])
    resumed, opt2 = _fresh()
    resumed.load_state_dict(saved["model"])
    opt2.load_state_dict(saved["opt"])
    assert all(
        v.dtype == BF16 for st in opt2.state.values() for v in st.values() if torch.is_tensor(v)
    )
    _run(resumed, opt2, range(3, 6))
    assert _bitwise(results[0], _flat(resumed, opt2))


def test_the_layerwise_driver_passes_state_dtype_to_both_parts() -> None:
    """`LayerwiseDistributedOptimizer(..., state_dtype=torch.bfloat16)` (one process) holds
    Muon's momentum and `LeanAdamW`'s moments in bfloat16, in its whole-model template too,
    and `memory()` counts a quarter of the float64 run's state."""
    held = {}
    for dtype in (None, BF16):
        model = make_model()
        opt = LayerwiseDistributedOptimizer(model, **KW, state_dtype=dtype)
        train(model, opt, range(2))
        held[dtype] = opt.memory()["state"]
        if dtype is None:
            counts = sum(torch.is_tensor(st.get("step")) for st in opt.state.values())
            continue
        for inner in (opt.inner, opt.template):
            assert type(inner.inner["adamw"]) is LeanAdamW
            assert inner.inner["muon"].defaults["state_dtype"] == BF16
        dtypes = {v.dtype for st in opt.state.values() for v in st.values() if torch.is_tensor(v)}
        assert dtypes == {BF16}
    # float64 state (this model's) is 8 bytes an element, bfloat16 2; torch's AdamW counts
    # its steps in 4-byte tensors, `LeanAdamW` in Python ints
    assert held[None] == 4 * held[BF16] + 4 * counts


BEFORE, AFTER = 3, 3


def _save_and_resume_bf16(rank: int, world_size: int, path: str) -> dict:
    """2 ranks, bfloat16 state: train, save (DCP), go on; resume from the checkpoint in fresh
    objects (bitwise the run that went on) and return what the other resharding needs."""
    kw = dict(KW, state_dtype=BF16)
    model = make_model()
    opt = LayerwiseDistributedOptimizer(model, **kw)
    train(model, opt, range(BEFORE), rank, world_size)
    ckpt.save_sharded(path, opt, model)
    uninterrupted = train(model, opt, range(BEFORE, BEFORE + AFTER), rank, world_size)
    model2 = make_model(seed=1)
    opt2 = LayerwiseDistributedOptimizer(model2, **kw)
    ckpt.load_sharded(path, opt2, model2)
    dtypes = {v.dtype for st in opt2.state.values() for v in st.values() if torch.is_tensor(v)}
    resumed = train(model2, opt2, range(BEFORE, BEFORE + AFTER), rank, world_size)
    return {"uninterrupted": uninterrupted, "resumed": resumed, "dtypes": dtypes}


def test_bf16_state_checkpoints_reshard_in_its_dtype(tmp_path) -> None:
    """A bfloat16-state layer-wise run at 2 ranks saved with DCP resumes at 2 ranks bitwise
    (each parameter's stream in its state) and at 1 rank in bfloat16, close to the 2-rank
    run (the sharded AdamW runs, joined, round with the bits of one stream)."""
    path = str(tmp_path / "ckpt")
    r = run_ranks(_save_and_resume_bf16, 2, args=(path,))
    for rank in range(2):
        assert r[rank]["dtypes"] == {BF16}
        for n, p in r[rank]["resumed"].items():
            assert torch.equal(p, r[rank]["uninterrupted"][n]), (rank, n)
    model = make_model(seed=1)
    opt = LayerwiseDistributedOptimizer(model, **KW, state_dtype=BF16)
    ckpt.load_sharded(path, opt, model)
    assert {v.dtype for st in opt.state.values() for v in st.values() if torch.is_tensor(v)} == {
        BF16
    }
    got = train(model, opt, range(BEFORE, BEFORE + AFTER))
    want = r[0]["uninterrupted"]
    worst = max(((got[n] - w).norm() / w.norm()).item() for n, w in want.items())
    # after resharding the AdamW runs round with other bits: each moment one bfloat16 ulp
    # (2^-7) apart at most, an update of size ~lr moving by ≲ 2 ulps, over AFTER steps, of
    # parameters of size ~1 (measured: 1.0e-5)
    assert worst <= AFTER * KW["adamw_lr"] * 2 * ULP16, worst


def test_train_flag_builds_bf16_state_and_refuses_what_keeps_fp32() -> None:
    """`--state-dtype bf16` reaches the optimizer `orthoptim train` builds (its stochastic
    rounding seeded by --seed) and is refused, naming the flag, with SOAP, Lion and FSDP."""
    from orthoptim.train.args import TrainArgs
    from orthoptim.train.loop import make_optimizer

    args = TrainArgs(state_dtype="bf16", seed=5)
    args.validate()
    opt = make_optimizer(Small(), args, world_size=1)
    assert opt.inner["muon"].defaults["rounding_seed"] == 5
    assert type(opt.inner["adamw"]) is LeanAdamW
    for bad in (dict(optimizer="soap"), dict(elementwise="lion"), dict(fsdp=True)):
        with pytest.raises(ValueError, match="--state-dtype"):
            TrainArgs(state_dtype="bf16", **bad).validate()


@pytest.mark.parametrize("optimizer", ["muon", "adamw"])
def test_plan_counts_the_bf16_state_the_dry_run_holds(optimizer) -> None:
    """`orthoptim plan --state-dtype bf16`'s state per rank is the dry run's of the real
    optimizer (exact), half the fp32 plan's; the peak agrees within 1 % (for the layer-wise
    AdamW, whose step rounds each parameter's piece of a bucket on its own, too)."""
    from orthoptim.plan import Layout, load_hardware, load_model, make_plan
    from orthoptim.plan.dryrun import plan_figures, run_rank

    gpt, h200 = load_model("train:base"), load_hardware("h200")
    layout = Layout(dp=8, state_dtype="bf16", optimizer=optimizer)
    plan = make_plan(gpt, h200, layout)
    fp32 = make_plan(gpt, h200, Layout(dp=8, optimizer=optimizer))["memory_per_rank"]
    fp32 = fp32["state_per_rank"]
    assert [2 * s for s in plan["memory_per_rank"]["state_per_rank"]] == fp32
    for rank in (0, 7):
        r = run_rank(gpt, layout, rank)
        figures = plan_figures(plan, r.plan_index)
        assert r.memory["state"] == figures["state"]
        assert r.peak == pytest.approx(figures["peak"], rel=0.01)
