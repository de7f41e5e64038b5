"""The misuses behind known defects of other libraries (DeepSpeed's Muon: off under deferred
init, Newton-Schulz per micro-batch under accumulation, clipping of the wrong gradients), each
either equal to the single-process full-batch run or refused with its line on every rank
before any weight moves, through every path: the hybrid on one process, the layer-wise driver
with and without DistributedDataParallel, and FSDPOptimizer over FSDP2. tests/test_guards.py
holds the guards' own tests; this file fills in the paths they leave.

Equivalence runs in float64: the only difference from the single-process run is the order in
which the micro-batches' and ranks' gradients are summed (a relative rounding of ~1e-16 per
element), which the steps of Newton-Schulz (coefficients up to |4.8|, 5 iterations) and AdamW
(dividing by the root of small second moments) may grow over STEPS steps: the tolerance is
REL = 1e-11 of each parameter's norm, test_guards.py's for FSDP2 (measured: 1.5e-15 at most).

One spawn of 2 gloo ranks runs every distributed leg (the suite's time)."""

import functools

import pytest
import torch
from torch import nn

import models.fsdp as FS
import models.layerwise as LW
from orthoptim import FSDPOptimizer, build_optimizer
from orthoptim.collectives import CollectiveDeviceError
from orthoptim.optim.guards import REBUILD, SteppedTwiceError
from orthoptim.parallel import LayerwiseDistributedOptimizer
from orthoptim.parallel.base import ELSEWHERE, StepRefusedError

from distributed import run_ranks

STEPS, MICRO, MAX_NORM, REL = 3, 2, 0.5, 1e-11
F64 = torch.float64


def weights(model):
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def unmoved(model, before):
    return all(torch.equal(p.detach(), before[n]) for n, p in model.named_parameters())


def assert_close(got, want, label):
    for n, w in want.items():
        err = ((got[n] - w).norm() / w.norm()).item()
        assert err <= REL, f"{label} {n}: relative error {err:.1e} > {REL}"


def lw_model():
    return LW.make_model().to(F64)


def micro_batches(suite, step, rank=0, world_size=1, micro=MICRO):
    """This rank's share of `suite`'s batch of `step`, as `micro` micro-batches."""
    x, y = suite.batch(step)
    per = suite.BATCH // world_size
    x, y = x[rank * per : (rank + 1) * per], y[rank * per : (rank + 1) * per]
    chunk = per // micro
    return [(x[m * chunk : (m + 1) * chunk], y[m * chunk : (m + 1) * chunk]) for m in range(micro)]


@functools.cache
def full_batch(suite_name, clip=None):
    """Single process, float64, the whole batch in one backward: (norms, final weights)."""
    suite = LW if suite_name == "lw" else FS
    model = lw_model() if suite is LW else FS.make_model(F64)
    kw = LW.CONFIGS["hybrid"] if suite is LW else FS.KW
    opt = build_optimizer(model, **kw)
    norms = []
    for step in range(STEPS):
        suite.loss_fn(model, *suite.batch(step)).backward()
        if clip is not None:
            norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), clip).item())
        opt.step()
        opt.zero_grad()
    return norms, weights(model)


# -- one process ---------------------------------------------------------------------------


def accumulate(model, opt, steps=STEPS, no_sync=None, rank=0, world_size=1, suite=LW, wrap=None):
    """`steps` steps, each of MICRO micro-batches (loss / MICRO) of this rank's share, every
    backward but the last inside `no_sync()` when given; `wrap` runs the forward."""
    forward = wrap if wrap is not None else model
    for step in range(steps):
        parts = micro_batches(suite, step, rank, world_size)
        for m, (x, y) in enumerate(parts):
            last = m == len(parts) - 1
            with no_sync() if no_sync is not None and not last else _nothing():
                (suite.loss_fn(forward, x, y) / len(parts)).backward()
        opt.step()
        opt.zero_grad()
    if hasattr(opt, "wait_for_params"):
        opt.wait_for_params()
    return weights(model)


class _nothing:
    def __enter__(self):
        return self

    def __exit__(self, *a):
        return False


