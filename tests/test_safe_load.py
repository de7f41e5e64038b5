"""Checkpoint loading never runs code a file pickled: every file and DCP checkpoint is read as
`torch.load(weights_only=True)` reads it, and one that needs more is refused with a
`CheckpointLoadError` naming what it wanted.

The oracle for refusals is the payload itself: loaded the unsafe way it creates a directory,
so its absence shows nothing ran. The oracle for round trips is the object that was saved.
"""

import os
import pickle

import pytest
import torch
from torch import nn

from models.checkpoint import HYBRID_KW, KW, make_model, same, train
from models.fsdp import KW as FSDP_KW
from models.fsdp import sharded_model
from models.fsdp import train as train_fsdp
from orthoptim import SOAP, Muon, build_optimizer
from orthoptim import checkpoint as ckpt
from orthoptim.parallel import LayerwiseDistributedOptimizer
from orthoptim.parallel.fsdp import FSDPOptimizer

from distributed import run_ranks

PAYLOAD = f"{os.mkdir.__module__}.{os.mkdir.__name__}"  # the global the payload names


class Payload:
    """Unpickling it creates the directory `marker`."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return os.mkdir, (self.marker,)


def test_same_tells_apart():
    assert same({"a": (1, torch.ones(2))}, {"a": (1, torch.ones(2))})
    assert not same({"a": (1, torch.ones(2))}, {"a": [1, torch.ones(2)]})
    assert not same(torch.ones(2), torch.ones(2, dtype=torch.float64))
    assert not same({"a": 1}, {"a": 1, "b": 2})


# ---- refusals ---------------------------------------------------------------------------------


def test_file_with_code_is_refused_and_nothing_runs(tmp_path):
    marker = tmp_path / "ran"
    path = tmp_path / "optim.pt"
    sd = Muon([nn.Parameter(torch.randn(4, 6))]).state_dict()
    sd["state"][0] = {"momentum_buffer": Payload(marker)}
    torch.save(sd, path)
    for load in (ckpt.load_file, ckpt.atomic_load):
        with pytest.raises(ckpt.CheckpointLoadError) as info:
            load(path)
        msg = str(info.value)
        assert str(path) in msg and PAYLOAD in msg, msg
        assert "torch.load(weights_only=False)" in msg and "execute code" in msg, msg
        assert not marker.exists()
    # the oracle: loaded the unsafe way, the payload runs
    torch.load(path, weights_only=False)
    assert marker.is_dir()
    # not a torch.save file at all: refused too, with torch's reason
    path.write_bytes(b"not a checkpoint")
    with pytest.raises(ckpt.CheckpointLoadError, match=r"cannot read it \(.+\): it is damaged"):
        ckpt.load_file(path)


def _layerwise():
    model = make_model()
    opt = LayerwiseDistributedOptimizer(model, **KW)
    train(model, opt, range(2))
    return model, opt


def _refused_at_load(tmp_path, path, marker):
    """load_sharded of `path` is refused naming the payload; model and optimizer unchanged."""
    model, opt = _layerwise()
    before = (ckpt.full_state_dict(opt), {k: v.clone() for k, v in model.state_dict().items()})
    with pytest.raises(ckpt.CheckpointLoadError) as info:
        ckpt.load_sharded(path, opt, model)
    assert PAYLOAD in str(info.value) and "weights_only=False" in str(info.value), info.value
    assert not marker.exists()
    assert same(before, (ckpt.full_state_dict(opt), model.state_dict()))


def test_sharded_checkpoint_with_code_is_refused_at_every_layer(tmp_path):
    """A DCP checkpoint carries pickles at three layers: `.metadata` (DCP reads it with
    pickle.load), non-tensor items (DCP reads them with torch.load(weights_only=False)), and
    the values packed in them (`optim/meta`, `extra/...`). None may run code."""
    model, opt = _layerwise()
    marker = tmp_path / "ran"

    # a packed extra value
    path = tmp_path / "packed"
    ckpt.save_sharded(path, opt, model, extra={"step": 2, "evil": Payload(marker)})
    _refused_at_load(tmp_path, path, marker)

    # a DCP item (what DCP itself pickles)
    path = tmp_path / "item"
    sd = {**ckpt.sharded_state_dict(opt), "extra/evil": Payload(marker)}
    sd.update({f"model/{k}": v for k, v in model.state_dict().items()})
    with ckpt._quiet():
        ckpt._dcp().save(sd, checkpoint_id=path)
    _refused_at_load(tmp_path, path, marker)

    # DCP's metadata file
    path = tmp_path / "metadata"
    ckpt.save_sharded(path, opt, model)
    (path / ".metadata").write_bytes(pickle.dumps(Payload(marker)))
    _refused_at_load(tmp_path, path, marker)
    with pytest.raises(ckpt.CheckpointLoadError, match=PAYLOAD):
        ckpt.dcp_load({}, path)
    assert not marker.exists()

    # the oracle: DCP's own reader runs it
    with open(path / ".metadata", "rb") as f:
        pickle.load(f)
    assert marker.is_dir()


# ---- round trips of every state we write ---------------------------------------------------------


def _round_trip(tmp_path, sd):
    path = tmp_path / "sd.pt"
    ckpt.atomic_save(sd, path)
    loaded = ckpt.load_file(path)
    assert same(loaded, sd)
    return loaded


def test_single_process_state_dicts_round_trip(tmp_path):
    """Muon (a dtype, split sizes and a coefficient list among its hyper-parameters), SOAP,
    and build_optimizer's Muon/AdamW and SOAP/AdamW hybrids load and reload unchanged."""
    W = nn.Parameter(torch.randn(12, 10))

    def muon(p):
        return Muon(
            [{"params": [p], "param_names": ["qkv"]}],
            split={"qkv": (4, 4, 4)},
            coefficients=[[3.4445, -4.775, 2.0315]],
            ns_dtype=torch.bfloat16,
        )

    def soap(p):
        return SOAP([p], betas=(0.9, 0.99), precondition_frequency=1)

    for make in (muon, soap):
        opt = make(W)
        for _ in range(2):
            W.grad = torch.randn_like(W)
            opt.step()
        loaded = _round_trip(tmp_path, opt.state_dict())
        fresh = make(nn.Parameter(W.detach().clone()))
        fresh.load_state_dict(loaded)
        assert same(fresh.state_dict(), opt.state_dict())
    for kind in ("muon", "soap"):
        model = make_model()
        opt = build_optimizer(model, **{**HYBRID_KW, "optimizer": kind})
        train(model, opt, range(2))
        assert opt.state_dict()["state"]
        _round_trip(tmp_path, opt.state_dict())


