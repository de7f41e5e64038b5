"""The guards every step runs: a parameter set changed after the optimizer was built, a step
inside no_sync(), a parameter stepped twice in one step are each refused with one line naming
the parameter, the cause and the fix, before any weight moves; the misuses behind known
defects of other libraries (an optimizer built under deferred init, accumulation) are either
refused or equal to the plain single-process run."""

import pytest
import torch
from torch import nn

import models.fsdp as fsdp_model
from models.layerwise import CONFIGS, TinyGPT, batch, loss_fn, make_model
from orthoptim import FSDPOptimizer, build_optimizer
from orthoptim.optim.guards import REBUILD, ParameterSetError, SteppedTwiceError
from orthoptim.optim.hybrid import HybridOptimizer
from orthoptim.parallel import LayerwiseDistributedOptimizer
from orthoptim.parallel.base import ELSEWHERE, StepRefusedError

from distributed import run_ranks


def weights(model):
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def assert_unmoved(model, before):
    for n, p in model.named_parameters():
        if n in before:
            assert torch.equal(p.detach(), before[n]), n


def refused_step(model, opt):
    """Backward on one batch, then the step's error (None if it stepped); the weights must
    not have moved when it was refused."""
    before = weights(model)
    loss_fn(model, *batch(0)).backward()
    try:
        opt.step()
    except (ParameterSetError, StepRefusedError) as e:
        assert_unmoved(model, before)
        return e
    return None


def eager_run(model, steps=3):
    opt = build_optimizer(model, **CONFIGS["hybrid"])
    for step in range(steps):
        loss_fn(model, *batch(step)).backward()
        opt.step()
        opt.zero_grad()
    return weights(model)


def materialized(state):
    """A model built on the meta device, materialized and loaded with `state`."""
    with torch.device("meta"):
        model = TinyGPT()
    model.to_empty(device="cpu")
    model.lm_head.weight = model.tok.weight
    model.load_state_dict(state)
    return model


def test_an_optimizer_built_under_deferred_init_is_refused_and_built_after_is_exact():
    """Built on the meta device and materialized later (DeepSpeed's zero.Init defect: Muon
    silently off), the step names every parameter as replaced and moves nothing; built after
    materializing, the run equals the eagerly built model's bit for bit."""
    state = make_model().state_dict()
    with torch.device("meta"):
        model = TinyGPT()
    opt = build_optimizer(model, **CONFIGS["hybrid"])
    model.to_empty(device="cpu")
    model.lm_head.weight = model.tok.weight
    model.load_state_dict(state)
    err = refused_step(model, opt)
    assert isinstance(err, ParameterSetError)
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    assert sorted(err.names) == sorted(trainable)
    assert "'blocks.0.fc.weight' was replaced by a new tensor" in str(err)
    assert str(err).count(REBUILD) == len(trainable)

    ref = eager_run(make_model())
    got = eager_run(materialized(state))
    for n, p in ref.items():
        assert torch.equal(got[n], p), n


@pytest.mark.parametrize("change", ["reassigned", "frozen", "added", "removed"])
def test_the_hybrid_names_a_parameter_changed_after_it_was_built(change):
    """A module re-assigned, a parameter frozen, one registered, one deleted after
    build_optimizer(model): the step raises one line for each, naming it and the cause, and
    no weight moves."""
    model = make_model()
    opt = build_optimizer(model, **CONFIGS["hybrid"])
    if change == "reassigned":
        model.blocks[0].fc = nn.Linear(32, 128)
        expected = {"blocks.0.fc.weight": "replaced", "blocks.0.fc.bias": "replaced"}
    elif change == "frozen":
        model.blocks[1].proj.weight.requires_grad_(False)
        expected = {"blocks.1.proj.weight": "frozen"}
    elif change == "added":
        model.scale = nn.Parameter(torch.ones(()))
        expected = {"scale": "added"}
    else:
        del model.blocks[1].ln2.bias
        model.blocks[1].ln2.bias = None
        expected = {"blocks.1.ln2.bias": "no longer a parameter"}
    err = refused_step(model, opt)
    assert isinstance(err, ParameterSetError), err
    assert sorted(err.names) == sorted(expected)
    lines = str(err).splitlines()
    assert len(lines) == len(expected)
    for name, cause in expected.items():
        (line,) = [x for x in lines if repr(name) in x]
        assert cause in line and REBUILD in line, line