@pytest.mark.parametrize("path", ["hybrid", "layerwise"])
def test_single_process_accumulation_equals_the_full_batch(path):
    """MICRO micro-batches accumulated before one step() equal one full-batch step: the hybrid,
    and the layer-wise driver at world size 1 (nothing to reduce: no no_sync() needed);
    Newton-Schulz ran once per step on the accumulated gradient."""
    model = lw_model()
    if path == "hybrid":
        opt = build_optimizer(model, **LW.CONFIGS["hybrid"])
    else:
        opt = LayerwiseDistributedOptimizer(model, **LW.CONFIGS["hybrid"])
    assert_close(accumulate(model, opt), full_batch("lw")[1], path)


def test_a_parameter_given_to_a_second_inner_optimizer_is_refused_before_its_second_step():
    """A Muon matrix added to the hybrid's inner AdamW behind its back (`opt.inner["adamw"]
    .add_param_group`, which the hybrid's own add_param_group would refuse): the step raises
    naming the parameter and both optimizers before AdamW moves anything; Muon stepped each
    matrix once."""
    ref_model, model = LW.make_model(), LW.make_model()
    ref = build_optimizer(ref_model, **LW.CONFIGS["hybrid"])
    opt = build_optimizer(model, **LW.CONFIGS["hybrid"])
    fc = model.blocks[0].fc.weight
    opt.inner["adamw"].add_param_group({"params": [fc], "param_names": ["blocks.0.fc.weight"]})
    before = weights(model)
    for m in (ref_model, model):
        LW.loss_fn(m, *LW.batch(0)).backward()
    ref.step()
    with pytest.raises(SteppedTwiceError, match=r"'blocks.0.fc.weight'.*by Muon, then by AdamW"):
        opt.step()
    moved = weights(ref_model)
    muon = {n for g in opt.inner["muon"].param_groups for n in g["param_names"]}
    for n, p in model.named_parameters():
        assert torch.equal(p.detach(), moved[n] if n in muon else before[n]), n


class LayerwiseSteppingTwice(LayerwiseDistributedOptimizer):
    """A driver whose step runs its inner optimizer twice (as stepping `opt.inner` by hand
    inside the step would)."""

    def _step_owned(self, present):
        super()._step_owned(present)
        super()._step_owned(present)


def test_the_layerwise_driver_refuses_an_inner_step_taken_twice():
    """The driver's step is one scope of the stepped-once ledger: a matrix about to be
    stepped a second time in it is named, by Muon twice (world size 1, in process)."""
    model = LW.make_model()
    opt = LayerwiseSteppingTwice(model, **LW.CONFIGS["hybrid"])
    LW.loss_fn(model, *LW.batch(0)).backward()
    with pytest.raises(
        SteppedTwiceError, match=r"'blocks\.\d\.\w+\.weight'.*by Muon, then by Muon"
    ):
        opt.step()


# -- 2 ranks -------------------------------------------------------------------------------


def refused(model, opt, backward, before_step=None):
    """`backward()`, then `before_step()`, then step(): (error type, its lines or message,
    whether no weight moved), or None when the step ran."""
    before = weights(model)
    backward()
    if before_step is not None:
        before_step()
    try:
        opt.step()
    except StepRefusedError as e:
        return "StepRefusedError", e.lines, unmoved(model, before)
    except (RuntimeError, SteppedTwiceError) as e:
        return type(e).__name__, str(e), unmoved(model, before)
    finally:
        opt.zero_grad()
    return None


def rank_batch(rank, world_size, suite=LW, step=0):
    x, y = suite.batch(step)
    per = suite.BATCH // world_size
    return x[rank * per : (rank + 1) * per], y[rank * per : (rank + 1) * per]


