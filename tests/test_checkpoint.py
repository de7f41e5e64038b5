"""Checkpoints: full and DCP-sharded optimizer state that reshards across data-parallel sizes,
atomic saves, and mismatch errors that list everything and load nothing.

The oracle for every resumed run is an uninterrupted run of the same optimizer on the same
batches: bitwise at the same world size; at another one the gradients are summed in another
order, so the models are float64 and the runs agree within RESHARD_TOL relative.
"""

import os
import subprocess
import sys

import pytest
import torch
from torch import nn

from models.checkpoint import (
    BATCH,
    HYBRID_KW,
    KW,
    WIDTH,
    Net,
    every_matrix,
    make_model,
    train,
)
from orthoptim import Muon, build_optimizer
from orthoptim import checkpoint as ckpt
from orthoptim.parallel import LayerwiseDistributedOptimizer

from distributed import run_ranks

BEFORE, AFTER = 3, 10  # steps before the checkpoint, steps resumed after it
# float64 rounding (~1e-16) of a differently ordered gradient sum, grown over AFTER steps of
# Muon and AdamW, stays many orders below this; a wrong state is off by far more than 1e-6.
RESHARD_TOL = 1e-10


def rel_err(got, want):
    return max(((got[n] - w).norm() / w.norm()).item() for n, w in want.items())


def _save_and_resume(rank, world_size, path):
    """World size 2: save after BEFORE steps (DCP + full dicts), resume in fresh objects."""
    out = {}
    model = make_model()
    opt = LayerwiseDistributedOptimizer(model, **KW)
    train(model, opt, range(BEFORE), rank, world_size)
    ckpt.save_sharded(path, opt, model, extra={"step": BEFORE})
    out["full"] = opt.state_dict()  # state_dict_to="all": the full dict on every rank
    opt.state_dict_to = "rank0"
    out["full_rank0"] = opt.state_dict()
    opt.state_dict_to = "all"
    out["owned"] = {  # key → the chunks (offsets) of a sharded AdamW run; None: whole tensor
        k: [tuple(c.offsets) for c in v.__create_chunk_list__()]
        if isinstance(v, ckpt.FlatShard) else None
        for k, v in ckpt.sharded_state_dict(opt).items()
    }  # fmt: skip
    out["model"] = {k: v.clone() for k, v in model.state_dict().items()}
    out["uninterrupted"] = train(model, opt, range(BEFORE, BEFORE + AFTER), rank, world_size)

    model2 = make_model(seed=1)
    opt2 = LayerwiseDistributedOptimizer(model2, **KW)
    out["extra"] = ckpt.load_sharded(path, opt2, model2)
    out["resumed_dcp"] = train(model2, opt2, range(BEFORE, BEFORE + AFTER), rank, world_size)

    model3 = make_model(seed=1)
    model3.load_state_dict(out["model"])
    opt3 = LayerwiseDistributedOptimizer(model3, **KW)
    opt3.load_state_dict(out["full"])
    out["resumed_full"] = train(model3, opt3, range(BEFORE, BEFORE + AFTER), rank, world_size)
    out["muon_only"] = _muon_only(rank, world_size)
    return out


