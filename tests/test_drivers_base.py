"""The base of the distributed drivers (`orthoptim.parallel.base.DistributedOptimizer`).

- A third driver is one small subclass: `Replicated` (all-reduce of every gradient, every
  rank steps everything) equals the single-process optimizer on 2 gloo ranks (each stage's
  dp group of a pp 2 × dp 2 layout).
- Under a layout with ep > 1 the layer-wise optimizer's expert gradients are the sum over the
  expert group divided by dp (the single-process gradient), not the mean over the expert group.
- Under a layout with pp > 1 every stage agrees on a non-finite gradient of another stage
  (raise or skip together) and clips by the whole model's norm; `expected_comm_bytes()`
  counts the one all-reduce across stages.

float64 throughout; the references run in the test process or on each rank from the same
seeds. One spawned run of 4 ranks serves every test (spawning is the slow part).
"""

from __future__ import annotations

import math
import warnings

import pytest
import torch
from torch import nn

from orthoptim import build_optimizer
from orthoptim import collectives as C
from orthoptim.optim.base import NonFiniteGradientError, step_checked
from orthoptim.parallel.base import ANOTHER_STAGE, DistributedOptimizer
from orthoptim.parallel.layerwise import LayerwiseDistributedOptimizer
from orthoptim.parallel.layout import ParallelDims, ParallelMesh

from distributed import run_ranks

KW = dict(lr=0.05, weight_decay=0.01)


class Replicated(DistributedOptimizer):
    """Every rank steps the whole model on the gradients averaged over the data-parallel
    group (one all-reduce per gradient): the smallest driver the base admits."""

    def __init__(self, model: nn.Module, process_group=None, layout=None, **kw) -> None:
        self._preamble(model, "muon", kw.pop("lr", None), None, "raise", "cost", 25, "all", kw)
        self._bind_groups(process_group, layout=layout)
        self._adopt(self.template.param_groups, self.template.state, self.template.defaults)

    def _before_agree(self) -> None:
        for p in self.named.values():
            if p.grad is not None:
                C.all_reduce(p.grad, group=self.process_group, stats=self._stats)
                p.grad.div_(self.world_size)

    def _step_owned(self, present: list[bool]) -> None:
        step_checked(self.template)


def _mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3)).double()


def _batch(step: int, rank: int) -> torch.Tensor:
    return torch.randn(
        4, 6, dtype=torch.float64, generator=torch.Generator().manual_seed(10 * step + rank)
    )


def _replicated(layout: ParallelMesh) -> dict:
    """`Replicated` over each stage's 2 dp ranks (the stages run the same model and batches)."""
    model = _mlp()
    opt = Replicated(model, layout=layout, **KW)
    for step in range(3):
        model(_batch(step, layout.coord.dp)).square().mean().backward()
        opt.step()
        opt.zero_grad()
    return {
        "params": {n: p.detach().clone() for n, p in model.named_parameters()},
        "stats": {k: v for k, v in opt.comm_stats().items() if k != "total"},
        "state": opt.state_dict(),
    }


def test_a_third_driver_is_one_small_subclass(four):
    model = _mlp()
    ref = build_optimizer(model, **KW)
    for step in range(3):
        # the global loss: the mean over the dp ranks of each rank's mean
        sum(model(_batch(step, r)).square().mean() for r in range(2)).div(2).backward()
        ref.step()
        ref.zero_grad()
    for r in four:
        got = r["replicated"]
        for n, p in model.named_parameters():
            torch.testing.assert_close(got["params"][n], p.detach(), rtol=1e-12, atol=1e-12)
        # one all-reduce per gradient and the agreement's over dp, the agreement's over pp
        assert got["stats"]["all_reduce"]["calls"] == 4 + 1 + 1
        assert got["state"]["state"].keys() == ref.state_dict()["state"].keys()


E, OUT, IN = 4, 3, 5


class _Stage(nn.Module):
    """A stage of a model with a dense matrix and a stack of E // ep experts."""

    def __init__(self, local_experts: int, dense: str = "dense") -> None:
        super().__init__()
        self.add_module(dense, nn.Linear(IN, OUT, bias=False))
        self.experts = nn.Parameter(torch.zeros(local_experts, OUT, IN))
        self.double()


def _contribution(j: int, shape: tuple[int, ...], salt: int) -> torch.Tensor:
    return torch.randn(
        shape, dtype=torch.float64, generator=torch.Generator().manual_seed(100 * salt + j)
    )


def _owned_grads(opt: LayerwiseDistributedOptimizer) -> dict[str, torch.Tensor]:
    """The reduced gradient of every unit this rank owns (after clip_grad_norm_ reduced them)."""
    return {s.name: b.shard_view(s).clone() for b in opt.grad_sync.buckets for s in b.mine}