def test_sharded_checkpoint_metadata_round_trips(tmp_path):
    model, opt = _layerwise()
    extra = {"step": 2, "lr": (0.1, 0.2), "dtype": torch.bfloat16, "note": None}
    ckpt.save_sharded(tmp_path / "dcp", opt, model, extra=extra)
    model2 = make_model(seed=1)
    opt2 = LayerwiseDistributedOptimizer(model2, **KW)
    assert same(ckpt.load_sharded(tmp_path / "dcp", opt2, model2), extra)
    assert same(ckpt.full_state_dict(opt2), ckpt.full_state_dict(opt))
    assert same(model2.state_dict(), model.state_dict())


def _two_ranks(rank, world_size, folder):
    """Layer-wise (full dict to rank 0, with fp32 master copies; DCP) and FSDP (full dict to
    rank 0; the DCP layout a sharded run saves) at 2 ranks."""
    out = {}
    model = make_model()
    opt = LayerwiseDistributedOptimizer(
        model, **KW, gather_dtype=torch.float32, state_dict_to="rank0"
    )
    train(model, opt, range(2), rank, world_size)
    sd = opt.state_dict()
    if rank == 0:
        assert sd["orthoptim"]["master"]
        ckpt.atomic_save(sd, os.path.join(folder, "layerwise.pt"))
        out["layerwise"] = sd
    path = os.path.join(folder, "layerwise_dcp")
    ckpt.save_sharded(path, opt, model, extra={"step": 2})
    model2 = make_model(seed=1)
    opt2 = LayerwiseDistributedOptimizer(model2, **KW, gather_dtype=torch.float32)
    out["extra"] = ckpt.load_sharded(path, opt2, model2)
    opt2.state_dict_to = "rank0"
    out["layerwise_dcp"] = opt2.state_dict()

    model = sharded_model(world_size)
    opt = FSDPOptimizer(model, bucket_mb=0.01, state_dict_to="rank0", **FSDP_KW)
    train_fsdp(model, opt, rank, world_size, range(2))
    sd = opt.state_dict()
    if rank == 0:
        ckpt.atomic_save(sd, os.path.join(folder, "fsdp.pt"))
        out["fsdp"] = sd
    path = os.path.join(folder, "fsdp_dcp")
    ckpt.save_sharded(path, opt, model)
    model2 = sharded_model(world_size)
    opt2 = FSDPOptimizer(model2, bucket_mb=0.01, state_dict_to="rank0", **FSDP_KW)
    ckpt.load_sharded(path, opt2, model2)
    out["fsdp_dcp"] = opt2.state_dict()
    return out


def test_distributed_state_dicts_round_trip(tmp_path):
    r = run_ranks(_two_ranks, 2, args=(str(tmp_path),))
    for name in ("layerwise", "fsdp"):
        assert r[0][name]["state"], name
        assert same(ckpt.load_file(tmp_path / f"{name}.pt"), r[0][name]), name
    # the DCP checkpoint resumed at 2 ranks holds what was saved
    assert r[0]["extra"] == r[1]["extra"] == {"step": 2}
    assert same(r[0]["layerwise_dcp"], r[0]["layerwise"])
    assert same(r[0]["fsdp_dcp"], r[0]["fsdp"])