class Matrices(nn.Module):
    """Only matrices, every one routed to Muon (`every_matrix`: no AdamW group, although
    the default routing takes the last Linear of a model without embeddings for its head)."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(WIDTH, 2 * WIDTH, bias=False)
        self.b = nn.Linear(2 * WIDTH, WIDTH, bias=False)

    def forward(self, x):
        return self.b(torch.tanh(self.a(x)))


MUON_KW = dict(lr=0.02, weight_decay=0.01, momentum=0.9)


def square_loss(model, step, rank, world_size):
    g = torch.Generator().manual_seed(step)
    x = torch.randn(BATCH, WIDTH, generator=g, dtype=torch.float64)
    per = BATCH // world_size
    return model(x[rank * per : (rank + 1) * per]).square().mean()


def train_matrices(model, opt, steps, rank=0, world_size=1):
    return train(model, opt, steps, rank, world_size, loss=square_loss)


def _muon_only(rank, world_size):
    """A Muon-only model at 2 ranks: its full dict, the model then, and the run continued."""
    torch.manual_seed(0)
    model = Matrices().double()
    opt = LayerwiseDistributedOptimizer(model, bucket_mb=0.0005, route=every_matrix, **MUON_KW)
    train_matrices(model, opt, range(BEFORE), rank, world_size)
    full = opt.state_dict()
    snapshot = {k: v.clone() for k, v in model.state_dict().items()}
    after = train_matrices(model, opt, range(BEFORE, BEFORE + AFTER), rank, world_size)
    return {"full": full, "model": snapshot, "uninterrupted": after}


def _resume_at(rank, world_size, path, full=None, model_sd=None):
    """Resume at `world_size` from the DCP checkpoint, and from the full dict if given."""
    model = make_model(seed=1)
    opt = LayerwiseDistributedOptimizer(model, **KW)
    extra = ckpt.load_sharded(path, opt, model)
    assert extra == {"step": BEFORE}
    got = train(model, opt, range(BEFORE, BEFORE + AFTER), rank, world_size)
    if full is None:
        return got
    model = make_model(seed=1)
    model.load_state_dict(model_sd)
    opt = LayerwiseDistributedOptimizer(model, **KW)
    opt.load_state_dict(full)  # every rank keeps what it owns here
    return got, train(model, opt, range(BEFORE, BEFORE + AFTER), rank, world_size)


def test_reshard_and_resume(tmp_path):
    path = str(tmp_path / "ckpt")
    r = run_ranks(_save_and_resume, 2, args=(path,))
    want = r[0]["uninterrupted"]
    for rank in range(2):
        for key in ("resumed_dcp", "resumed_full"):
            for n, p in r[rank][key].items():
                assert torch.equal(p, r[rank]["uninterrupted"][n]), (rank, key, n)
        assert r[rank]["extra"] == {"step": BEFORE}
    # each rank wrote only the state of what it owns: a matrix's on its owner, its own chunks
    # of a sharded AdamW parameter's (the same key on both: one tensor); keys name
    # parameters, not ranks
    owned = [r[rank]["owned"] for rank in range(2)]
    keys = [set(k for k in o if k.startswith("optim/state/")) for o in owned]
    assert keys[0] and keys[1]
    assert "optim/state/emb.weight/exp_avg" in keys[0] & keys[1]  # split over both ranks
    for k in keys[0] & keys[1]:
        if not k.endswith("/step"):  # AdamW's step: one scalar, written once (DCP dedups)
            assert None not in (owned[0][k], owned[1][k]), k
            assert not set(owned[0][k]) & set(owned[1][k]), k
    assert not any("rank" in k for k in keys[0] | keys[1])
    # full dicts: the same on every rank; to_rank0 only on rank 0
    assert r[1]["full_rank0"] == {}
    full = r[0]["full"]
    assert set(full["state"]) == set(r[0]["full_rank0"]["state"])

    # world size 1 from the DCP checkpoint (no process group), and 4 ranks from the DCP
    # checkpoint and from the 2-rank full dict
    got1 = _resume_at(0, 1, path)
    assert rel_err(got1, want) <= RESHARD_TOL, rel_err(got1, want)
    for dcp_res, full_res in run_ranks(_resume_at, 4, args=(path, full, r[0]["model"])):
        assert rel_err(dcp_res, want) <= RESHARD_TOL, rel_err(dcp_res, want)
        assert rel_err(full_res, want) <= RESHARD_TOL, rel_err(full_res, want)
        for n, p in full_res.items():
            assert torch.equal(p, dcp_res[n]), n  # the same state, whichever way it came

    # a Muon-only model's full dict loads into a plain single-process Muon
    mo = r[0]["muon_only"]
    torch.manual_seed(0)
    model = Matrices().double()
    model.load_state_dict(mo["model"])
    muon = Muon(list(model.named_parameters()), **MUON_KW)
    muon.load_state_dict(mo["full"])
    got = train_matrices(model, muon, range(BEFORE, BEFORE + AFTER))
    assert rel_err(got, mo["uninterrupted"]) <= RESHARD_TOL, rel_err(got, mo["uninterrupted"])
    with pytest.raises(AssertionError):  # the state matters: a fresh Muon ends elsewhere
        model.load_state_dict(mo["model"])
        fresh = train_matrices(model, Muon(list(model.named_parameters()), **MUON_KW),
                               range(BEFORE, BEFORE + AFTER))  # fmt: skip
        assert rel_err(fresh, mo["uninterrupted"]) <= RESHARD_TOL

    # the single-process optimizer takes the full dict as is (torch's own load_state_dict)
    model = make_model(seed=1)
    model.load_state_dict(r[0]["model"])
    single = build_optimizer(model, **HYBRID_KW)
    single.load_state_dict(full)
    got = train(model, single, range(BEFORE, BEFORE + AFTER))
    assert rel_err(got, want) <= RESHARD_TOL, rel_err(got, want)
    # and the single-process optimizer's own dict loads into the layer-wise one
    model = make_model()
    opt = build_optimizer(model, **HYBRID_KW)
    train(model, opt, range(BEFORE))
    lw = LayerwiseDistributedOptimizer(model, **KW)
    lw.load_state_dict(opt.state_dict())
    got = train(model, lw, range(BEFORE, BEFORE + AFTER))
    assert rel_err(got, want) <= RESHARD_TOL, rel_err(got, want)


# ---- mismatches --------------------------------------------------------------------------------


class Other(Net):
    """Net with a renamed matrix, a resized one and an extra one."""

    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(WIDTH, 3 * WIDTH)
        self.fc2 = nn.Linear(3 * WIDTH, WIDTH, bias=False)
        self.extra = nn.Linear(WIDTH, WIDTH, bias=False)


def _snapshot(model, opt):
    return (
        {n: p.detach().clone() for n, p in model.named_parameters()},
        {k: v for k, v in ckpt.full_state_dict(opt).items() if k != "orthoptim"},
    )


def _same(a, b):
    if isinstance(a, torch.Tensor):
        return torch.equal(a, b)
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return a == b


def test_mismatched_checkpoint_lists_every_mismatch_and_loads_nothing(tmp_path):
    model = make_model()
    opt = LayerwiseDistributedOptimizer(model, **KW)
    train(model, opt, range(2))
    ckpt.save_sharded(tmp_path / "a", opt, model)
    full = opt.full_state_dict()

    other = Other()
    other_opt = LayerwiseDistributedOptimizer(other, **{**KW, "ns_steps": 3})
    train(other, other_opt, range(1))
    before = _snapshot(other, other_opt)
    for load in (
        lambda: ckpt.load_sharded(tmp_path / "a", other_opt, other),
        lambda: other_opt.load_state_dict(full),
    ):
        with pytest.raises(ckpt.CheckpointMismatchError) as info:
            load()
        msg = str(info.value)
        for needle in (
            "parameter extra.weight: in this model, missing from the checkpoint",
            "parameter fc1.weight: shape (16, 8) in the checkpoint, (24, 8) here",
            "parameter fc2.weight: shape (8, 16) in the checkpoint, (8, 24) here",
            "parameter fc1.bias: shape (16,) in the checkpoint, (24,) here",
            "ns_steps = 5 in the checkpoint, 3 here",
        ):
            assert needle in msg, msg
        assert _same(_snapshot(other, other_opt), before)  # nothing half-loaded
    with pytest.raises(ckpt.CheckpointMismatchError, match="model entry extra.weight"):
        ckpt.load_sharded(tmp_path / "a", other_opt, other)

    # another optimizer type for the same model
    adamw = LayerwiseDistributedOptimizer(make_model(), optimizer="adamw", lr=1e-3)
    with pytest.raises(ckpt.CheckpointMismatchError) as info:
        adamw.load_state_dict(full)
    assert "optimizers ['muon', 'adamw'] in the checkpoint, ['adamw'] here" in str(info.value)

    # hyper-parameters a scheduler changes come from the checkpoint, as in torch, whether or
    # not a scheduler was attached on either side
    same = LayerwiseDistributedOptimizer(make_model(), **{**KW, "lr": 0.5})
    torch.optim.lr_scheduler.StepLR(same, step_size=1)
    same.load_state_dict(full)
    assert same.param_groups[0]["lr"] == 0.02


# ---- atomic saves ----------------------------------------------------------------------------


def test_atomic_save_interrupted_keeps_previous(tmp_path, monkeypatch):
    path = tmp_path / "x.pt"
    ckpt.atomic_save({"v": torch.ones(3)}, path)

    def boom(tmp):
        assert os.path.exists(tmp)
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        ckpt.atomic_save({"v": torch.zeros(3)}, path, _before_rename=boom)
    assert torch.equal(ckpt.atomic_load(path)["v"], torch.ones(3))
    assert os.listdir(tmp_path) == ["x.pt"]

    # DCP: interrupted after writing, and between the two renames
    model = make_model()
    opt = LayerwiseDistributedOptimizer(model, **KW)
    train(model, opt, range(1))
    d = tmp_path / "c"
    ckpt.save_sharded(d, opt, model)
    want = ckpt.full_state_dict(opt)
    train(model, opt, range(1, 2))
    with pytest.raises(KeyboardInterrupt):
        ckpt.save_sharded(d, opt, model, _before_rename=boom)
    real_replace = os.replace
    calls = []

    def replace_once(a, b):
        calls.append(a)
        if len(calls) == 2:
            raise KeyboardInterrupt
        real_replace(a, b)

    monkeypatch.setattr(ckpt.os, "replace", replace_once)
    with pytest.raises(KeyboardInterrupt):
        ckpt.save_sharded(d, opt, model)
    monkeypatch.undo()
    assert not d.exists() and (tmp_path / "c.old").exists()
    fresh = LayerwiseDistributedOptimizer(make_model(seed=1), **KW)
    ckpt.load_sharded(d, fresh)
    assert _same(ckpt.full_state_dict(fresh)["state"], want["state"])
    # the next save completes the directory swap
    ckpt.save_sharded(d, opt, model)
    assert d.exists() and not (tmp_path / "c.old").exists()


KILLED_SAVE = """
import os, signal, sys, torch
sys.path.insert(0, {tests!r})
from models.checkpoint import make_model, train, KW
from orthoptim import checkpoint as ckpt
from orthoptim.parallel import LayerwiseDistributedOptimizer
model = make_model()
opt = LayerwiseDistributedOptimizer(model, **KW)
train(model, opt, range(2))
ckpt.save_sharded({path!r}, opt, model)
train(model, opt, range(2, 3))
ckpt.save_sharded({path!r}, opt, model,
                  _before_rename=lambda tmp: os.kill(os.getpid(), signal.SIGKILL))
