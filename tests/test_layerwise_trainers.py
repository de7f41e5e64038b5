"""The layer-wise optimizer in other people's training loops (issue 30): a
DistributedDataParallel wrap (HF Trainer, accelerate and Lightning add one) with its
`no_sync()` accumulation and torch's `clip_grad_norm_`, against the replicated optimizer
under the same wrap; torch's clipping without the wrap refused at `step()`; `state_dict()`
called by rank 0 alone failing fast, and working after `prepare_state_dict()`;
`model.state_dict()` right after `step()` holding the updated values.

One spawn of 2 gloo ranks runs every leg (the suite's time)."""

import time

import pytest
import torch
from torch import nn

from models.layerwise import BATCH, CONFIGS, batch, loss_fn, make_model
from orthoptim import build_optimizer
from orthoptim.collectives import store
from orthoptim.parallel import LayerwiseDistributedOptimizer

from distributed import run_ranks

STEPS, MAX_NORM, TIMEOUT_S = 4, 0.05, 3.0


def _micro(rank, world_size, step):
    """This rank's two micro-batches of `step` (gradient accumulation 2)."""
    x, y = batch(step)
    per = BATCH // world_size
    x, y = x[rank * per : (rank + 1) * per], y[rank * per : (rank + 1) * per]
    half = per // 2
    return [(x[:half], y[:half]), (x[half:], y[half:])]


def _ddp_run(rank, world_size, layerwise):
    """STEPS steps of the DDP-wrapped model: accumulation 2 under DDP's `no_sync()`, torch's
    clip_grad_norm_ on the model's parameters, step; the losses, norms and final weights."""
    model = make_model()
    if layerwise:
        opt = LayerwiseDistributedOptimizer(model, **CONFIGS["hybrid"], bucket_mb=0.03)
    else:
        opt = build_optimizer(model, **CONFIGS["hybrid"])
    ddp = nn.parallel.DistributedDataParallel(model, find_unused_parameters=True)
    losses, norms, kinds = [], [], set()
    for step in range(STEPS):
        (x0, y0), (x1, y1) = _micro(rank, world_size, step)
        with ddp.no_sync():
            (loss_fn(ddp, x0, y0) / 2).backward()
        loss = loss_fn(ddp, x1, y1) / 2
        loss.backward()
        norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM).item())
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
        if layerwise:
            kinds |= set(opt.comm_stats())
    if layerwise:
        opt.wait_for_params()
    weights = {n: p.detach().clone() for n, p in model.named_parameters()}
    return {"losses": losses, "norms": norms, "weights": weights, "kinds": kinds}


def _torch_clip_unwrapped(rank, world_size):
    """torch's clip_grad_norm_ on the unwrapped model before step(): the message."""
    model = make_model()
    opt = LayerwiseDistributedOptimizer(model, **CONFIGS["hybrid"], bucket_mb=0.03)
    (x, y), _ = _micro(rank, world_size, 0)
    loss_fn(model, x, y).backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)
    try:
        opt.step()
    except RuntimeError as e:
        message = str(e)
    else:
        message = None
    # the next step starts clean: no collective of the refused one is left in flight
    opt.zero_grad()
    loss_fn(model, x, y).backward()
    opt.step()
    opt.wait_for_params()
    return message


def _twice_without_no_sync(rank, world_size):
    """Two backwards before step() on the unwrapped model, the first outside no_sync()."""
    model = make_model()
    LayerwiseDistributedOptimizer(model, **CONFIGS["hybrid"], bucket_mb=0.03)
    (x0, y0), (x1, y1) = _micro(rank, world_size, 0)
    loss_fn(model, x0, y0).backward()
    try:
        loss_fn(model, x1, y1).backward()
    except RuntimeError as e:
        return str(e)
    return None


def _rank0_state_dict(rank, world_size):
    """state_dict() by rank 0 alone: how long until it fails, and the message; then
    prepare_state_dict() on every rank and state_dict() by rank 0 alone, against the
    collective full_state_dict()."""
    store.RENDEZVOUS_TIMEOUT_S = TIMEOUT_S
    model = make_model()
    opt = LayerwiseDistributedOptimizer(model, **CONFIGS["hybrid"], bucket_mb=0.03)
    (x, y), _ = _micro(rank, world_size, 0)
    loss_fn(model, x, y).backward()
    opt.step()
    out = {}
    if rank == 0:
        start = time.perf_counter()
        try:
            opt.state_dict()
        except RuntimeError as e:
            out["message"] = str(e)
        out["seconds"] = time.perf_counter() - start
    torch.distributed.barrier()
    opt.prepare_state_dict()
    if rank == 0:
        out["prepared"] = opt.state_dict()  # rank 0 alone
    out["collective"] = opt.full_state_dict(to_rank0=True)
    return out


