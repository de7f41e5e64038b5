"""`clip_grad_norm_` of the layer-wise and FSDP optimizers against
`torch.nn.utils.clip_grad_norm_` on the single-process model (same global batch), followed
by the single-process optimizer: returned norms and parameters after several clipped steps.

float64 models; one spawned gloo run per world size batches every check (spawning is the slow
part); the references run in the test process.
"""

import functools
import math

import pytest
import torch

from models import fsdp as FS
from models import layerwise as LW
from orthoptim import build_optimizer
from orthoptim.parallel import LayerwiseDistributedOptimizer
from orthoptim.parallel.fsdp import FSDPOptimizer

from distributed import run_ranks

STEPS = 3
INF = math.inf
# (name, max_norm, norm_type, extra optimizer kwargs of the layer-wise run); the test checks
# that the reference norm is above max_norm at every step of an "_active" case, below it in
# an "_inactive" one.
CASES = [
    ("l2_active", 0.5, 2.0, {}),
    ("l2_inactive", 1e3, 2.0, dict(bucket_mb=0.01)),  # several buckets, some single-owner
    ("inf_active", 0.05, INF, dict(bucket_mb=0.01)),
    ("inf_inactive", 1e3, INF, {}),
]
LW_CONFIG = "hybrid"  # Muon on the matrices, AdamW (sharded, the default) on the rest


def _lw_model():
    return LW.make_model().double()


def _clipped_reference(model, kw, suite, max_norm, norm_type):
    """Single process: torch's clip_grad_norm_ then build_optimizer's step, STEPS times on
    `suite`'s (test_layerwise's or test_fsdp's) global batches; (norms, final parameters)."""
    opt = build_optimizer(model, **kw)
    norms = []
    for step in range(STEPS):
        x, y = suite.batch(step)
        suite.loss_fn(model, x, y).backward()
        norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm, norm_type))
        opt.step()
        opt.zero_grad()
    return norms, {n: p.detach().clone() for n, p in model.named_parameters()}


@functools.cache
def lw_reference(max_norm, norm_type):
    return _clipped_reference(_lw_model(), LW.CONFIGS[LW_CONFIG], LW, max_norm, norm_type)


@functools.cache
def fsdp_reference(max_norm, norm_type):
    return _clipped_reference(FS.make_model(torch.float64), FS.KW, FS, max_norm, norm_type)


def _layerwise(rank, world_size, max_norm, norm_type, kw):
    model = _lw_model()
    opt = LayerwiseDistributedOptimizer(model, **LW.CONFIGS[LW_CONFIG], **kw)
    assert opt.shard_adamw
    per = LW.BATCH // world_size
    norms = []
    for step in range(STEPS):
        x, y = LW.batch(step)
        sl = slice(rank * per, (rank + 1) * per)
        LW.loss_fn(model, x[sl], y[sl]).backward()
        norms.append(opt.clip_grad_norm_(max_norm, norm_type))
        stats = opt._stats.as_dict()
        opt.step()
        opt.zero_grad()
    opt.wait_for_params()
    params = {n: p.detach().clone() for n, p in model.named_parameters()}
    return norms, params, stats.get("grad_norm")


def _fsdp(rank, world_size, max_norm, norm_type, hsdp=False):
    if hsdp:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (2, world_size // 2), mesh_dim_names=("rep", "shard"))
        model = FS.make_model(torch.float64)
        for b in model.blocks:
            fully_shard(b, mesh=mesh)
        fully_shard(model, mesh=mesh)
    else:
        model = FS.sharded_model(world_size, torch.float64)
    opt = FSDPOptimizer(model, bucket_mb=0.01, **FS.KW)
    per = FS.BATCH // world_size
    norms = []
    for step in range(STEPS):
        x, y = FS.batch(step)
        sl = slice(rank * per, (rank + 1) * per)
        FS.loss_fn(model, x[sl], y[sl]).backward()
        norms.append(opt.clip_grad_norm_(max_norm, norm_type))
        opt.step()
        opt.zero_grad()
    return norms, {n: p.full_tensor().detach().clone() for n, p in model.named_parameters()}


def _nonfinite(rank, world_size):
    """A NaN on one rank's gradient: every rank's norm is NaN; error_if_nonfinite raises on
    every rank, otherwise the gradients stay unscaled and the `skip` policy skips the step."""
    model = _lw_model()
    opt = LayerwiseDistributedOptimizer(model, **LW.CONFIGS[LW_CONFIG], nonfinite="skip")
    out = {}
    x, y = LW.batch(0)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}

    def poison(g):  # before the gradient hooks copy it into its bucket
        g = g.clone()
        g[0, 0] = float("nan")
        return g

    if rank == 1:
        model.blocks[0].fc.weight.register_hook(poison)
    for error in (True, False):
        LW.loss_fn(model, x, y).backward()
        try:
            out[f"norm_{error}"] = opt.clip_grad_norm_(1.0, error_if_nonfinite=error)
        except RuntimeError as e:
            out[f"raised_{error}"] = str(e)
        with pytest.warns(RuntimeWarning, match="blocks.0.fc.weight"):
            opt.step()
        opt.zero_grad()
    opt.wait_for_params()
    out["unchanged"] = all(torch.equal(p, before[n]) for n, p in model.named_parameters())
    with pytest.raises(ValueError, match="norm_type"):
        opt.clip_grad_norm_(1.0, norm_type=0)
    return out


