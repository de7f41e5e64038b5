"""Expert parallelism in the built-in MoE GPT: token dispatch by all-to-all over real gloo
ranks against the single-process model on the concatenated global batch (float64): the
tokens each expert computes, the loss with its load-balancing term, the expert and dense
gradients; the capacity (drop) policy against a hand-written oracle; full state dicts
gathered from and cut into expert-parallel models; refusals of sizes it cannot split."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
import torch.distributed as dist

from models.ep import BATCH, CFG, OPT_KW, REL
from models.ep import moe_model as _model
from models.ep import rel as _rel
from models.ep import state_by_name as _state
from orthoptim import build_optimizer
from orthoptim import checkpoint as ckpt
from orthoptim import collectives as C
from orthoptim.optim.state import state_view
from orthoptim.parallel.layout import ParallelDims
from orthoptim.plan.layouts import Layout
from orthoptim.plan.model import gpt_description
from orthoptim.plan.work import work_figures
from orthoptim.train.model import (
    CONFIGS,
    GPT,
    MoE,
    expert_parallelize,
    full_expert_state_dict,
    load_expert_state_dict,
)

from distributed import run_ranks


def _global_batch(world_size, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(0, CFG.vocab_size, (world_size * BATCH, CFG.seq_len), generator=g)
    y = torch.randint(0, CFG.vocab_size, (world_size * BATCH, CFG.seq_len), generator=g)
    return x, y


def _mine(t, rank):
    return t[rank * BATCH : (rank + 1) * BATCH]


def _counts(model):
    return [m.tokens_per_expert.clone() for m in model.moe_layers().values()]


def _grads(model):
    return {n: p.grad.detach().clone() for n, p in model.named_parameters()}


def _ep_ranks(rank, world_size):
    out = {}
    model = expert_parallelize(_model(), dist.group.WORLD, rank, world_size)
    x, y = _global_batch(world_size)
    loss = model(_mine(x, rank), _mine(y, rank))
    loss.backward()
    out["loss"] = loss.item()
    out["aux"] = model.router_aux_loss().item()
    out["counts"] = _counts(model)
    out["grads"] = _grads(model)
    out["shapes"] = {n: tuple(p.shape) for n, p in model.named_parameters()}
    out["bytes"] = model.dispatch_stats.as_dict()
    # the same ranks, balancing counts left local: the loss is no longer the global one
    local = expert_parallelize(_model(), dist.group.WORLD, rank, world_size)
    for m in local.moe_layers().values():
        m.stats_groups = []
    out["local_loss"] = local(_mine(x, rank), _mine(y, rank)).item()
    # dp 4 with ep 2 (expert data parallelism 2), groups from the layout object: expert grads
    # summed over the expert group and dense grads over dp, both divided by dp
    mesh = ParallelDims.for_world(world_size, ep=2).build()
    model = expert_parallelize(_model(), mesh.ep_group, mesh.coord.ep, 2, mesh.dp_group)
    model(_mine(x, rank), _mine(y, rank)).backward()
    out["edp_grads"] = {}
    for name, p in model.named_parameters():
        g = p.grad.clone()
        C.all_reduce(g, group=mesh.expert_group if "experts_" in name else mesh.dp_group)
        out["edp_grads"][name] = g / world_size
    out["ep_index"] = mesh.coord.ep
    return out


@pytest.fixture(scope="module")
def ep4():
    return run_ranks(_ep_ranks, 4)


@pytest.fixture(scope="module")
def ref4():
    model = _model()
    x, y = _global_batch(4)
    loss = model(x, y)
    loss.backward()
    return {"loss": loss.item(), "counts": _counts(model), "grads": _grads(model)}


def test_tokens_reach_their_experts(ep4, ref4):
    E, local = CFG.moe.n_expert, CFG.moe.n_expert // 4
    for layer, ref in enumerate(ref4["counts"]):
        got = torch.cat([r["counts"][layer] for r in ep4])  # rank e computed experts 2e, 2e+1
        assert got.shape == (E,) and all(
            c.shape == (local,) for c in (r["counts"][layer] for r in ep4)
        )
        assert torch.equal(got, ref), (layer, got, ref)
        assert ref.sum() == 4 * BATCH * CFG.seq_len * CFG.moe.top_k


def test_ep_loss_equals_the_global_batch_loss(ep4, ref4):
    mean = sum(r["loss"] for r in ep4) / 4
    assert math.isclose(mean, ref4["loss"], rel_tol=REL)
    # the balancing term is in it, and its counts must be the global ones: local counts
    # give another loss (the test can fail)
    assert all(r["aux"] > 0 for r in ep4)
    local = sum(r["local_loss"] for r in ep4) / 4
    assert abs(local - ref4["loss"]) > 1e3 * REL * ref4["loss"]


def test_ep_gradients_equal_single_process(ep4, ref4):
    local = CFG.moe.n_expert // 4
    for name, ref in ref4["grads"].items():
        if "experts_" in name:
            for e, r in enumerate(ep4):
                assert r["shapes"][name] == (local, *ref.shape[1:])
                # the all-to-all backward summed the 4 ranks' losses: divide by dp = 4
                want = ref[e * local : (e + 1) * local]
                assert _rel(r["grads"][name] / 4, want) <= REL, (name, e)
        else:
            mean = sum(r["grads"][name] for r in ep4) / 4
            assert _rel(mean, ref) <= REL, name


def test_ep2_inside_dp4_gradients_equal_single_process(ep4, ref4):
    assert [r["ep_index"] for r in ep4] == [0, 1, 0, 1]
    for r in ep4:
        e = r["ep_index"]
        for name, ref in ref4["grads"].items():
            want = ref[4 * e : 4 * e + 4] if "experts_" in name else ref
            assert _rel(r["edp_grads"][name], want) <= REL, (name, e)


def test_dispatch_bytes_are_the_rows_that_leave(ep4):
    row = CFG.d_model * 8  # float64 rows of d_model
    for kind in ("expert_dispatch", "expert_combine"):
        sent = [r["bytes"][kind]["sent"] for r in ep4]
        received = [r["bytes"][kind]["received"] for r in ep4]
        assert sum(sent) == sum(received) > 0 and all(s % row == 0 for s in sent)
        assert all(r["bytes"][kind]["calls"] == 2 * CFG.n_layer for r in ep4)  # fwd + bwd
    for r in ep4:  # E int64 counts from each of 3 peers, per layer
        assert r["bytes"]["expert_counts"]["received"] == CFG.n_layer * 3 * CFG.moe.n_expert * 8


def test_the_plan_counts_the_dispatch_collectives_the_model_makes(ep4):
    """The step-time model's expert collectives (`plan.work`) are the real model's: per rank,
    the dispatch and combine all-to-alls forward and backward, and the counts' all-gathers
    with their bytes (E int64 counts from each of the ep - 1 peers); the rows' bytes are
    the model's rows at its width."""
    desc = gpt_description(CFG, "ep-test")
    tokens = 4 * BATCH * CFG.seq_len
    a2a, counts = work_figures(desc, Layout(dp=4, ep=4), tokens)["collectives"]
    for r in ep4:
        b = r["bytes"]
        calls = b["expert_dispatch"]["calls"] + b["expert_combine"]["calls"]
        assert a2a["forward_calls"] + a2a["backward_calls"] == calls
        assert counts["forward_calls"] == b["expert_counts"]["calls"]
        assert counts["bytes_per_call"] * counts["forward_calls"] == b["expert_counts"]["received"]
    # balanced routing: each rank's rows × top-k, (ep - 1)/ep of them leaving, fp32 rows
    rows = BATCH * CFG.seq_len * CFG.moe.top_k
    assert a2a["bytes_per_call"] == rows * CFG.d_model * 4 * 3 / 4