def _expert_scaling(rank: int, world: int) -> dict:
    """dp 4, ep 2: rank r holds experts of ep index e = r % 2; its expert gradient is what the
    all-to-all's backward leaves, the sum over its ep group of every member's contribution."""
    layout = ParallelDims(dp=4, ep=2).build()
    e, local = rank % 2, E // 2
    model = _Stage(local)
    opt = LayerwiseDistributedOptimizer(model, layout=layout, bucket_mb=1e-4, **KW)
    model.dense.weight.grad = _contribution(rank, (OUT, IN), 0)
    model.experts.grad = sum(
        _contribution(j, (E, OUT, IN), 1)[e * local : (e + 1) * local]
        for j in layout.dims.group_ranks("ep", rank)
    )
    norm = opt.clip_grad_norm_(1e300)  # reduces; scales by 1
    return {
        "grads": _owned_grads(opt),
        "norm": norm,
        "e": e,
        "expert_ranks": layout.dims.group_ranks("edp", rank),
    }


def _pp_stage(rank: int, layout: ParallelMesh, nonfinite: str = "raise", bad: bool = False):
    """pp 2 × dp 2: stage s holds `blocks{s}` and its experts; (model, optimizer)."""
    s = rank // 2
    model = _Stage(E, dense=f"block{s}")
    opt = LayerwiseDistributedOptimizer(
        model, layout=layout, bucket_mb=1e-4, nonfinite=nonfinite, **KW
    )
    getattr(model, f"block{s}").weight.grad = _contribution(rank, (OUT, IN), 2 + s)
    model.experts.grad = _contribution(rank, (E, OUT, IN), 4 + s)
    if bad:
        model.experts.grad[0, 0, 0] = math.nan
    return model, opt