def _clipping(rank, world_size):
    """The layer-wise driver unwrapped: torch's clip_grad_norm_ of the model's (unreduced)
    gradients on every rank, on rank 0 alone, and before opt.clip_grad_norm_; each refusal
    followed by a step that runs; then opt.clip_grad_norm_ in float64 for STEPS steps."""
    out = {}
    model = LW.make_model()
    opt = LayerwiseDistributedOptimizer(model, **LW.CONFIGS["hybrid"], bucket_mb=0.03)
    x, y = rank_batch(rank, world_size)

    def torch_clip():
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05)

    out["every_rank"] = refused(model, opt, lambda: LW.loss_fn(model, x, y).backward(), torch_clip)
    out["one_rank"] = refused(
        model, opt, lambda: LW.loss_fn(model, x, y).backward(), torch_clip if rank == 0 else None
    )

    def then_opt_clip():  # torch's on rank 0 alone, then the driver's on every rank
        if rank == 0:
            torch_clip()
        opt.clip_grad_norm_(MAX_NORM)

    out["then_opt_clip"] = refused(
        model, opt, lambda: LW.loss_fn(model, x, y).backward(), then_opt_clip
    )
    before = weights(model)
    out["after"] = refused(model, opt, lambda: LW.loss_fn(model, x, y).backward())
    opt.wait_for_params()
    out["after_moved"] = not unmoved(model, before)
    out["after_weights"] = weights(model)

    model = lw_model()
    opt = LayerwiseDistributedOptimizer(model, **LW.CONFIGS["hybrid"], bucket_mb=0.03)
    norms = []
    for step in range(STEPS):
        LW.loss_fn(model, *rank_batch(rank, world_size, step=step)).backward()
        norms.append(opt.clip_grad_norm_(MAX_NORM).item())
        opt.step()
        opt.zero_grad()
    opt.wait_for_params()
    out["opt_clip"] = norms, weights(model)
    return out


def _layerwise_accumulation(rank, world_size):
    """float64, MICRO micro-batches per rank: unwrapped with opt.no_sync(); under a DDP wrap
    with DDP's no_sync(); under a DDP wrap with opt.no_sync() (DDP reduces every micro-batch)."""
    out = {}
    model = lw_model()
    opt = LayerwiseDistributedOptimizer(model, **LW.CONFIGS["hybrid"], bucket_mb=0.03)
    out["no_sync"] = accumulate(model, opt, no_sync=opt.no_sync, rank=rank, world_size=world_size)
    for how in ("ddp_no_sync", "ddp_opt_no_sync"):
        model = lw_model()
        opt = LayerwiseDistributedOptimizer(model, **LW.CONFIGS["hybrid"], bucket_mb=0.03)
        ddp = nn.parallel.DistributedDataParallel(model, find_unused_parameters=True)
        no_sync = ddp.no_sync if how == "ddp_no_sync" else opt.no_sync
        out[how] = accumulate(
            model, opt, no_sync=no_sync, rank=rank, world_size=world_size, wrap=ddp
        )
    return out


