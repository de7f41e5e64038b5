"""Pipeline parallelism (`orthoptim.train.pipeline`) against the single-process model.

The ranks run float64 copies of the tiny GPT and the tiny MoE (shrunk), split into stages, over
gloo; the references run in the test process on the whole batch. A stage's micro-batches cut
the batch's sums into other orders, so the losses, gradients and parameters agree to float64
rounding (~1e-16 relative, grown a little by three optimizer steps), well inside TOL.
"""

from __future__ import annotations

import dataclasses
import functools

import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from orthoptim import build_optimizer, collectives
from orthoptim.optim.hybrid import default_route
from orthoptim.parallel import LayerwiseDistributedOptimizer
from orthoptim.parallel.base import ELSEWHERE, StepRefusedError
from orthoptim.parallel.layout import ParallelDims
from orthoptim.train import model as model_module
from orthoptim.train.model import GPT, GPTConfig, MoEConfig, get_config, parallelize
from orthoptim.train.pipeline import (
    PipelineRunner,
    lm_loss,
    split_stage,
    stage_layers,
)

from distributed import run_ranks

TOL = 1e-10
BATCH, SEQ, STEPS = 8, 8, 3
OPT = dict(optimizer="muon", lr=0.02, adamw_lr=3e-3, weight_decay=0.01)
CASES = [(s, n) for s in ("gpipe", "1f1b") for n in (2, 4)]


def shrunk(config: str) -> GPTConfig:
    """`config` at a width and length that keep float64 runs fast. The tiny GPT gets 3
    blocks, so that a 2-stage split has a remainder."""
    cfg = get_config(config)
    small = dict(d_model=32, n_head=2, seq_len=SEQ, qk_clip=None)
    if cfg.moe is not None:
        return dataclasses.replace(
            cfg, **small, n_kv_head=1, moe=MoEConfig(n_expert=4, top_k=2, hidden=32)
        )
    return dataclasses.replace(cfg, **small, n_layer=3)


AUX = 0.5  # large, so that a lost or mis-scaled balancing loss shows in every router grad


def make_model(config: str) -> GPT:
    torch.manual_seed(0)
    if config == "tiny-deep":  # 5 blocks: 4 stages of 2, 1, 1, 1
        return GPT(dataclasses.replace(shrunk("tiny"), n_layer=5)).double()
    if config == "tiny-moe-aux":
        cfg = shrunk("tiny-moe")
        cfg = dataclasses.replace(cfg, moe=dataclasses.replace(cfg.moe, aux_loss_coef=AUX))
        return GPT(cfg).double()
    return GPT(shrunk(config)).double()


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    idx = torch.randint(0, 256, (BATCH, SEQ + 1), generator=g)
    return idx[:, :-1], idx[:, 1:]


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm().clamp_min(1e-300))


@functools.cache
def reference_grads(config: str) -> tuple[float, dict[str, torch.Tensor], dict]:
    """The loss of batch 0, the gradients of batches 0 and 1 accumulated (two backwards)
    and the max attention logits of those two forwards, on the whole model."""
    model = make_model(config)
    model.record_attention_logits(True)
    loss = lm_loss(model(*batch(0)[:1]), batch(0)[1])
    loss.backward()
    x, y = batch(1)
    lm_loss(model(x), y).backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    return loss.item(), grads, model.attention_max_logits()


@functools.cache
def reference_accumulated(config: str, n: int) -> tuple[float, dict[str, torch.Tensor]]:
    """Batch 0 as n accumulated micro-batches of GPT(x, y) (which adds the router loss of
    each) / n: the loss and gradients a pipeline of n micro-batches must give."""
    model = make_model(config)
    total = 0.0
    for x, y in zip(*(t.chunk(n) for t in batch(0))):
        loss = model(x, y) / n
        loss.backward()
        total += loss.item()
    return total, {k: p.grad.clone() for k, p in model.named_parameters()}