def _checks(rank, world_size):
    torch.set_default_dtype(torch.float32)
    res = {}
    for name, max_norm, norm_type, kw in CASES:
        res[("lw", name)] = _layerwise(rank, world_size, max_norm, norm_type, kw)
        res[("fsdp", name)] = _fsdp(rank, world_size, max_norm, norm_type)
    if world_size == 4:
        res["hsdp"] = _fsdp(rank, world_size, 0.5, 2.0, hsdp=True)
    else:
        res["nonfinite"] = _nonfinite(rank, world_size)
    return res


@pytest.fixture(scope="module", params=[2, 4])
def results(request):
    return request.param, run_ranks(_checks, request.param)


def _close(got, want, rtol, label):
    for n, w in want.items():
        err = ((got[n] - w).norm() / w.norm()).item()
        assert err <= rtol, f"{label} {n}: relative error {err:.2e} > {rtol}"


def test_clip_equals_single_process(results):
    _, ranks = results
    for kind, ref in (("lw", lw_reference), ("fsdp", fsdp_reference)):
        for name, max_norm, norm_type, _ in CASES:
            want_norms, want_params = ref(max_norm, norm_type)
            active = [float(n) > max_norm for n in want_norms]
            assert all(active) if name.endswith("_active") else not any(active), (name, want_norms)
            for rank, res in enumerate(ranks):
                norms, params = res[(kind, name)][:2]
                for step, (g, w) in enumerate(zip(norms, want_norms)):
                    assert g.dtype == torch.float64
                    rel = abs(g.item() - w.item()) / w.item()
                    assert rel <= 1e-12, f"{kind} {name} rank {rank} step {step}: {g} vs {w}"
                _close(params, want_params, 1e-10, f"{kind} {name} rank {rank}")
                for n, p in params.items():  # every replica holds the same parameters
                    assert torch.equal(p, ranks[0][(kind, name)][1][n]), (kind, name, n)
    # one small all-reduce per clip (the layer-wise optimizer has no tensor parallelism here)
    assert all(res[("lw", "l2_active")][2]["calls"] == 1 for res in ranks)


def test_clip_hsdp_and_nonfinite(results):
    world_size, ranks = results
    if world_size == 4:
        want_norms, want_params = fsdp_reference(0.5, 2.0)
        for res in ranks:
            norms, params = res["hsdp"]
            for g, w in zip(norms, want_norms):
                assert abs(g.item() - w.item()) <= 1e-12 * w.item()
            _close(params, want_params, 1e-10, "hsdp")
        return
    for res in ranks:
        out = res["nonfinite"]
        assert "non-finite" in out["raised_True"]
        assert math.isnan(out["norm_False"].item())
        assert out["unchanged"]


def test_train_grad_clip_flag(tmp_path, capsys):
    """`orthoptim train --grad-clip`: validated naming the flag; the norm logged per step."""
    import json

    from orthoptim.cli import main

    assert main(["train", "--grad-clip", "-1", "--out", str(tmp_path)]) == 2
    assert "--grad-clip must be a finite number >= 0" in capsys.readouterr().err
    out = tmp_path / "run"
    argv = [
        "train", "--nproc", "1", "--config", "tiny", "--steps", "2", "--batch", "2",
        "--eval-every", "2", "--eval-batches", "1", "--out", str(out), "--no-progress",
    ]  # fmt: skip
    assert main([*argv, "--grad-clip", "0.5"]) == 0
    rows = [json.loads(r) for r in (out / "metrics.jsonl").read_text().splitlines()]
    norms = [r["grad_norm"] for r in rows if r["step"] > 0]
    assert len(norms) == 2 and all(n > 0 for n in norms)