def test_a_subset_given_to_build_optimizer_is_not_refused_for_what_it_leaves_out():
    """Parameters the caller left out of build_optimizer(params=...) are not the optimizer's
    to step: the step runs and moves only the given ones."""
    model = make_model()
    given = [(n, p) for n, p in model.named_parameters() if n.startswith("blocks.0.")]
    opt = build_optimizer(model, params=given, **CONFIGS["hybrid"])
    before = weights(model)
    assert refused_step(model, opt) is None
    for n, p in model.named_parameters():
        assert torch.equal(p.detach(), before[n]) != n.startswith("blocks.0."), n


def test_add_param_group_refuses_a_parameter_the_optimizer_already_steps():
    model = make_model()
    opt = build_optimizer(model, **CONFIGS["hybrid"])
    with pytest.raises(ValueError, match=r"blocks\.0\.fc\.weight.*already stepped"):
        opt.add_param_group({"params": [model.blocks[0].fc.weight], "optimizer": "adamw"})


class SteppingTwice(HybridOptimizer):
    """A composite whose step runs its inner optimizers twice (as a loop stepping an inner
    optimizer on its own, inside the outer step, would)."""

    def _update(self):
        super()._update()
        super()._update()


def test_a_parameter_stepped_twice_in_one_step_is_refused_before_its_second_step():
    """The second step of a parameter within one optimizer step raises naming it and both
    optimizers; the weights are those of one step of the plain optimizer."""
    ref_model, model = make_model(), make_model()
    ref = build_optimizer(ref_model, **CONFIGS["muon"])
    opt = SteppingTwice(build_optimizer(model, **CONFIGS["muon"]).inner)
    for m in (ref_model, model):
        loss_fn(m, *batch(0)).backward()
    ref.step()
    with pytest.raises(SteppedTwiceError, match=r"'tok\.weight'.*second.*by Muon, then by Muon"):
        opt.step()
    moved = weights(ref_model)
    for n, p in model.named_parameters():
        assert torch.equal(p.detach(), moved[n]), n


def _distributed_guards(rank, world_size):
    out = {}

    def attempt(model, opt):
        err = refused_step(model, opt)
        return None if err is None else (type(err).__name__, err.lines)

    model = make_model()
    opt = LayerwiseDistributedOptimizer(model, **CONFIGS["hybrid"])
    model.blocks[0].fc.weight.requires_grad_(False)
    out["frozen"] = attempt(model, opt)
    opt.zero_grad()
    model.blocks[0].fc.weight.requires_grad_(True)  # fixed: the next step runs
    before = weights(model)
    out["fixed"] = attempt(model, opt)
    opt.wait_for_params()  # the updated parameters arrive by an asynchronous gather
    out["fixed_moved"] = not torch.equal(
        model.blocks[0].fc.weight.detach(), before["blocks.0.fc.weight"]
    )

    model = make_model()
    opt = LayerwiseDistributedOptimizer(model, **CONFIGS["hybrid"])
    if rank == 1:
        model.blocks[1].proj.weight.requires_grad_(False)
    out["one_rank"] = attempt(model, opt)

    model = make_model()
    opt = LayerwiseDistributedOptimizer(model, **CONFIGS["hybrid"])
    with opt.no_sync():
        out["no_sync"] = attempt(model, opt)

    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    model = make_model()
    opt = build_optimizer(model, **CONFIGS["hybrid"])
    fully_shard(model, mesh=init_device_mesh("cpu", (world_size,)))
    err = refused_step(model, opt)
    out["rewrapped"] = err.names if isinstance(err, ParameterSetError) else err
    out["trainable"] = [n for n, p in model.named_parameters() if p.requires_grad]
    out["fsdp_accumulated"] = fsdp_accumulated(rank, world_size)
    return out