@functools.cache
def reference_steps(config: str) -> tuple[list[float], dict[str, torch.Tensor]]:
    """Losses and parameters of STEPS single-process steps of build_optimizer(**OPT), then
    the loss on half of the next batch (another shape) as the last loss."""
    model = make_model(config)
    opt = build_optimizer(model, **OPT)
    losses = []
    for step in range(STEPS):
        x, y = batch(step)
        loss = lm_loss(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    x, y = (t[: BATCH // 2] for t in batch(STEPS))
    with torch.no_grad():
        losses.append(lm_loss(model(x), y).item())
    return losses, {n: p.detach().clone() for n, p in model.named_parameters()}


# ---- the split -------------------------------------------------------------------------


def test_stage_layers_are_contiguous_balanced_and_cover_the_model():
    assert [list(stage_layers(7, 3, s)) for s in range(3)] == [[0, 1, 2], [3, 4], [5, 6]]
    for n_layer in range(1, 9):
        for pp in range(1, n_layer + 1):
            runs = [stage_layers(n_layer, pp, s) for s in range(pp)]
            assert [i for r in runs for i in r] == list(range(n_layer))
            assert max(map(len, runs)) - min(map(len, runs)) <= 1


def test_a_pipeline_deeper_than_the_model_is_refused_naming_pp():
    with pytest.raises(ValueError, match=r"^pp 5 exceeds the model's 4 layers.*pp 4 or"):
        stage_layers(4, 5, 0)
    with pytest.raises(ValueError, match="^pp 4 exceeds the model's 3 layers"):
        split_stage(make_model("tiny"), 4, 0)
    with pytest.raises(ValueError, match="^pp must be a positive integer, got 0"):
        stage_layers(4, 0, 0)
    with pytest.raises(ValueError, match=r"stage must be in \[0, 2\)"):
        stage_layers(4, 2, 2)


@pytest.mark.parametrize("config", ["tiny", "tiny-moe"])
def test_stages_hold_the_full_models_names_routes_and_splits(config):
    """The stages' parameters partition the full model's, under its names; each stage
    routes, splits and finds its attention heads as the full model does."""
    model = make_model(config)
    full = dict(model.named_parameters())
    route, spec, heads = default_route(model), model.split_spec(), model.qk_clip_heads()
    seen: list[str] = []
    for s in range(2):
        stage = split_stage(model, 2, s)
        named = dict(stage.named_parameters())
        assert all(named[n] is full[n] for n in named)
        seen += named
        assert {n: default_route(stage)(n, p) for n, p in named.items()} == {
            n: route(n, p) for n, p in named.items()
        }
        assert stage.split_spec() == {n: v for n, v in spec.items() if n in named}
        assert stage.qk_clip_heads() == {
            f"blocks.{i}.attn": heads[f"blocks.{i}.attn"] for i in stage.layers
        }
        assert set(stage.state_dict()) <= set(model.state_dict())
        assert list(stage.blocks) == [model.blocks[i] for i in stage.layers]
    assert sorted(seen) == sorted(full)
    first, last = split_stage(model, 2, 0), split_stage(model, 2, 1)
    assert "embed.weight" in dict(first.named_parameters())
    assert "lm_head.weight" in dict(last.named_parameters())


def test_stages_in_sequence_compute_the_full_models_logits():
    model = make_model("tiny")
    x, _ = batch(0)
    h = x
    for s in range(3):
        h = split_stage(model, 3, s)(h)
    torch.testing.assert_close(h, model(x), rtol=0, atol=0)


# ---- the schedules over 2 ranks --------------------------------------------------------


def _pipelined(rank, world_size):
    """Per config and (schedule, micro-batches): the loss of batch 0 by evaluate and by
    step, and the stage's gradients after step on batches 0 and 1; then STEPS optimizer
    steps of a stage's own build_optimizer. With a router loss: batch 0's loss and
    gradients."""
    out = {}
    for config in ("tiny", "tiny-moe"):
        for schedule, n in CASES:
            stage = split_stage(make_model(config), world_size, rank)
            stage.record_attention_logits(True)
            runner = PipelineRunner(stage, None, n_microbatches=n, schedule=schedule)
            evaluated = runner.evaluate(*batch(0))
            loss = runner.step(*batch(0))
            assert runner.evaluate(*batch(0)) == evaluated  # between steps: no gradients
            runner.step(*batch(1))  # accumulates, as a second loss.backward() would
            grads = {k: p.grad for k, p in stage.named_parameters()}
            out[config, schedule, n] = evaluated, loss, grads, stage.attention_max_logits()
        stage = split_stage(make_model(config), world_size, rank)
        runner = PipelineRunner(stage, dist.group.WORLD, n_microbatches=2)
        opt = build_optimizer(stage, **OPT)
        losses = []
        for step in range(STEPS):
            losses.append(runner.step(*batch(step)))
            opt.step()
            opt.zero_grad()
        losses.append(runner.evaluate(*(t[: BATCH // 2] for t in batch(STEPS))))
        out[config, "steps"] = losses, {k: p.detach() for k, p in stage.named_parameters()}
    for schedule, n in CASES:
        stage = split_stage(make_model("tiny-moe-aux"), world_size, rank)
        runner = PipelineRunner(stage, None, n_microbatches=n, schedule=schedule)
        loss = runner.step(*batch(0))
        out["aux", schedule, n] = loss, {k: p.grad for k, p in stage.named_parameters()}
    return out


@functools.cache
def pipelined():
    return run_ranks(_pipelined, 2)


@pytest.mark.parametrize("config", ["tiny", "tiny-moe"])
@pytest.mark.parametrize("schedule,n", CASES)
def test_pipeline_loss_and_gradients_equal_the_single_process(config, schedule, n):
    loss, grads, max_logits = reference_grads(config)
    held = []
    for result in pipelined():
        evaluated, got, stage_grads, logits = result[config, schedule, n]
        assert abs(got - loss) <= TOL * abs(loss)
        assert abs(evaluated - loss) <= TOL * abs(loss)
        for name, g in stage_grads.items():
            assert rel(g, grads[name]) <= TOL, name
        held += stage_grads
        for layer, m in logits.items():  # MuonClip's record: the max over the micro-batches
            torch.testing.assert_close(m, max_logits[layer], rtol=TOL, atol=0)
    assert sorted(held) == sorted(grads)


@pytest.mark.parametrize("schedule,n", CASES)
def test_pipeline_keeps_each_stages_router_loss(schedule, n):
    """The load-balancing loss of the MoE layers on both stages is in the loss and in the
    gradients, as in n accumulated micro-batches (it is a loss per micro-batch)."""
    loss, grads = reference_accumulated("tiny-moe-aux", n)
    plain, _ = reference_accumulated("tiny-moe", n)
    assert loss - plain > 1e-3  # the router loss is there to be kept
    for result in pipelined():
        got, stage_grads = result["aux", schedule, n]
        assert abs(got - loss) <= TOL * abs(loss)
        for name, g in stage_grads.items():
            assert rel(g, grads[name]) <= TOL, name


@pytest.mark.parametrize("config", ["tiny", "tiny-moe"])
def test_optimizer_steps_per_stage_equal_the_single_process(config):
    losses, params = reference_steps(config)
    for result in pipelined():
        got, stage_params = result[config, "steps"]
        assert got == pytest.approx(losses, rel=TOL, abs=0)
        for name, p in stage_params.items():
            assert rel(p, params[name]) <= TOL, name


def test_runner_refusals_name_the_fix():
    stage = split_stage(make_model("tiny"), 1, 0)
    with pytest.raises(ValueError, match="schedule must be one of"):
        PipelineRunner(stage, None, n_microbatches=2, schedule="zb")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="n_microbatches must be >= 1"):
        PipelineRunner(stage, None, n_microbatches=0)
    deep = split_stage(make_model("tiny"), 3, 0)
    with pytest.raises(ValueError, match=r"n_microbatches \(2\) must be >= --pp \(3\)"):
        PipelineRunner(deep, None, n_microbatches=2)
    with pytest.raises(ValueError, match="group has 1 ranks .* stage 0 of --pp 3: pass the pp"):
        PipelineRunner(deep, None, n_microbatches=2, schedule="gpipe")
    runner = PipelineRunner(stage, None, n_microbatches=3, schedule="gpipe")
    with pytest.raises(ValueError, match="batch of 8 sequences does not split into n_micro"):
        runner.step(*batch(0))


# ---- 4 ranks: pp 2 × dp 2 (layer-wise optimizer per stage), pp 2 × tp 2 ----------------


def _pipelined_4(rank, world_size):
    """pp 2 × dp 2: STEPS layer-wise steps over each stage's dp group, each dp rank a half
    of the batch in 2 micro-batches (the first backward in the optimizer's no_sync). Then
    batch 0's gradients at pp 2 × tp 2 on the tiny GPT (parallelized before the split), at
    pp 4 (two stages in the middle, 1F1B), and at pp 2 × dp 2 × ep 2 on the tiny MoE
    (experts dispatched before the split)."""
    out = {}
    mesh = ParallelDims(pp=2, dp=2).build()
    d, per = mesh.coord.dp, BATCH // 2
    for config in ("tiny", "tiny-moe"):
        stage = split_stage(make_model(config), 2, mesh.coord.pp)
        opt = LayerwiseDistributedOptimizer(stage, process_group=mesh.dp_group, **OPT)
        runner = PipelineRunner(stage, mesh, n_microbatches=2, no_sync=opt.no_sync)
        losses = []
        for step in range(STEPS):
            x, y = batch(step)
            loss = runner.step(x[d * per : (d + 1) * per], y[d * per : (d + 1) * per])
            losses.append(collectives.sum_floats([loss], mesh.dp_group)[0] / 2)
            opt.step()
            opt.zero_grad()
        x, y = (t[d * per // 2 : (d + 1) * per // 2] for t in batch(STEPS))
        loss = runner.evaluate(x, y)  # half the batch: another shape
        losses.append(collectives.sum_floats([loss], mesh.dp_group)[0] / 2)
        opt.wait_for_params()
        out[config] = losses, {k: p.detach().clone() for k, p in stage.named_parameters()}
    mesh = ParallelDims(pp=2, tp=2).build()
    model = make_model("tiny")
    parallelize(model, mesh.tp_mesh)
    stage = split_stage(model, 2, mesh.coord.pp)
    runner = PipelineRunner(stage, mesh.pp_group, n_microbatches=2)
    loss = runner.step(*batch(0))
    out["tp"] = loss, {k: full(p.grad) for k, p in stage.named_parameters()}
    stage = split_stage(make_model("tiny-deep"), 4, rank)
    loss = PipelineRunner(stage, None, n_microbatches=4).step(*batch(0))
    out["deep"] = loss, {k: p.grad for k, p in stage.named_parameters()}
    mesh = ParallelDims(pp=2, dp=2, ep=2).build()
    model = make_model("tiny-moe")
    model_module.expert_parallelize(model, mesh.ep_group, mesh.coord.ep, 2, mesh.dp_group)
    stage = split_stage(model, 2, mesh.coord.pp)
    runner = PipelineRunner(stage, mesh, n_microbatches=2, schedule="gpipe")
    d = mesh.coord.dp
    loss = runner.step(*(t[d * per : (d + 1) * per] for t in batch(0)))
    grads = {}
    for k, p in stage.named_parameters():
        if k.rsplit(".", 1)[-1].startswith("experts"):  # summed over ep by the dispatch
            grads[k] = p.grad / 2, slice(2 * mesh.coord.ep, 2 * mesh.coord.ep + 2)
        else:
            g = p.grad.clone()
            collectives.all_reduce(g, group=mesh.dp_group)
            grads[k] = g / 2, slice(None)
    out["ep"] = collectives.sum_floats([loss], mesh.dp_group)[0] / 2, grads
    out["refused"] = _refused_on_one_stage(rank)
    return out


def _refused_on_one_stage(rank):
    """pp 2 × dp 2, a parameter frozen after the optimizer was built on rank 3 (stage 1)
    only: each rank's refusal lines, and whether its stage's weights stayed as they were."""
    mesh = ParallelDims(pp=2, dp=2).build()
    stage = split_stage(make_model("tiny"), 2, mesh.coord.pp)
    opt = LayerwiseDistributedOptimizer(stage, layout=mesh, **OPT)
    frozen = next(n for n, p in stage.named_parameters() if p.ndim == 2)
    if rank == 3:
        stage.get_parameter(frozen).requires_grad_(False)
    before = {k: p.detach().clone() for k, p in stage.named_parameters()}
    d, per = mesh.coord.dp, BATCH // 2
    runner = PipelineRunner(stage, mesh, n_microbatches=2, no_sync=opt.no_sync)
    runner.step(*(t[d * per : (d + 1) * per] for t in batch(0)))
    try:
        opt.step()
        lines = None
    except StepRefusedError as e:
        lines = e.lines
    unmoved = all(torch.equal(p.detach(), before[k]) for k, p in stage.named_parameters())
    return frozen, lines, unmoved


def full(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's global value (a tensor-parallel weight's), a plain tensor as it is."""
    return t.full_tensor() if isinstance(t, DTensor) else t


@functools.cache
def pipelined_4():
    return run_ranks(_pipelined_4, 4)


@pytest.mark.parametrize("config", ["tiny", "tiny-moe"])
def test_pipeline_by_data_parallel_steps_equal_the_single_process(config):
    losses, params = reference_steps(config)
    for result in pipelined_4():
        got, stage_params = result[config]
        assert got == pytest.approx(losses, rel=TOL, abs=0)
        for name, p in stage_params.items():
            assert rel(p, params[name]) <= TOL, name


def test_pipeline_of_a_tensor_parallel_model_equals_the_single_process():
    loss, _, _ = reference_grads("tiny")
    model = make_model("tiny")
    x, y = batch(0)
    lm_loss(model(x), y).backward()
    for result in pipelined_4():
        got, grads = result["tp"]
        assert abs(got - loss) <= TOL * abs(loss)
        for name, g in grads.items():
            assert rel(g, dict(model.named_parameters())[name].grad) <= TOL, name


def test_four_stages_equal_the_single_process():
    """Stages 1 and 2 neither embed nor compute the loss: they pass hidden states and
    their gradients on in both directions."""
    model = make_model("tiny-deep")
    x, y = batch(0)
    loss = lm_loss(model(x), y)
    loss.backward()
    want = dict(model.named_parameters())
    held = []
    for result in pipelined_4():
        got, grads = result["deep"]
        assert abs(got - loss.item()) <= TOL * loss.item()
        for name, g in grads.items():
            assert rel(g, want[name].grad) <= TOL, name
        held += grads
    assert sorted(held) == sorted(want)


def test_pipeline_of_an_expert_parallel_model_equals_the_single_process():
    """pp 2 x dp 2 x ep 2: each stage's MoE layers dispatch their tokens over the ep group
    inside the schedule; dense gradients averaged over dp, expert ones (summed over ep by
    the dispatch) divided by dp, equal the single-process gradients of the whole batch."""
    model = make_model("tiny-moe")
    x, y = batch(0)
    loss = lm_loss(model(x), y)
    loss.backward()
    want = dict(model.named_parameters())
    for result in pipelined_4():
        got, grads = result["ep"]
        assert abs(got - loss.item()) <= TOL * loss.item()
        for name, (g, rows) in grads.items():
            assert rel(g, want[name].grad[rows]) <= TOL, name


def test_a_refusal_on_one_stage_stops_every_stage():
    """A parameter frozen after the optimizer was built on one rank of stage 1: that rank
    names it, every other rank of both stages refuses too (pipeline stages step together or
    not at all), and no weight moved anywhere."""
    for rank, res in enumerate(pipelined_4()):
        frozen, lines, unmoved = res["refused"]
        assert unmoved, rank
        if rank == 3:
            assert len(lines) == 1 and f"{frozen!r} was frozen" in lines[0], lines
        else:
            assert lines == [ELSEWHERE], (rank, lines)
