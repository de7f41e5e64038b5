"""The layer-wise optimizer's memory layout: parameters and gradients are views of each
group's flat buffers (nothing model-sized held twice), padding at most `MAX_PADDING` at any
world size, and bf16 parameters with fp32 masters on their owners, against a single-process
bf16 reference with fp32 masters that rounds the same way."""

import pytest
import torch
from torch import nn

from models.layerwise import (
    BATCH,
    CONFIGS,
    TinyGPT,
    batch,
    bf16_reference,
    loss_fn,
    make_model,
    reference_piece,
)
from orthoptim import build_optimizer
from orthoptim.parallel import LayerwiseDistributedOptimizer
from orthoptim.parallel.layerwise import MAX_PADDING
from orthoptim.plan.dryrun import fake_world

from distributed import run_ranks

STEPS = 3


def _shares(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()


def _padding(opt: LayerwiseDistributedOptimizer) -> list[float]:
    """Each communicating bucket's padding as a fraction of the elements it holds."""
    out = []
    for b in opt.grad_sync.buckets:
        if b.n > 1:
            held = sum(s.numel for s in b.slots)
            out.append((b.numel - held) / held)
    return out


def _train(rank, world_size, model, opt, steps=STEPS):
    per = BATCH // world_size
    for step in range(steps):
        x, y = batch(step)
        loss_fn(
            model, x[rank * per : (rank + 1) * per], y[rank * per : (rank + 1) * per]
        ).backward()
        opt.step()
        opt.zero_grad()
    opt.wait_for_params()


def _views_and_bf16(rank, world_size):
    torch.set_num_threads(1)
    out = {}
    model = make_model()
    opt = LayerwiseDistributedOptimizer(model, **CONFIGS["hybrid"], bucket_mb=0.03)
    x, y = batch(0)
    loss_fn(model, x, y).backward()
    flats = [b for b in opt.grad_sync.buckets if b.n > 1]
    params = {n: p for n, p in model.named_parameters()}
    out["param_views"] = {n: any(_shares(p, b.params) for b in flats) for n, p in params.items()}
    out["grad_views"] = {
        n: p.grad is not None and any(_shares(p.grad, b.grads) for b in flats)
        for n, p in params.items()
    }
    out["buffers"] = [t.numel() for b in opt.grad_sync.buckets for t in b.buffers()]
    out["padding"] = _padding(opt)
    out["modes"] = {b.width is not None for b in flats}
    # a second backward without set_to_none accumulates into the same views
    opt.step()
    opt.zero_grad(set_to_none=False)
    loss_fn(model, x, y).backward()
    out["still_views"] = all(
        p.grad is not None and any(_shares(p.grad, b.grads) for b in flats)
        for n, p in params.items()
        if out["grad_views"][n]
    )
    opt.zero_grad()

    model = make_model()
    opt = LayerwiseDistributedOptimizer(
        model, **CONFIGS["hybrid"], bucket_mb=0.03, param_dtype=torch.bfloat16
    )
    out["dtypes"] = {p.dtype for p in model.parameters()}
    out["master_dtypes"] = {m.dtype for m in opt.masters().values()}
    out["state_dtypes"] = {
        v.dtype for st in opt.state.values() for v in st.values() if isinstance(v, torch.Tensor)
    }
    _train(rank, world_size, model, opt)
    out["state_dtypes"] |= {
        v.dtype for st in opt.state.values() for v in st.values() if isinstance(v, torch.Tensor)
    }
    out["bf16"] = {n: p.detach().clone() for n, p in model.named_parameters()}
    out["masters"] = {n: m.detach().clone() for n, m in opt.masters().items()}

    # what Trainer and accelerate do under torchrun: model.to(device index) after the
    # optimizer is built replaces every parameter's storage
    for move in (False, True):
        model = make_model()
        opt = LayerwiseDistributedOptimizer(model, **CONFIGS["hybrid"], bucket_mb=0.03)
        if move:
            model.to("cpu:0")
        _train(rank, world_size, model, opt)
        out[f"moved={move}"] = {n: p.detach().clone() for n, p in model.named_parameters()}
        flats = [b.params for b in opt.grad_sync.buckets if b.n > 1]
        out[f"moved={move} views"] = all(
            any(_shares(p, f) for f in flats) for p in model.parameters()
        )
    return out


@pytest.fixture(scope="module")
def two_ranks():
    return run_ranks(_views_and_bf16, 2)


def test_parameters_and_gradients_are_views_of_the_buckets(two_ranks):
    """2 gloo ranks, small buckets (rank-major and region by region): every parameter and
    its `.grad` share the storage of a bucket's flat buffers, no bucket holds a buffer of
    its own, padding stays within MAX_PADDING, and a backward after
    `zero_grad(set_to_none=False)` accumulates into the same views."""
    for res in two_ranks:
        assert all(res["param_views"].values()), res["param_views"]
        # the unused module has no gradient; every other parameter's is a view
        grads = {n for n, v in res["grad_views"].items() if not v}
        assert grads == {"unused.weight", "unused.bias"}, grads
        assert res["buffers"] == []
        assert max(res["padding"]) <= MAX_PADDING
        assert res["modes"] == {True, False}  # both layouts were exercised
        assert res["still_views"]


def test_bf16_parameters_with_fp32_masters_match_a_single_process_reference(two_ranks):
    """bf16 parameters on every rank, fp32 masters and state on the owners; after 3 steps
    the bf16 parameters and the fp32 masters equal the single-process reference's bitwise:
    the reduction of 2 ranks' fp32 gradients (g0 + g1, then / 2) is exact and order-free,
    and the inner optimizer steps the same fp32 masters on the same gradients."""
    ref_params, ref_masters = bf16_reference(
        2, STEPS, lambda masters: build_optimizer(masters, **CONFIGS["hybrid"])
    )
    for res in two_ranks:
        assert res["dtypes"] == {torch.bfloat16}
        assert res["master_dtypes"] == {torch.float32}
        assert res["state_dtypes"] <= {torch.float32, torch.int64}, res["state_dtypes"]
        for n, p in res["bf16"].items():
            assert torch.equal(p, ref_params[n].detach()), n
    owned = {}
    for res in two_ranks:
        for label, m in res["masters"].items():
            assert label not in owned, f"{label} has two owners"
            owned[label] = m
            assert torch.equal(m, reference_piece(ref_masters, label).view_as(m)), label
    # every element of every parameter has exactly one master
    total = sum(m.numel() for m in owned.values())
    assert total == sum(p.numel() for p in ref_masters.values())


@pytest.mark.parametrize("world", [8, 64, 256, 1024])
def test_padding_and_buffers_at_any_world_size(world):
    """The real optimizer on a meta model under a fake process group: at every world size
    up to 1,024 no bucket pads by more than MAX_PADDING and none holds a buffer beyond the
    parameters and gradients (the flat buffers hold each element once, plus padding)."""
    with fake_world(0, world), torch.device("meta"):
        model = TinyGPT(d=64, layers=4)
        opt = LayerwiseDistributedOptimizer(model, **CONFIGS["hybrid"], bucket_mb=0.05)
        assert max(_padding(opt)) <= MAX_PADDING
        assert [t for b in opt.grad_sync.buckets for t in b.buffers()] == []
        held = sum(p.numel() for p in model.parameters() if p.requires_grad)
        flat = sum(b.numel for b in opt.grad_sync.buckets if b.n > 1)
        assert held <= flat <= (1 + MAX_PADDING) * held
        assert all(isinstance(p, nn.Parameter) for p in model.parameters())


@pytest.mark.parametrize(("world", "bucket_mb"), [(8, 0.005), (2, 0.02)])
def test_split_experts_across_buckets_stay_views(world, bucket_mb):
    """A MoE model's experts owned per expert, in small buckets: 3-D stacks cut across
    buckets (at 2 ranks one begins at the end of a rank-major bucket, which is then laid out
    region by region); every parameter is one piece of its group's flat buffers, none is
    copied in and out."""
    from models.plan import MOE
    from orthoptim.plan.dryrun import build_model
    from orthoptim.plan.layouts import Layout
    from orthoptim.plan.model import model_from_dict

    with fake_world(0, world):
        model = build_model(model_from_dict(MOE), Layout(dp=world))
        opt = LayerwiseDistributedOptimizer(
            model, "muon", lr=0.01, split_experts=True, bucket_mb=bucket_mb
        )
        buckets: dict[int, set[int]] = {}
        for s in opt._slots:
            if s.param.ndim == 3:
                buckets.setdefault(id(s.param), set()).add(id(opt.grad_sync.bucket_of[s.unit]))
        assert max(len(b) for b in buckets.values()) > 1  # a stack across buckets
        assert opt.grad_sync.flat.copied == set()
        assert len(opt.grad_sync.flat.viewed) == sum(
            1 for p in model.parameters() if p.requires_grad
        )


def test_buckets_inside_another_range_go_last_in_the_buffers():
    """`_adjacent`: buckets by first unit, those whose units lie inside another's range (a
    unit alone in its bucket, in the middle of one being filled) after all the others, so
    the buckets of consecutive units are adjacent."""
    from types import SimpleNamespace

    from orthoptim.parallel.layerwise import _adjacent

    def bucket(*units):
        return SimpleNamespace(slots=[SimpleNamespace(unit=u) for u in units], units=units)

    a, solo, b, c = bucket(0, 1, 3, 4), bucket(2), bucket(5, 6), bucket(7)
    assert [x.units for x in _adjacent([a, solo, b, c])] == [a.units, b.units, c.units, (2,)]


def test_a_muon_that_consumes_its_gradients_steps_the_same():
    """`consumes_grads` (what the layer-wise optimizer sets on its inner Muon): the Nesterov
    update is computed in the gradient's storage, and the parameters are bitwise those of a
    Muon that keeps the gradients."""
    from orthoptim import Muon

    torch.manual_seed(0)
    keep = [nn.Parameter(torch.randn(8, 16)) for _ in range(3)]
    eat = [nn.Parameter(p.detach().clone()) for p in keep]
    a, b = Muon(keep, lr=0.02), Muon(eat, lr=0.02)
    b.consumes_grads = True
    for _ in range(3):
        grads = [torch.randn(8, 16) for _ in keep]
        for p, q, g in zip(keep, eat, grads):
            p.grad, q.grad = g.clone(), g.clone()
        a.step()
        b.step()
        assert all(torch.equal(p, q) for p, q in zip(keep, eat))
        assert all(torch.equal(p.grad, g) for p, g in zip(keep, grads))
        assert not any(torch.equal(q.grad, g) for q, g in zip(eat, grads))


def test_a_model_moved_after_the_optimizer_is_followed(two_ranks):
    """`model.to("cpu:0")` after the optimizer is built (each parameter gets new storage):
    the next forward re-points the buffers at the parameters, so training is bitwise the
    run without the move (before, the optimizer stepped and gathered into the old storage
    and the moved model never changed)."""
    for res in two_ranks:
        assert res["moved=True views"] and res["moved=False views"]
        for n, p in res["moved=False"].items():
            assert torch.equal(res["moved=True"][n], p), n
        assert any(
            not torch.equal(p, q)
            for p, q in zip(res["moved=True"].values(), make_model().parameters())
        )


def test_a_load_without_masters_takes_them_from_the_loaded_weights():
    """An fp32 run's checkpoint (no masters) into a bf16-parameter optimizer whose model was
    loaded after the optimizer was built (what a resume at another --param-dtype does): the
    masters follow the loaded weights, not the weights at construction; a bf16 run's own
    checkpoint restores its fp32 masters exactly."""
    trained = make_model()
    opt = LayerwiseDistributedOptimizer(trained, **CONFIGS["hybrid"])
    _train(0, 1, trained, opt, steps=1)
    saved = opt.state_dict()
    model = make_model(seed=1)  # other weights at construction
    bf16 = LayerwiseDistributedOptimizer(model, **CONFIGS["hybrid"], param_dtype=torch.bfloat16)
    model.load_state_dict(trained.state_dict())
    bf16.load_state_dict(saved)
    params = dict(model.named_parameters())
    for name, master in bf16.masters().items():
        assert torch.equal(master, params[name].detach().float()), name
    _train(0, 1, model, bf16, steps=1)
    again = LayerwiseDistributedOptimizer(
        make_model(), **CONFIGS["hybrid"], param_dtype=torch.bfloat16
    )
    again.load_state_dict(bf16.state_dict())
    for name, master in again.masters().items():
        assert torch.equal(master, bf16.masters()[name]), name