# ---------------------------------------------------------------- capacity (drops)


def _drop_oracle(moe, x):
    """A loop over (choice, token) in queue order, each expert taking `capacity` pairs."""
    probs = moe.router(x).softmax(-1)
    weight, chosen = probs.topk(moe.top_k, -1)
    weight = weight / weight.sum(-1, keepdim=True)
    capacity = math.ceil(moe.capacity_factor * x.shape[0] * moe.top_k / moe.n_expert)
    taken = [0] * moe.n_expert
    out, dropped = torch.zeros_like(x), 0
    for k in range(moe.top_k):
        for t in range(x.shape[0]):
            e = int(chosen[t, k])
            if taken[e] == capacity:
                dropped += 1
                continue
            taken[e] += 1
            gate, up = (x[t] @ moe.experts_gate_up[e].T).chunk(2)
            out[t] += weight[t, k] * ((torch.nn.functional.silu(gate) * up) @ moe.experts_down[e].T)
    return out, dropped


DROP_CFG = dataclasses.replace(CFG, moe=dataclasses.replace(CFG.moe, capacity_factor=0.5))


def test_capacity_drops_over_capacity_pairs_like_the_oracle():
    moe = _model(DROP_CFG).blocks[0].mlp
    x = torch.randn(
        24, CFG.d_model, dtype=torch.float64, generator=torch.Generator().manual_seed(3)
    )
    with torch.no_grad():
        got = moe(x)
        want, dropped = _drop_oracle(moe, x)
    assert dropped > 0 and int(moe.dropped) == dropped
    assert int(moe.tokens_per_expert.sum()) == 24 * moe.top_k - dropped
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-14)
    # dropless: nothing dropped, nothing reported
    dense = _model().blocks[0].mlp
    dense(x)
    assert dense.dropped is None