def _built_too_early(rank, world_size):
    """Deferred init (a model on the meta device) under both drivers; the layer-wise driver
    built before fully_shard(model)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    out = {}
    mesh = init_device_mesh("cpu", (world_size,))
    with torch.device("meta"):
        model = FS.TinyGPT()
    for b in model.blocks:
        fully_shard(b, mesh=mesh)
    fully_shard(model, mesh=mesh)
    try:
        FSDPOptimizer(model, bucket_mb=0.01, **FS.KW)
        out["fsdp_meta"] = None
    except CollectiveDeviceError as e:
        out["fsdp_meta"] = str(e)
    with torch.device("meta"):
        model = LW.TinyGPT()
    try:
        LayerwiseDistributedOptimizer(model, **LW.CONFIGS["hybrid"])
        out["layerwise_meta"] = None
    except CollectiveDeviceError as e:
        out["layerwise_meta"] = str(e)

    model = LW.make_model()
    opt = LayerwiseDistributedOptimizer(model, **LW.CONFIGS["hybrid"])
    fully_shard(model, mesh=mesh)
    x, y = rank_batch(rank, world_size)
    out["rewrapped"] = refused(model, opt, lambda: LW.loss_fn(model, x, y).backward())
    out["trainable"] = [n for n, p in model.named_parameters() if p.requires_grad]
    return out


class FSDPSteppingTwice(FSDPOptimizer):
    """A driver whose step runs its optimizers twice."""

    def _step_owned(self, present):
        super()._step_owned(present)
        super()._step_owned(present)


def _fsdp(rank, world_size):
    """FSDPOptimizer: a parameter frozen after it was built; step() inside its no_sync(); an
    inner step taken twice; accumulation with FSDP2's set_requires_gradient_sync(False)."""
    out = {}
    x, y = rank_batch(rank, world_size, FS)
    model = FS.sharded_model(world_size)
    opt = FSDPOptimizer(model, bucket_mb=0.01, **FS.KW)
    model.blocks[0].fc.weight.requires_grad_(False)
    out["frozen"] = refused(model, opt, lambda: FS.loss_fn(model, x, y).backward())

    model = FS.sharded_model(world_size)
    opt = FSDPOptimizer(model, bucket_mb=0.01, **FS.KW)
    with opt.no_sync():
        out["no_sync"] = refused(model, opt, lambda: FS.loss_fn(model, x, y).backward())

    model = FS.sharded_model(world_size)
    opt = FSDPSteppingTwice(model, bucket_mb=0.01, **FS.KW)
    out["twice"] = refused(model, opt, lambda: FS.loss_fn(model, x, y).backward())

    model = FS.sharded_model(world_size, F64)
    opt = FSDPOptimizer(model, bucket_mb=0.01, **FS.KW)

    def gradient_sync(on):
        model.set_requires_gradient_sync(on)
        return _nothing()

    for step in range(STEPS):
        parts = micro_batches(FS, step, rank, world_size)
        for m, (xs, ys) in enumerate(parts):
            with gradient_sync(m == len(parts) - 1):
                (FS.loss_fn(model, xs, ys) / len(parts)).backward()
        opt.step()
        opt.zero_grad()
    out["accumulated"] = {n: p.full_tensor().detach().clone() for n, p in model.named_parameters()}
    return out


def _legs(rank, world_size):
    return {
        "clipping": _clipping(rank, world_size),
        "layerwise": _layerwise_accumulation(rank, world_size),
        "early": _built_too_early(rank, world_size),
        "fsdp": _fsdp(rank, world_size),
    }


@pytest.fixture(scope="module")
def ranks():
    return run_ranks(_legs, 2, timeout=60)


def test_torch_clipping_on_every_rank_is_refused_on_every_rank(ranks):
    """torch.nn.utils.clip_grad_norm_(model.parameters()) between backward and step() of the
    unwrapped layer-wise driver clips each rank's unreduced gradients by a norm that is not
    the model's: every rank refuses, naming opt.clip_grad_norm_, and no weight moves."""
    for res in ranks:
        kind, lines, still = res["clipping"]["every_rank"]
        assert kind == "StepRefusedError" and still
        assert len(lines) == 1 and "opt.clip_grad_norm_(max_norm)" in lines[0], lines


def test_torch_clipping_on_one_rank_is_refused_on_every_rank_without_a_hang(ranks):
    """Only rank 0 clipped: rank 0 names it, rank 1 says another rank refused; neither moved
    a weight or waits for the other, and the next step runs on both, to the same weights."""
    (k0, lines0, still0), (k1, lines1, still1) = (r["clipping"]["one_rank"] for r in ranks)
    assert k0 == k1 == "StepRefusedError" and still0 and still1
    assert len(lines0) == 1 and "changed in place" in lines0[0], lines0
    assert lines1 == [ELSEWHERE]
    for res in ranks:
        assert res["clipping"]["after"] is None and res["clipping"]["after_moved"]
        for n, p in res["clipping"]["after_weights"].items():
            assert torch.equal(p, ranks[0]["clipping"]["after_weights"][n]), n


def test_torch_clipping_on_one_rank_before_opt_clip_grad_norm_is_refused_without_a_hang(ranks):
    """Rank 0 clipped with torch, then every rank called opt.clip_grad_norm_: the driver's
    clipping runs its collectives on every rank alike, and the step after it is refused on
    every rank (rank 0 naming torch's clipping, rank 1 another rank), no weight moved."""
    (k0, lines0, still0), (k1, lines1, still1) = (r["clipping"]["then_opt_clip"] for r in ranks)
    assert k0 == k1 == "StepRefusedError" and still0 and still1
    assert len(lines0) == 1 and "opt.clip_grad_norm_(max_norm)" in lines0[0], lines0
    assert lines1 == [ELSEWHERE]