ACCUMULATED_STEPS, MICRO = 3, 2


def fsdp_accumulated(rank, world_size):
    """FSDP2 in float64, each rank's share of the batch as MICRO accumulated micro-batches:
    this rank's shard of every parameter after ACCUMULATED_STEPS steps."""
    model = fsdp_model.sharded_model(world_size, torch.float64)
    opt = FSDPOptimizer(model, bucket_mb=0.01, **fsdp_model.KW)
    per = fsdp_model.BATCH // world_size
    chunk = per // MICRO
    for step in range(ACCUMULATED_STEPS):
        x, y = fsdp_model.batch(step)
        x, y = x[rank * per : (rank + 1) * per], y[rank * per : (rank + 1) * per]
        for m in range(MICRO):
            xs, ys = x[m * chunk : (m + 1) * chunk], y[m * chunk : (m + 1) * chunk]
            (fsdp_model.loss_fn(model, xs, ys) / MICRO).backward()
        opt.step()
        opt.zero_grad()
    return {n: p.to_local().detach().clone() for n, p in model.named_parameters()}


@pytest.fixture(scope="module")
def distributed():
    return run_ranks(_distributed_guards, 2, timeout=60)


def test_the_layerwise_driver_refuses_a_frozen_parameter_on_every_rank(distributed):
    """Frozen after the driver was built, on every rank: each rank's step raises naming it
    and moves nothing; unfrozen again, the next step runs."""
    for res in distributed:
        kind, lines = res["frozen"]
        assert kind == "StepRefusedError"
        assert len(lines) == 1 and "'blocks.0.fc.weight' was frozen" in lines[0], lines
        assert res["fixed"] is None and res["fixed_moved"]


def test_a_change_on_one_rank_is_refused_on_every_rank_without_a_hang(distributed):
    """Only rank 1 froze a parameter: rank 1 names it, rank 0 says another rank refused;
    neither moved a weight, and neither waits for the other."""
    kind0, lines0 = distributed[0]["one_rank"]
    kind1, lines1 = distributed[1]["one_rank"]
    assert kind0 == kind1 == "StepRefusedError"
    assert lines0 == [ELSEWHERE]
    assert len(lines1) == 1 and "'blocks.1.proj.weight' was frozen" in lines1[0], lines1


def test_a_step_inside_no_sync_is_refused_on_every_rank(distributed):
    """step() inside no_sync() would run Newton-Schulz per micro-batch on unreduced
    gradients: every rank refuses, naming no_sync() and where step() belongs."""
    for res in distributed:
        kind, lines = res["no_sync"]
        assert kind == "StepRefusedError"
        assert len(lines) == 1 and "inside no_sync()" in lines[0]
        assert "after the last micro-batch" in lines[0]


def test_a_model_sharded_after_the_optimizer_was_built_is_refused(distributed):
    """fully_shard(model) after build_optimizer(model) replaces every parameter by a
    DTensor the optimizer does not hold: the step names each one and moves nothing."""
    for res in distributed:
        assert sorted(res["rewrapped"]) == sorted(res["trainable"]), res["rewrapped"]


def test_fsdp_accumulation_equals_the_single_process_full_batch(distributed):
    """ZeRO-3-style accumulation (DeepSpeed ran Newton-Schulz per micro-batch there): two
    accumulated micro-batches per rank under FSDP2 equal one full-batch step of the
    single-process optimizer, in float64 to the rounding of the gradients' summation order
    (~1e-16, grown by 3 steps of Newton-Schulz and AdamW)."""
    model = fsdp_model.make_model(torch.float64)
    opt = build_optimizer(model, **fsdp_model.KW)
    start = weights(model)
    for step in range(ACCUMULATED_STEPS):
        fsdp_model.loss_fn(model, *fsdp_model.batch(step)).backward()
        opt.step()
        opt.zero_grad()
    for n, ref in model.named_parameters():
        got = torch.cat([r["fsdp_accumulated"][n] for r in distributed])
        assert (got - ref).norm() <= 1e-11 * ref.norm(), n
        assert not torch.equal(ref, start[n]) or n.endswith("bias"), n