# ---------------------------------------------------------------- 2 ranks: drops, checkpoints


def _ep2_ranks(rank, world_size):
    out = {}
    x, y = _global_batch(world_size, seed=1)
    # ep 2 with capacity: each rank drops among its own tokens, so a rank's output is the
    # single-process model's on that rank's batch alone
    model = expert_parallelize(_model(DROP_CFG), dist.group.WORLD, rank, world_size)
    with torch.no_grad():
        out["drop_logits"] = model(_mine(x, rank))
    out["dropped"] = model.dropped_tokens()
    # plain data parallelism (ep 1): the balancing counts summed over the dp group
    dp = expert_parallelize(_model(), None, 0, 1, stats_group=None)  # None: every rank
    out["dp_loss"] = dp(_mine(x, rank), _mine(y, rank)).item()
    # full state dicts: gathered equal the single-process model's; cut again on load
    model = expert_parallelize(_model(), dist.group.WORLD, rank, world_size)
    out["full"] = {k: v.clone() for k, v in full_expert_state_dict(model).items()}
    other = GPT(CFG).double().state_dict()  # another seed's full model
    load_expert_state_dict(model, other)
    out["loaded"] = {k: v.clone() for k, v in model.state_dict().items()}
    try:
        load_expert_state_dict(model, model.state_dict())
    except ValueError as exc:
        out["refused"] = str(exc)
    out["other"] = other
    return out


def test_ep2_drops_per_rank_and_state_dicts_gather_and_cut():
    ranks = run_ranks(_ep2_ranks, 2)
    x, y = _global_batch(2, seed=1)
    ref = _model(DROP_CFG)
    full = _model().state_dict()
    for rank, r in enumerate(ranks):
        with torch.no_grad():
            want = ref(_mine(x, rank))
        assert _rel(r["drop_logits"], want) <= REL
        assert r["dropped"] == ref.dropped_tokens() > 0
        assert r["full"].keys() == full.keys()
        for k, v in full.items():
            assert torch.equal(r["full"][k], v), k  # an all-gather: bitwise
        for k, v in r["loaded"].items():
            src = r["other"][k]
            if "experts_" in k:
                src = src[4 * rank : 4 * (rank + 1)]
            assert torch.equal(v, src), k
        assert "holds 4 experts" in r["refused"] and f"[{4 * rank}:{4 * rank + 4}]" in r["refused"]
    want = _model()(x, y).item()
    assert math.isclose(sum(r["dp_loss"] for r in ranks) / 2, want, rel_tol=REL)
    # the gathered dict loads into a single-process model
    single = GPT(CFG).double()
    single.load_state_dict(ranks[0]["full"])


# ---------------------------------------------------------------- checkpoints across --ep


def _ep_optimizer(model, group):
    """A per-rank optimizer over an expert-parallel model whose state view names the experts
    globally (what a driver's `state_view()` returns under --ep)."""
    opt = build_optimizer(model, **OPT_KW)
    inner = state_view(opt)
    opt.state_view = lambda: ckpt.ExpertSlicesView(inner, model.expert_parallel_slices(), group)
    return opt


def _step(model, opt, x, y, world_size=1):
    """One step on the global batch: this rank's part under --ep, dense gradients averaged
    over the ranks and expert gradients divided by dp (the conventions of the drivers)."""
    model(x, y).backward()
    for p in model.parameters():
        if world_size > 1 and p.grad is not None:
            if p.shape[0] == CFG.moe.n_expert // world_size and p.ndim == 3:
                p.grad /= world_size
            else:
                C.all_reduce(p.grad)
                p.grad /= world_size
    opt.step()
    opt.zero_grad()