def _pipeline(rank: int, world: int) -> dict:
    layout = ParallelDims(dp=2, pp=2).build()
    out: dict = {"stage": rank // 2}
    model, opt = _pp_stage(rank, layout)
    out["norm"] = opt.clip_grad_norm_(0.5)
    out["clipped"] = _owned_grads(opt)
    opt.step()
    out["stats"] = {k: v for k, v in opt.comm_stats().items() if k != "total"}
    out["norm_calls"] = out["stats"].pop("grad_norm")["calls"]
    out["expected"] = opt.expected_comm_bytes()
    for policy in ("raise", "skip"):
        model, opt = _pp_stage(rank, layout, policy, bad=rank == 3)
        before = {n: p.detach().clone() for n, p in model.named_parameters()}
        try:
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                opt.step()
            out[policy] = [str(w.message) for w in caught if "skipping" in str(w.message)]
        except NonFiniteGradientError as err:
            out[policy] = str(err)
        opt.wait_for_params()
        out[f"{policy}_untouched"] = all(
            torch.equal(p, before[n]) for n, p in model.named_parameters()
        )
    out["replicated"] = _replicated(layout)
    out["fsdp"] = _fsdp_pipeline(rank, layout)
    out["ep"] = _expert_scaling(rank, world)
    return out


def _fsdp_model(stage: int) -> nn.Module:
    torch.manual_seed(stage)
    return nn.Sequential(nn.Linear(IN, 4), nn.Tanh(), nn.Linear(4, OUT)).double()


def _fsdp_loss(model: nn.Module, rank: int, bad: bool = False) -> torch.Tensor:
    x = _batch(0, rank)[:, :IN]
    if bad:
        x[0, 0] = math.nan
    return model(x).square().mean()


def _fsdp_pipeline(rank: int, layout: ParallelMesh) -> dict:
    """FSDPOptimizer on each stage's model, sharded over the stage's dp group."""
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import fully_shard

    from orthoptim.parallel.fsdp import FSDPOptimizer

    ranks = layout.dims.group_ranks("dp", rank)
    out: dict = {}
    for bad in (False, True):
        model = _fsdp_model(rank // 2)
        mesh = DeviceMesh.from_group(layout.dp_group, "cpu", mesh=torch.tensor(ranks))
        fully_shard(model, mesh=mesh)
        opt = FSDPOptimizer(model, layout=layout, **KW)
        _fsdp_loss(model, rank, bad=bad and rank == 3).backward()
        if not bad:
            out["norm"] = opt.clip_grad_norm_(1e300)
            opt.step()
            out["stats"] = {k: v for k, v in opt.comm_stats().items() if k != "total"}
            out["stats"].pop("grad_norm")
            out["expected"] = opt.expected_comm_bytes()
            continue
        try:
            opt.step()
        except NonFiniteGradientError as err:
            out["raise"] = str(err)
    return out


@pytest.fixture(scope="module")
def four():
    return run_ranks(_pipeline, 4)


def test_expert_gradients_are_the_single_process_ones(four):
    """The owner's reduced expert gradient equals the single-process one, (1/dp) Σ over all
    ranks' contributions; the old mean over the expert group would be twice it."""
    experts = sum(_contribution(j, (E, OUT, IN), 1) for j in range(4)) / 4
    dense = sum(_contribution(j, (OUT, IN), 0) for j in range(4)) / 4
    owners = set()
    for rank, r in enumerate(four):
        got = r["ep"]
        e, local = got["e"], E // 2
        assert got["expert_ranks"] == [e, e + 2]
        if "experts" in got["grads"]:
            owners.add(rank)
            want = experts[e * local : (e + 1) * local]
            torch.testing.assert_close(got["grads"]["experts"], want, rtol=1e-12, atol=1e-12)
        if "dense.weight" in got["grads"]:
            torch.testing.assert_close(got["grads"]["dense.weight"], dense, rtol=1e-12, atol=1e-12)
    assert len(owners) == 2  # one owner per expert group
    # each element counted once over the stage: the whole model's norm
    full = torch.cat([experts.reshape(-1), dense.reshape(-1)]).norm()
    for r in four:
        torch.testing.assert_close(r["ep"]["norm"], full, rtol=1e-12, atol=0)


def test_pipeline_stages_clip_by_the_whole_models_norm(four):
    grads = {
        s: (
            sum(_contribution(j, (OUT, IN), 2 + s) for j in (2 * s, 2 * s + 1)) / 2,
            sum(_contribution(j, (E, OUT, IN), 4 + s) for j in (2 * s, 2 * s + 1)) / 2,
        )
        for s in (0, 1)
    }
    total = torch.cat([g.reshape(-1) for pair in grads.values() for g in pair]).norm()
    coef = 0.5 / (total + 1e-6)
    assert coef < 1
    for r in four:
        torch.testing.assert_close(r["norm"], total, rtol=1e-12, atol=0)
        dense, experts = grads[r["stage"]]
        for name, g in r["clipped"].items():
            want = experts if name == "experts" else dense
            torch.testing.assert_close(g, want * coef, rtol=1e-12, atol=1e-15)
        # the agreement's all-reduce across stages is counted, and measured
        assert r["stats"] == r["expected"]
        assert r["expected"]["all_reduce"]["calls"] == 2  # over dp, then over pp
        assert r["norm_calls"] == 2


def test_fsdp_stages_clip_and_agree_across_the_pipeline(four):
    total = 0.0
    for stage in (0, 1):
        model = _fsdp_model(stage)
        sum(_fsdp_loss(model, r) for r in (2 * stage, 2 * stage + 1)).div(2).backward()
        total += sum(p.grad.square().sum() for p in model.parameters())
    for r in four:
        torch.testing.assert_close(r["fsdp"]["norm"], total.sqrt(), rtol=1e-12, atol=0)
        assert r["fsdp"]["stats"] == r["fsdp"]["expected"]
        assert (ANOTHER_STAGE in r["fsdp"]["raise"]) == (r["stage"] == 0)


def test_pipeline_stages_agree_on_a_non_finite_gradient(four):
    for r in four:
        assert r["raise_untouched"] and r["skip_untouched"]
        if r["stage"] == 1:
            assert "experts" in r["raise"] and ANOTHER_STAGE not in r["raise"]
        else:
            assert ANOTHER_STAGE in r["raise"]
        assert len(r["skip"]) == 1 and "skipping optimizer step on every rank" in r["skip"][0]


def _mesh(**sizes: int) -> ParallelMesh:
    """A layout's groups as one process sees them without a process group (every group None,
    the default one): enough for the checks made at construction."""
    groups = dict.fromkeys(("dp", "edp", "ep", "tp", "pp", "stage"))
    return ParallelMesh(ParallelDims(**sizes), 0, groups, "cpu")


def test_a_layout_refuses_groups_given_twice_and_fsdp_refuses_expert_parallelism():
    from orthoptim.parallel.fsdp import FSDPOptimizer

    with pytest.raises(ValueError, match="pass layout= or process_group="):
        LayerwiseDistributedOptimizer(_mlp(), layout=_mesh(dp=2), process_group=object())
    with pytest.raises(ValueError, match="ep=2, tp=1: use LayerwiseDistributedOptimizer"):
        FSDPOptimizer(_mlp(), layout=_mesh(dp=2, ep=2))
