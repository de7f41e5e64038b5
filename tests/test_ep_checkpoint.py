"""The layer-wise optimizer's checkpoints under expert parallelism: the state dicts of an
--ep run are the single-process optimizer's and reshard across --ep and --dp.

One spawn of 4 gloo ranks (float64, the shrunk tiny MoE of tests/test_ep.py) trains 2 steps
at dp 4 ep 2 (`layout=`), then resumes a 3rd step at dp 2 ep 2 (from the full dict and from a
`save_sharded` checkpoint) and at dp 2 ep 1 (two copies: each pipeline "stage" of a pp 2
layout is one dp 2 run of the whole model). The oracle is `build_optimizer` on one process,
3 uninterrupted steps on the same global batches; it also resumes from the ranks' dict and
their sharded checkpoint. The same spawn checks expert slices owned as `split_experts` units,
the groups given one by one (`process_group=`, `expert_group=`) instead of `layout=`, and the
refusal of an expert-parallel model whose optimizer has no expert group.
"""

from __future__ import annotations

import copy

import torch

from models.ep import BATCH, CFG, OPT_KW, REL
from models.ep import moe_model as _model
from models.ep import rel as _rel
from models.ep import state_by_name as _state
from orthoptim import build_optimizer
from orthoptim import checkpoint as ckpt
from orthoptim.parallel.layerwise import LayerwiseDistributedOptimizer
from orthoptim.parallel.layout import ParallelDims, ParallelMesh
from orthoptim.train.model import (
    GPT,
    expert_parallelize,
    full_expert_state_dict,
    load_expert_state_dict,
)

from distributed import run_ranks

WORLD = 4  # the global batch of every step: WORLD · BATCH sequences
STEPS = 3


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    x = torch.randint(0, CFG.vocab_size, (WORLD * BATCH, CFG.seq_len), generator=g)
    y = torch.randint(0, CFG.vocab_size, (WORLD * BATCH, CFG.seq_len), generator=g)
    return x, y


def _ep_model(mesh: ParallelMesh) -> GPT:
    """The model cut for `mesh`: its experts over the ep group, balancing counts over dp."""
    return expert_parallelize(_model(), mesh.ep_group, mesh.coord.ep, mesh.dims.ep, mesh.dp_group)


def _optimizer(model: GPT, mesh: ParallelMesh, **kw) -> LayerwiseDistributedOptimizer:
    return LayerwiseDistributedOptimizer(model, "muon", layout=mesh, bucket_mb=1e-3, **OPT_KW, **kw)


def _train(model, opt, mesh: ParallelMesh | None, steps) -> None:
    """Steps on the global batches, each dp rank of a stage (or one process) on its part."""
    dp, i = (mesh.dims.dp, mesh.coord.dp) if mesh is not None else (1, 0)
    rows = WORLD * BATCH // dp
    for step in steps:
        x, y = _batch(step)
        model(x[i * rows : (i + 1) * rows], y[i * rows : (i + 1) * rows]).backward()
        opt.step()
        opt.zero_grad()


def _resumed(mesh: ParallelMesh, model: GPT, opt) -> dict:
    """The 3rd step after a resume; the full model and optimizer dicts after it."""
    _train(model, opt, mesh, [STEPS - 1])
    opt.wait_for_params()
    return {"model": _full_model(model), "optim": opt.state_dict()}


def _full_model(model: GPT) -> dict[str, torch.Tensor]:
    """The full model's state dict, copied (its dense entries are the live parameters)."""
    return {k: v.clone() for k, v in full_expert_state_dict(model).items()}