def _ckpt_ranks(rank, world_size, folder):
    x, y = _global_batch(world_size, seed=2)
    model = expert_parallelize(_model(), dist.group.WORLD, rank, world_size)
    opt = _ep_optimizer(model, dist.group.WORLD)
    _step(model, opt, _mine(x, rank), _mine(y, rank), world_size)
    out = {"full": ckpt.full_state_dict(opt), "model": full_expert_state_dict(model)}
    ckpt.save_sharded(f"{folder}/ep", opt, model)
    # the single-process checkpoint, loaded here: each rank takes its experts
    fresh = expert_parallelize(_model(), dist.group.WORLD, rank, world_size)
    opt = _ep_optimizer(fresh, dist.group.WORLD)
    ckpt.load_sharded(f"{folder}/single", opt, fresh)
    out["loaded"] = {k: v.clone() for k, v in fresh.state_dict().items()}
    out["loaded_full"] = ckpt.full_state_dict(opt)
    return out


def test_checkpoints_move_between_ep2_and_one_process(tmp_path):
    x, y = _global_batch(2, seed=2)
    ref = _model()
    ref_opt = build_optimizer(ref, **OPT_KW)
    _step(ref, ref_opt, x, y)
    ckpt.save_sharded(tmp_path / "single", ref_opt, ref)
    ranks = run_ranks(_ckpt_ranks, 2, args=(str(tmp_path),))
    want, want_sd = _state(ckpt.full_state_dict(ref_opt)), ref.state_dict()
    for r in ranks:
        got = _state(r["full"])
        assert got.keys() == want.keys()
        for n, st in want.items():
            for k, v in st.items():
                if isinstance(v, torch.Tensor) and v.ndim:
                    assert got[n][k].shape == v.shape and _rel(got[n][k], v) <= REL, (n, k)
        for k, v in want_sd.items():
            assert _rel(r["model"][k], v) <= REL, k
    # single process → ep 2: every rank holds its experts of the single-process state
    for rank, r in enumerate(ranks):
        for k, v in want_sd.items():
            v = v[4 * rank : 4 * rank + 4] if "experts_" in k else v
            assert torch.equal(r["loaded"][k], v), k
        for n, st in _state(r["loaded_full"]).items():
            for k, v in st.items():
                if isinstance(v, torch.Tensor):
                    assert torch.equal(v, _state(ckpt.full_state_dict(ref_opt))[n][k]), (n, k)
    # ep 2 → single process
    single = GPT(CFG).double()
    single_opt = build_optimizer(single, **OPT_KW)
    ckpt.load_sharded(tmp_path / "ep", single_opt, single)
    for k, v in want_sd.items():
        assert _rel(single.state_dict()[k], v) <= REL, k
    for n, st in _state(ckpt.full_state_dict(single_opt)).items():
        for k, v in st.items():
            if isinstance(v, torch.Tensor) and v.ndim:
                assert _rel(v, want[n][k]) <= REL, (n, k)


def test_float64_model_keeps_float64_loss():
    x, y = _global_batch(1)
    model = _model(dataclasses.replace(CFG, moe=dataclasses.replace(CFG.moe, aux_loss_coef=0.0)))
    logits = model(x)
    want = -logits.log_softmax(-1).gather(-1, y[..., None]).mean()
    assert logits.dtype == torch.float64 and _rel(model(x, y), want) <= 1e-14


# ---------------------------------------------------------------- refusals


def test_expert_parallelize_refuses_what_it_cannot_split():
    with pytest.raises(
        ValueError, match=r"--ep 3 must divide the model's 8 experts.*\[1, 2, 4, 8\]"
    ):
        expert_parallelize(_model(), None, 0, 3)
    dense = GPT(dataclasses.replace(CONFIGS["tiny"], n_layer=1, d_model=16, n_head=2))
    with pytest.raises(ValueError, match=r"--ep 2 needs a mixture-of-experts model.*tiny-moe"):
        expert_parallelize(dense, None, 0, 2)
    with pytest.raises(ValueError, match=r"ep_group has 1 ranks"):
        expert_parallelize(_model(), None, 1, 2)


def test_ep1_stats_group_only():
    model = expert_parallelize(_model(), None, 0, 1)
    assert all(
        isinstance(m, MoE) and m.experts_down.shape[0] == 8 for m in model.moe_layers().values()
    )
    assert model.expert_parallel_slices() == {}
