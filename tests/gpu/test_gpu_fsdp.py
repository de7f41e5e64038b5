"""FSDPOptimizer over FSDP2 (`fully_shard` per block and the root, on the suite device's
mesh) at 2 ranks sharing one GPU, against single-process Muon on the same device (computed
inside rank 0), in one spawned run."""

from __future__ import annotations

import pytest
import torch

from orthoptim import build_optimizer
from orthoptim.parallel.fsdp import FSDPOptimizer

from ._models import WORLD, assert_close_rel, make_model, params, setup_rank, spawn, to_cpu, train

STEPS = 5
F32 = torch.float32
# FSDPOptimizer sends updates in float32 (or comm_dtype) whatever the parameters' dtype, so
# the comparison runs in float32 with float32 Newton-Schulz (explicit: "auto" would be bf16
# on CUDA).
KW = dict(
    lr=0.02, weight_decay=0.01, adamw_lr=3e-3, adamw_weight_decay=0.01, ns_dtype=F32
)  # fmt: skip
# float32: the averaged half-batch gradients differ from the full-batch one by float32
# rounding of differently ordered sums (~1e-7 relative); Newton-Schulz and 5 steps amplify
# that by ≲ 10² (as tests/test_fsdp.py, whose CPU runs stay within 1e-5). Measured on CPU:
# ≤ 3e-7.
RTOL = 1e-5


def _ranks(rank, world_size, device):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    setup_rank(device)
    out = {}
    if rank == 0:
        model = make_model(device, F32, odd=True)
        train(model, build_optimizer(model, **KW), range(STEPS), device)
        out["ref"] = params(model)
    mesh = init_device_mesh(torch.device(device).type, (world_size,))
    model = make_model(device, F32, odd=True)
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = FSDPOptimizer(model, bucket_mb=0.01, **KW)
    train(model, opt, range(STEPS), device, rank)
    out["params"] = params(model)  # this rank's dim-0 shards
    out["devices"] = sorted({str(p.to_local().device) for p in model.parameters()})
    out["owners"] = dict(opt.owner_of)
    out["stats"], out["expected"] = opt.comm_stats(), opt.expected_comm_bytes()
    return to_cpu(out)


@pytest.fixture(scope="module")
def runs(env):
    return spawn(env, _ranks)


def test_matches_single_process_muon(env, runs):
    names = runs[0]["params"].keys()
    full = {n: torch.cat([r["params"][n] for r in runs]) for n in names}
    ref = runs[0]["ref"]
    assert_close_rel(full, ref, RTOL, "fsdp")
    # the run moved the matrices, and uneven shards (3 rows over 2 ranks) were exercised
    start = params(make_model("cpu", F32, odd=True))
    assert (full["blocks.0.qkv.weight"] - start["blocks.0.qkv.weight"]).norm() > 1e-3
    assert [r["params"]["blocks.0.gate.weight"].shape[0] for r in runs] == [2, 1]
    for r in runs:
        assert r["devices"] == [str(torch.device(env.device))]
        assert r["owners"] == runs[0]["owners"]
    assert set(runs[0]["owners"].values()) == set(range(WORLD))


def test_bytes_equal_the_layout(runs):
    for r in runs:
        for kind, d in r["expected"].items():
            assert r["stats"][kind]["sent"] == pytest.approx(d["sent"]), kind
            assert r["stats"][kind]["received"] == pytest.approx(d["received"]), kind
            assert r["stats"][kind]["calls"] == d["calls"], kind
