"""`DistributedOptimizer.memory()`: the bytes a rank holds by category, against a count of the
real tensors' bytes made without it (the layer-wise optimizer's buckets and slots, the FSDP
driver's shards)."""

import torch
from torch.distributed.tensor import DTensor

from orthoptim.parallel import FSDPOptimizer, LayerwiseDistributedOptimizer
from orthoptim.parallel.base import MEMORY_CATEGORIES

from distributed import run_ranks


def _nbytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def _local(t):
    return t.to_local() if isinstance(t, DTensor) else t


def _state_bytes(opt) -> int:
    return _nbytes(_local(v) for s in opt.state.values() for v in s.values() if torch.is_tensor(v))


def _layerwise(rank, world_size):
    from models.layerwise import CONFIGS, batch, loss_fn, make_model

    torch.set_num_threads(1)
    model = make_model()
    opt = LayerwiseDistributedOptimizer(
        model, **CONFIGS["hybrid"], bucket_mb=0.03, gather_dtype=torch.bfloat16
    )
    x, y = batch(0)
    loss_fn(model, x, y).backward()
    opt.step()
    opt.wait_for_params()
    flats = [b for b in opt.grad_sync.buckets if b.n > 1]
    viewed = all(
        any(p.untyped_storage().data_ptr() == b.params.untyped_storage().data_ptr() for b in flats)
        for p in model.parameters()
    )
    # every parameter and its gradient view the flat buffers: those are the params and grads;
    # each owned slot has an fp32 master (the gather dtype rounds); one bf16 gather buffer
    # per bucket
    count = {
        "params": _nbytes(b.params for b in flats),
        "grads": _nbytes(b.grads for b in flats),
        "masters": sum(4 * s.numel for b in flats for s in b.mine),
        "state": _state_bytes(opt),
        "buffers": sum(2 * b.numel for b in flats),
    }
    return {"memory": opt.memory(), "count": count, "viewed": viewed}


def test_layerwise_memory_is_the_buffers_masters_and_state():
    for r in run_ranks(_layerwise, 2):
        assert r["viewed"]
        assert set(r["memory"]) == set(MEMORY_CATEGORIES)
        assert r["count"]["masters"] > 0 and r["count"]["buffers"] > 0
        assert r["memory"] == r["count"]


def test_fsdp_memory_is_the_shards_and_state():
    from models.fsdp import KW, batch, loss_fn, make_model

    model = make_model()
    opt = FSDPOptimizer(model, **KW)
    x, y = batch(0)
    loss_fn(model, x, y).backward()
    opt.step()
    params = list(model.parameters())
    count = {
        "params": _nbytes(_local(p) for p in params),
        "grads": _nbytes(_local(p.grad) for p in params if p.grad is not None),
        "masters": 0,
        "state": _state_bytes(opt),
        "buffers": 0,
    }
    assert count["grads"] > 0 and count["state"] > 0
    assert opt.memory() == count
