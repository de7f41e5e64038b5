"""Every matrix optimizer through the one contract (`orthoptim.optim.contract`), with no
special case anywhere: layer-wise at 2 and 4 ranks and FSDP2 at 2 ranks equal the
single-process optimizer; full and sharded (DCP) checkpoints written at 2 ranks load at 1
(single process) and at 4 ranks (layer-wise and FSDP), and the run continues as the
uninterrupted single-process run does.

float64 end to end (states, Newton-Schulz, wire), one thread per process as on the ranks
(LAPACK's eigh picks another basis of a degenerate eigenspace, e.g. the null space of a
rank-deficient Kronecker factor, at another thread count, and SOAP follows the basis it
gets), and every rank trains on the whole batch,
so the averaged gradient is the single-process gradient up to the reduction's rounding of
equal addends (exact at 2 ranks, within 1 ulp at 4). The remaining differences are the order
of float64 operations in batched against one-by-one Newton-Schulz and SOAP's eigh/QR: ~1e-16
relative per product, amplified by five quintic steps (gain < 500) and a few steps of
training, so 1e-12 relative to each parameter's scale bounds them with margin; a wrong
owner, a lost state entry or a missed step differs at 1e-3 or more. SOAP gets 1e-10: it
divides by √V + 1e-8 in an eigenbasis of rank-deficient factors, where a 1-ulp difference of
the 4-rank averaged gradient moves an entry of V ≈ 0 by far more than its relative size
(measured: 1.4e-12 after 5 steps).
"""

from __future__ import annotations

import os

import pytest
import torch

from models.fsdp import batch, loss_fn, make_model, sharded_model
from orthoptim import LayerwiseDistributedOptimizer, build_optimizer
from orthoptim import checkpoint as ckpt
from orthoptim.optim.registry import OPTIMIZER_NAMES
from orthoptim.parallel.fsdp import FSDPOptimizer

from distributed import run_ranks

STEPS, EXTRA, TOL = 3, 2, 1e-12
F64 = torch.float64
# each optimizer's own learning rate scale; SOAP refreshing its bases every other step
KW = {
    "muon": dict(lr=0.02),
    "soap": dict(lr=3e-3, precondition_frequency=2),
    "normuon": dict(lr=0.02),
    "adamuon": dict(lr=0.02),
    "polargrad": dict(lr=0.002),
    "scion": dict(lr=0.01),
    "adamw": dict(lr=3e-3),
}
COMMON = dict(adamw_lr=3e-3, adamw_weight_decay=0.01)
# Lion, the elementwise option for the non-matrix part, next to Muon
LION = dict(optimizer="muon", lr=0.02, elementwise="lion", adamw_lr=3e-4, adamw_weight_decay=0.1)
NAMES = (*OPTIMIZER_NAMES, "muon+lion")


def kwargs(name):
    return LION if name == "muon+lion" else dict(optimizer=name, **KW[name], **COMMON)


def steps(model, opt, which):
    for step in which:
        loss_fn(model, *batch(step)).backward()
        opt.step()
        opt.zero_grad()


def params(model):
    """Every parameter, whole (a DTensor's full tensor), on the CPU."""
    out = {}
    for n, p in model.named_parameters():
        p = p.full_tensor() if hasattr(p, "full_tensor") else p
        out[n] = p.detach().clone().cpu()
    return out


def layerwise(name, which=range(STEPS)):
    """A fresh float64 model and its layer-wise optimizer, after the steps `which`."""
    model = make_model(F64)
    opt = LayerwiseDistributedOptimizer(model, bucket_mb=0.002, **kwargs(name))
    steps(model, opt, which)
    opt.wait_for_params()
    return model, opt


def _two_ranks(rank, world_size, folder):
    out = {}
    for name in NAMES:
        model, opt = layerwise(name)
        out[(name, "layerwise")] = params(model)
        full = opt.state_dict()
        if rank == 0:
            ckpt.atomic_save({"model": model.state_dict(), "optim": full},
                             os.path.join(folder, f"{name}.pt"))  # fmt: skip
        ckpt.save_sharded(os.path.join(folder, f"{name}_layerwise"), opt, model)

        model = sharded_model(world_size, F64)
        opt = FSDPOptimizer(model, bucket_mb=0.002, **kwargs(name))
        steps(model, opt, range(STEPS))
        out[(name, "fsdp")] = params(model)
        fsdp_full = opt.state_dict()
        out[(name, "fsdp_full_matches")] = _same_state(fsdp_full, full)
        ckpt.save_sharded(os.path.join(folder, f"{name}_fsdp"), opt, model)
    return out


def _same_state(a, b):
    """Whether two full state dicts hold the same names and state (to TOL)."""
    names = [[g["param_names"] for g in sd["param_groups"]] for sd in (a, b)]
    if names[0] != names[1]:
        return "param names differ"
    for i, st in b["state"].items():
        if a["state"].get(i, {}).keys() != st.keys():
            return f"state keys of {i} differ"
        for k, v in st.items():
            x, y = torch.as_tensor(a["state"][i][k]), torch.as_tensor(v)
            if x.shape != y.shape or (x - y).abs().max() > TOL * max(1.0, y.abs().max()):
                return f"state {i}/{k} differs"
    return "same"


