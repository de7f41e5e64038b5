"""Checkpoints at 2 ranks sharing one GPU: a DCP `save_sharded` / `load_sharded` round trip
of the layer-wise optimizer (and the model), and its full `state_dict()` resumed by a
single-process `build_optimizer` on the same device. One spawned run; the single-process
resume runs here."""

from __future__ import annotations

import copy

import pytest
import torch

from orthoptim import LayerwiseDistributedOptimizer, build_optimizer
from orthoptim import checkpoint as ckpt

from ._models import (
    assert_close_rel,
    assert_replicas_equal,
    make_model,
    params,
    setup_rank,
    spawn,
    to_cpu,
    train,
)

F64 = torch.float64
KW = dict(optimizer="muon", lr=0.02, adamw_lr=3e-3, weight_decay=0.01, ns_dtype=F64)
SAVE_AT, END = 3, 5
# float64 throughout; a single process on the full batch against 2 ranks on its halves:
# float64 rounding amplified by Newton-Schulz and a few steps (see test_gpu_layerwise).
F64_RTOL = 1e-10


def _ranks(rank, world_size, device, path):
    setup_rank(device)
    out = {}
    model = make_model(device)
    opt = LayerwiseDistributedOptimizer(model, **KW, bucket_mb=0.01)
    train(model, opt, range(SAVE_AT), device, rank)
    ckpt.save_sharded(path, opt, model, extra={"step": SAVE_AT})
    out["saved"] = params(model)
    # the whole model's state, on every rank (copied: torch's format holds live tensors)
    out["full"] = to_cpu(opt.state_dict())
    out["model_sd"] = to_cpu(model.state_dict())
    train(model, opt, range(SAVE_AT, END), device, rank)
    out["continued"] = params(model)

    # Resume from the DCP checkpoint into a differently initialised model and a new optimizer.
    model = make_model(device, seed=1)
    opt = LayerwiseDistributedOptimizer(model, **KW, bucket_mb=0.01)
    out["extra"] = ckpt.load_sharded(path, opt, model)
    out["loaded"] = params(model)
    out["loaded_full"] = to_cpu(opt.state_dict())
    out["state_devices"] = sorted(
        {str(v.device) for st in opt.state.values() for v in st.values() if torch.is_tensor(v)}
    )
    train(model, opt, range(SAVE_AT, END), device, rank)
    out["resumed"] = params(model)
    return to_cpu(out)


@pytest.fixture(scope="module")
def runs(env, tmp_path_factory):
    path = tmp_path_factory.mktemp("gpu_ckpt") / "dcp"
    return spawn(env, _ranks, str(path))


def _state_tensors(sd):
    names = {i: n for g in sd["param_groups"] for i, n in zip(g["params"], g["param_names"])}
    return {f"{names[i]}/{k}": v for i, st in sd["state"].items() for k, v in st.items()}


def test_dcp_round_trip_resumes_bitwise(env, runs):
    for key in ("saved", "continued", "loaded", "resumed"):
        assert_replicas_equal(runs, key)
    for r in runs:
        assert r["extra"] == {"step": SAVE_AT}
        for n, p in r["saved"].items():
            assert torch.equal(r["loaded"][n], p), n
        # the same state, the same owners, the same arithmetic: the same bits
        for n, p in r["continued"].items():
            assert torch.equal(r["resumed"][n], p), n
        want, got = _state_tensors(r["full"]), _state_tensors(r["loaded_full"])
        assert want.keys() == got.keys() and want
        for k, v in want.items():
            assert torch.equal(got[k], v), k
        # the loaded state lives on the suite's device, next to its parameters
        assert r["state_devices"] == [str(torch.device(env.device))]


def test_full_state_dict_resumes_in_a_single_process(env, runs):
    r0 = runs[0]
    device = env.device
    model = make_model(device, seed=1)
    model.load_state_dict({k: v.to(device) for k, v in r0["model_sd"].items()})
    opt = build_optimizer(model, **KW)
    opt.load_state_dict(copy.deepcopy(r0["full"]))  # torch's loader keeps same-device tensors
    train(model, opt, range(SAVE_AT, END), device)
    # a single process on the full batch vs 2 ranks on its halves
    assert_close_rel(params(model), r0["continued"], F64_RTOL, "single-process resume")
    # and the state it resumed from equals a single process's own after SAVE_AT steps
    ref_model = make_model(device)
    ref_opt = build_optimizer(ref_model, **KW)
    train(ref_model, ref_opt, range(SAVE_AT), device)
    want = to_cpu(_state_tensors(ref_opt.state_dict()))
    got = _state_tensors(r0["full"])
    assert want.keys() == got.keys()
    for k in want:
        if torch.is_floating_point(want[k]) and want[k].numel() > 1:
            assert_close_rel({k: got[k]}, {k: want[k]}, F64_RTOL, "state")
        else:  # step counts
            assert torch.equal(got[k], want[k]), k