"""


def test_save_killed_between_write_and_rename(tmp_path):
    path = str(tmp_path / "c")
    code = KILLED_SAVE.format(tests=os.path.dirname(__file__), path=path)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, timeout=300)
    assert proc.returncode == -9, proc.stderr.decode()[-2000:]
    assert os.path.exists(path + ".partial")  # the killed save's files
    model = make_model(seed=1)
    opt = LayerwiseDistributedOptimizer(model, **KW)
    ckpt.load_sharded(path, opt, model)
    ref_model = make_model()
    ref = LayerwiseDistributedOptimizer(ref_model, **KW)
    train(ref_model, ref, range(2))
    assert _same(ckpt.full_state_dict(opt)["state"], ckpt.full_state_dict(ref)["state"])
    for n, p in model.named_parameters():
        assert torch.equal(p, dict(ref_model.named_parameters())[n]), n


# ---- ns_dtype: the Newton-Schulz precision --------------------------------------------------


def test_ns_dtype_may_differ_and_state_dicts_load_weights_only(tmp_path):
    """ns_dtype ("auto" by default) is saved with the hyper-parameters and survives
    torch.load(weights_only=True); it does not change what the state means, so a checkpoint
    written with another one (e.g. None, the default before "auto") loads, and the optimizer
    keeps its own."""
    model = make_model()
    opt = LayerwiseDistributedOptimizer(model, **KW)
    assert opt.param_groups[0]["ns_dtype"] == "auto"
    train(model, opt, range(2))
    full = opt.full_state_dict()
    torch.save(full, tmp_path / "full.pt")
    loaded = torch.load(tmp_path / "full.pt", weights_only=True)
    assert loaded["param_groups"][0]["ns_dtype"] == "auto"

    for saved_as, here in ((None, "auto"), ("auto", torch.float32), (torch.bfloat16, "auto")):
        sd = torch.load(tmp_path / "full.pt", weights_only=True)
        sd["param_groups"][0]["ns_dtype"] = saved_as
        sd["orthoptim"]["meta"]["groups"][0]["hypers"]["ns_dtype"] = saved_as
        torch.save(sd, tmp_path / "other.pt")
        other = LayerwiseDistributedOptimizer(make_model(), **{**KW, "ns_dtype": here})
        other.load_state_dict(torch.load(tmp_path / "other.pt", weights_only=True))
        assert other.param_groups[0]["ns_dtype"] == here
    # any other hyper-parameter still has to match
    other = LayerwiseDistributedOptimizer(make_model(), **{**KW, "ns_steps": 4})
    with pytest.raises(ckpt.CheckpointMismatchError, match="ns_steps = 5 in the checkpoint"):
        other.load_state_dict(loaded)

    # a single-process Muon's torch-format state dict, with ns_dtype a string or a dtype
    for ns_dtype in ("auto", torch.bfloat16):
        W = nn.Parameter(torch.randn(6, 10))
        muon = Muon([W], ns_dtype=ns_dtype)
        W.grad = torch.randn(6, 10)
        muon.step()
        torch.save(muon.state_dict(), tmp_path / "muon.pt")
        again = Muon([nn.Parameter(W.detach().clone())], ns_dtype=ns_dtype)
        again.load_state_dict(torch.load(tmp_path / "muon.pt", weights_only=True))
        assert again.param_groups[0]["ns_dtype"] == ns_dtype
        assert again.state_dict()["state"][0]["momentum_buffer"].dtype == torch.float32