def _four_ranks(rank, world_size, folder):
    out = {}
    for name in NAMES:
        model, _ = layerwise(name)
        out[(name, "layerwise")] = params(model)

        # the 2-rank full dict, each rank keeping what it owns at 4
        model = make_model(F64)
        saved = ckpt.load_file(os.path.join(folder, f"{name}.pt"))
        model.load_state_dict(saved["model"])
        opt = LayerwiseDistributedOptimizer(model, bucket_mb=0.002, **kwargs(name))
        opt.load_state_dict(saved["optim"])
        steps(model, opt, range(STEPS, STEPS + EXTRA))
        opt.wait_for_params()
        out[(name, "full")] = params(model)

        # the 2-rank layer-wise DCP checkpoint, resharded
        model = make_model(F64)
        opt = LayerwiseDistributedOptimizer(model, bucket_mb=0.002, **kwargs(name))
        ckpt.load_sharded(os.path.join(folder, f"{name}_layerwise"), opt, model)
        steps(model, opt, range(STEPS, STEPS + EXTRA))
        opt.wait_for_params()
        out[(name, "dcp")] = params(model)

        # the 2-rank FSDP DCP checkpoint into FSDP at 4 ranks
        model = sharded_model(world_size, F64)
        opt = FSDPOptimizer(model, bucket_mb=0.002, **kwargs(name))
        ckpt.load_sharded(os.path.join(folder, f"{name}_fsdp"), opt, model)
        steps(model, opt, range(STEPS, STEPS + EXTRA))
        out[(name, "fsdp")] = params(model)
    return out


@pytest.fixture(autouse=True)
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    folder = str(tmp_path_factory.mktemp("contract"))
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    ref = {}
    for name in NAMES:
        model = make_model(F64)
        opt = build_optimizer(model, **kwargs(name))
        steps(model, opt, range(STEPS))
        ref[(name, STEPS)] = params(model)
        steps(model, opt, range(STEPS, STEPS + EXTRA))
        ref[(name, STEPS + EXTRA)] = params(model)
    two = run_ranks(_two_ranks, 2, args=(folder,))
    four = run_ranks(_four_ranks, 4, args=(folder,))
    torch.set_num_threads(threads)
    return {"ref": ref, "two": two, "four": four, "folder": folder}


def assert_close(got, want, what):
    tol = 1e-10 if what.startswith("soap") else TOL
    assert got.keys() == want.keys(), what
    for n, w in want.items():
        err = (got[n] - w).abs().max().item()
        assert err <= tol * max(1.0, w.abs().max().item()), f"{what}: {n} off by {err:.3e}"


@pytest.mark.parametrize("name", NAMES)
def test_distributed_paths_equal_single_process(runs, name):
    want = runs["ref"][(name, STEPS)]
    moved = runs["ref"][(name, STEPS)]["blocks.0.fc.weight"] - make_model(F64).blocks[0].fc.weight
    assert moved.abs().max() > 1e-4  # the optimizer moved the weights
    for rank, r in enumerate(runs["two"]):
        assert_close(r[(name, "layerwise")], want, f"{name} layer-wise, rank {rank} of 2")
        assert_close(r[(name, "fsdp")], want, f"{name} FSDP, rank {rank} of 2")
        assert r[(name, "fsdp_full_matches")] == "same", name
    for rank, r in enumerate(runs["four"]):
        assert_close(r[(name, "layerwise")], want, f"{name} layer-wise, rank {rank} of 4")


@pytest.mark.parametrize("name", NAMES)
def test_checkpoints_reshard_2_to_4(runs, name):
    want = runs["ref"][(name, STEPS + EXTRA)]
    for rank, r in enumerate(runs["four"]):
        for path in ("full", "dcp", "fsdp"):
            assert_close(r[(name, path)], want, f"{name} 2 → 4 via {path}, rank {rank}")


@pytest.mark.parametrize("name", NAMES)
def test_checkpoints_reshard_2_to_1(runs, name):
    """The 2-rank full dict and both DCP checkpoints load into the single-process optimizer."""
    folder, want = runs["folder"], runs["ref"][(name, STEPS + EXTRA)]
    saved = ckpt.load_file(os.path.join(folder, f"{name}.pt"))
    for source in ("full", "layerwise", "fsdp"):
        model = make_model(F64)
        opt = build_optimizer(model, **kwargs(name))
        if source == "full":
            model.load_state_dict(saved["model"])
            opt.load_state_dict(saved["optim"])
        else:
            ckpt.load_sharded(os.path.join(folder, f"{name}_{source}"), opt, model)
        steps(model, opt, range(STEPS, STEPS + EXTRA))
        assert_close(params(model), want, f"{name} 2 → 1 via {source}")
    # without the state the run ends elsewhere: the checkpoint carried it
    model = make_model(F64)
    model.load_state_dict(saved["model"])
    opt = build_optimizer(model, **kwargs(name))
    steps(model, opt, range(STEPS, STEPS + EXTRA))
    with pytest.raises(AssertionError):
        assert_close(params(model), want, name)