def _model_state_after_step(rank, world_size):
    """model.state_dict() right after step() (gathers in flight; bf16 gathers round only
    when they land), against the values once every gather is waited for."""
    model = make_model()
    opt = LayerwiseDistributedOptimizer(
        model, **CONFIGS["hybrid"], bucket_mb=0.03, gather_dtype=torch.bfloat16
    )
    (x, y), _ = _micro(rank, world_size, 0)
    loss_fn(model, x, y).backward()
    opt.step()
    early = {k: v.clone() for k, v in model.state_dict().items()}
    block = {k: v.clone() for k, v in model.blocks[0].state_dict().items()}
    opt.wait_for_params()
    late = {k: v.clone() for k, v in model.state_dict().items()}
    return {"early": early, "late": late, "block": block, "before": make_model().state_dict()}


def _legs(rank, world_size):
    torch.set_num_threads(1)
    return {
        "ddp": {lw: _ddp_run(rank, world_size, lw) for lw in (False, True)},
        "clip": _torch_clip_unwrapped(rank, world_size),
        "twice": _twice_without_no_sync(rank, world_size),
        "rank0": _rank0_state_dict(rank, world_size),
        "model_sd": _model_state_after_step(rank, world_size),
    }


@pytest.fixture(scope="module")
def legs():
    return run_ranks(_legs, 2)


def test_under_ddp_the_layerwise_optimizer_equals_the_replicated_one(legs):
    """Under DDP (accumulation 2 with DDP's no_sync, torch's clip_grad_norm_ on the model's
    parameters, clipping active): losses, norms and weights equal the replicated optimizer's
    under the same wrap, on both ranks; the optimizer reduces nothing itself (DDP did)."""
    for res in legs:
        ref, lw = res["ddp"][False], res["ddp"][True]
        assert max(ref["norms"]) > MAX_NORM  # clipping acted
        assert lw["losses"] == ref["losses"]
        assert lw["norms"] == ref["norms"]
        for n, p in ref["weights"].items():
            torch.testing.assert_close(lw["weights"][n], p, rtol=0, atol=0, msg=n)
        assert not lw["kinds"] & {"reduce", "reduce_scatter"}, lw["kinds"]
        assert "all_gather" in lw["kinds"] or "broadcast" in lw["kinds"]


def test_torch_clipping_of_the_unwrapped_model_is_refused(legs):
    """torch's clip_grad_norm_ scales each rank's unreduced gradients by a norm that is not
    the model's: step() raises naming opt.clip_grad_norm_, and the next step runs."""
    for res in legs:
        assert res["clip"] is not None and "opt.clip_grad_norm_" in res["clip"], res["clip"]


def test_accumulation_without_no_sync_is_refused_unwrapped(legs):
    """Unwrapped, at 2 ranks, the first backward's gradients are being reduced when the
    second arrives: it raises, naming opt.no_sync()."""
    for res in legs:
        assert res["twice"] is not None and "opt.no_sync()" in res["twice"], res["twice"]


def test_a_rank0_state_dict_fails_fast_or_works_when_prepared(legs):
    """state_dict() entered by rank 0 alone fails within the rendezvous timeout (3 s here,
    `RENDEZVOUS_TIMEOUT_S` = 20 s by default) naming prepare_state_dict(); after
    prepare_state_dict() on every rank, rank 0 alone gets the collective dict."""
    res = legs[0]["rank0"]
    assert "prepare_state_dict()" in res["message"] and "1 of the 2" in res["message"]
    assert TIMEOUT_S <= res["seconds"] < TIMEOUT_S + 5
    assert legs[1]["rank0"]["collective"] == {}
    prepared, full = res["prepared"], res["collective"]
    assert prepared["param_groups"] == full["param_groups"]
    assert prepared["state"].keys() == full["state"].keys() and full["state"]
    for i, st in full["state"].items():
        for k, v in st.items():
            assert torch.equal(prepared["state"][i][k], v), (i, k)


def test_model_state_dict_after_step_holds_the_updated_values(legs):
    """model.state_dict() (and a submodule's) right after step() waits for the gathers."""
    for res in (r["model_sd"] for r in legs):
        for k, v in res["late"].items():
            assert torch.equal(res["early"][k], v), k
        for k, v in res["block"].items():
            assert torch.equal(v, res["late"][f"blocks.0.{k}"]), k
        assert any(not torch.equal(v, res["before"][k]) for k, v in res["late"].items())