def _ranks(rank: int, world: int, folder: str) -> dict:
    mesh = ParallelDims(dp=4, ep=2).build()
    model = _ep_model(mesh)
    opt = _optimizer(model, mesh)
    _train(model, opt, mesh, range(STEPS - 1))
    out: dict = {"full": opt.state_dict(), "rank0": opt.full_state_dict(to_rank0=True)}
    opt.prepare_state_dict()
    out["prepared"] = opt.state_dict() if rank == 0 else None  # rank 0 alone: no collective
    opt.wait_for_params()
    out["model"] = _full_model(model)
    ckpt.save_sharded(f"{folder}/ep", opt, model)
    out["uninterrupted"] = _resumed(mesh, model, opt)

    # dp 2 ep 2 (each pp "stage" one copy): from the full dict, and from the DCP checkpoint
    half = ParallelDims(dp=2, ep=2, pp=2).build()
    model = _ep_model(half)
    load_expert_state_dict(model, out["model"])
    opt = _optimizer(model, half)
    opt.load_state_dict(out["full"])
    out["dp2ep2_full"] = _resumed(half, model, opt)
    model = _ep_model(half)
    opt = _optimizer(model, half)
    ckpt.load_sharded(f"{folder}/ep", opt, model)
    out["dp2ep2_sharded"] = _resumed(half, model, opt)
    # dp 2 ep 1: the experts whole on every rank
    dense = ParallelDims(dp=2, pp=2).build()
    model = expert_parallelize(_model(), None, 0, 1, stats_group=dense.dp_group)
    model.load_state_dict(out["model"])
    opt = _optimizer(model, dense)
    opt.load_state_dict(out["full"])
    out["dp2ep1_full"] = _resumed(dense, model, opt)
    # dp 4 ep 2 again, each rank's 4 experts owned as 2 slices of 2 (`w[a:b]` locally)
    model = _ep_model(mesh)
    opt = _optimizer(model, mesh, split_experts=2)
    _train(model, opt, mesh, range(STEPS - 1))
    out["split"] = opt.state_dict()
    out["split_owners"] = {n: o for n, o in opt.owner_of.items() if "experts_" in n}
    # the same run with the groups given one by one instead of layout=: the experts'
    # gradients (summed over ep by the dispatch) are still averaged over dp
    model = _ep_model(mesh)
    opt = LayerwiseDistributedOptimizer(
        model, "muon", process_group=mesh.dp_group, expert_group=mesh.expert_group,
        bucket_mb=1e-3, **OPT_KW,
    )  # fmt: skip
    _train(model, opt, mesh, range(STEPS - 1))
    out["by_groups"] = opt.state_dict()
    # the experts of an expert-parallel model taken as dense weights (no expert group): the
    # ranks' different experts would be averaged (and their stacks collide under one name in
    # a checkpoint), so the optimizer is refused
    try:
        LayerwiseDistributedOptimizer(_ep_model(mesh), "muon", process_group=None, **OPT_KW)
    except ValueError as exc:
        out["refused"] = str(exc)
    return out


def _assert_state_equal(got: dict, want: dict) -> None:
    """Two full optimizer dicts: the same groups (names, indices, hyper-parameters) and every
    state tensor within `REL` (float64: the reductions sum in another order)."""
    assert [g["param_names"] for g in got["param_groups"]] == [
        g["param_names"] for g in want["param_groups"]
    ]
    for g, w in zip(got["param_groups"], want["param_groups"]):
        assert g["params"] == w["params"]
        assert {k: v for k, v in g.items() if k != "param_names"} == {
            k: v for k, v in w.items() if k != "param_names"
        }
    assert got["state"].keys() == want["state"].keys()
    got, want = _state(got), _state(want)
    for n, st in want.items():
        assert got[n].keys() == st.keys(), n
        for k, v in st.items():
            if isinstance(v, torch.Tensor) and v.ndim:
                assert got[n][k].shape == v.shape and _rel(got[n][k], v) <= REL, (n, k)
            else:
                assert got[n][k] == v, (n, k)


def _assert_model_equal(got: dict, want: dict) -> None:
    assert got.keys() == want.keys()
    for k, v in want.items():
        assert got[k].shape == v.shape and _rel(got[k], v) <= REL, k


def test_ep_state_dicts_are_the_single_process_ones_and_reshard(tmp_path):
    ranks = run_ranks(_ranks, WORLD, args=(str(tmp_path),))
    model = _model()
    opt = build_optimizer(model, **OPT_KW)
    _train(model, opt, None, range(STEPS - 1))
    want2, model2 = copy.deepcopy(opt.state_dict()), copy.deepcopy(model.state_dict())
    _train(model, opt, None, [STEPS - 1])
    want3 = {"model": model.state_dict(), "optim": opt.state_dict()}
    # (a) after 2 steps at dp 4 ep 2: the single-process dicts, on every rank or on rank 0
    for rank, r in enumerate(ranks):
        _assert_state_equal(r["full"], want2)
        _assert_state_equal(r["split"], want2)
        _assert_state_equal(r["by_groups"], want2)
        assert len(r["split_owners"]) == 2 * 2 * CFG.n_layer  # 2 slices of 2 stacks a layer
        assert "the model is expert-parallel" in r["refused"] and "layout=" in r["refused"]
        _assert_model_equal(r["model"], model2)
        if rank == 0:
            _assert_state_equal(r["rank0"], want2)
            _assert_state_equal(r["prepared"], want2)
        else:
            assert r["rank0"] == {}
        # (b), (c) the 3rd step: uninterrupted, and resumed at dp 2 with ep 2 or 1
        for how in ("uninterrupted", "dp2ep2_full", "dp2ep2_sharded", "dp2ep1_full"):
            _assert_model_equal(r[how]["model"], want3["model"])
            _assert_state_equal(r[how]["optim"], want3["optim"])
    # (b), (c) one process resumed from the ranks' full dict and their sharded checkpoint
    for how in ("full", "sharded"):
        single = GPT(CFG).double()  # another initialisation, overwritten by the loads
        single_opt = build_optimizer(single, **OPT_KW)
        if how == "full":
            single.load_state_dict(ranks[1]["model"])
            single_opt.load_state_dict(ranks[1]["full"])
        else:
            ckpt.load_sharded(tmp_path / "ep", single_opt, single)
        _train(single, single_opt, None, [STEPS - 1])
        _assert_model_equal(single.state_dict(), want3["model"])
        _assert_state_equal(single_opt.state_dict(), want3["optim"])