def test_opt_clip_grad_norm_equals_single_process_clipping_of_the_averaged_gradients(ranks):
    """opt.clip_grad_norm_ returns the norm of the averaged gradients (as torch's on one
    process over the full batch) and clips by it: norms to 1e-12, weights after STEPS clipped
    steps to REL, on every rank."""
    want_norms, want = full_batch("lw", clip=MAX_NORM)
    assert all(n > MAX_NORM for n in want_norms)  # clipping acted
    for res in ranks:
        norms, got = res["clipping"]["opt_clip"]
        assert norms == pytest.approx(want_norms, rel=1e-12, abs=0)
        assert_close(got, want, "opt.clip_grad_norm_")


@pytest.mark.parametrize("how", ["no_sync", "ddp_no_sync", "ddp_opt_no_sync"])
def test_layerwise_accumulation_equals_the_single_process_full_batch(ranks, how):
    """MICRO micro-batches per rank at 2 ranks equal the full batch on one process: unwrapped
    inside opt.no_sync(); under DistributedDataParallel inside DDP's no_sync() (HF Trainer,
    accelerate); under DDP inside opt.no_sync() (DDP then reduces every micro-batch)."""
    _, want = full_batch("lw")
    for res in ranks:
        assert_close(res["layerwise"][how], want, how)


def test_fsdp_accumulation_without_gradient_sync_equals_the_single_process_full_batch(ranks):
    """FSDP2's set_requires_gradient_sync(False) for every micro-batch but the last (ZeRO-3
    accumulation, where DeepSpeed ran Newton-Schulz per micro-batch): one full-batch step."""
    _, want = full_batch("fs")
    for res in ranks:
        assert_close(res["fsdp"]["accumulated"], want, "fsdp")


def test_both_drivers_refuse_a_model_still_on_the_meta_device(ranks):
    """Built under deferred init (DeepSpeed's zero.Init defect: Muon silently off), both
    drivers refuse at construction, naming the parameter and where it must live."""
    for res in ranks:
        for key in ("fsdp_meta", "layerwise_meta"):
            message = res["early"][key]
            assert message is not None and "'tok.weight'" in message and "meta" in message


def test_the_layerwise_driver_refuses_a_model_sharded_after_it_was_built(ranks):
    """fully_shard(model) after the layer-wise driver was built replaces every parameter:
    every rank's step names each one as replaced and moves nothing."""
    for res in ranks:
        kind, lines, still = res["early"]["rewrapped"]
        assert kind == "StepRefusedError" and still
        assert len(lines) == len(res["early"]["trainable"])
        for name, line in zip(res["early"]["trainable"], lines):
            assert f"{name!r} was replaced" in line and REBUILD in line, line


def test_fsdp_refuses_a_frozen_parameter_and_a_step_inside_no_sync(ranks):
    """FSDPOptimizer: a parameter frozen after it was built, and step() inside its no_sync(),
    are refused on every rank with their line, before any weight moves."""
    for res in ranks:
        kind, lines, still = res["fsdp"]["frozen"]
        assert kind == "StepRefusedError" and still
        assert len(lines) == 1 and "'blocks.0.fc.weight' was frozen" in lines[0], lines
        kind, lines, still = res["fsdp"]["no_sync"]
        assert kind == "StepRefusedError" and still
        assert len(lines) == 1 and "inside no_sync()" in lines[0], lines


def test_fsdp_refuses_a_matrix_stepped_twice_in_one_step(ranks):
    """An FSDPOptimizer step that runs its optimizers twice: the matrix optimizer's second
    pass names a matrix, by Muon twice, on every rank."""
    for res in ranks:
        kind, message, _ = res["fsdp"]["twice"]
        assert kind == "SteppedTwiceError"
        assert "by Muon, then by Muon" in message and "'blocks." in message, message
