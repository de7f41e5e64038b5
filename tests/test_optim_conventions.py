"""torch.optim conventions every optimizer object of orthoptim keeps (issue 31): copies and
pickles step like the original, `defaults` serve schedulers, global step hooks fire once per
step, the hybrid's `add_param_group` takes a group without names, Hugging Face `Conv1D`
weights get the LR scale of their map, raw tables route by the documented rule whatever
module holds them, and the string options' `Literal` types match the accepted values."""

from __future__ import annotations

import copy
import functools
import io
import pickle
import types
import typing
import warnings

import pytest
import torch
from torch import nn

from orthoptim import build_optimizer
from orthoptim.newton_schulz import newton_schulz
from orthoptim.optim import SOAP, AdaMuon, Lion, Muon, NorMuon, PolarGrad, Scion
from orthoptim.parallel import LayerwiseDistributedOptimizer
from orthoptim.parallel.fsdp import FSDPOptimizer

from distributed import run_ranks

VOCAB, WIDTH = 11, 8


class Tiny(nn.Module):
    """An embedding, two hidden matrices of different shapes, a head and vectors."""

    def __init__(self) -> None:
        super().__init__()
        self.tok = nn.Embedding(VOCAB, WIDTH)
        self.fc = nn.Linear(WIDTH, 2 * WIDTH)
        self.proj = nn.Linear(2 * WIDTH, WIDTH)
        self.lm_head = nn.Linear(WIDTH, VOCAB, bias=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.proj(torch.tanh(self.fc(self.tok(idx)))))


def tiny(seed: int = 0) -> Tiny:
    torch.manual_seed(seed)
    return Tiny()


def matrices(model: nn.Module) -> list[nn.Parameter]:
    return [model.fc.weight, model.proj.weight]


def via_pickle(opt):
    return pickle.loads(pickle.dumps(opt))


def via_torch_save(opt):
    buf = io.BytesIO()
    torch.save(opt, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=False)


COPIES = {"deepcopy": copy.deepcopy, "pickle": via_pickle, "torch.save": via_torch_save}

# Each builds an optimizer with non-default attributes a copy must keep (nonfinite="skip",
# a custom orthogonalizer) and returns it with the model whose parameters it steps.
FACTORIES = {
    "muon": lambda m: Muon(matrices(m), nonfinite="skip"),
    "muon_orthogonalizer": lambda m: Muon(
        matrices(m), nonfinite="skip", orthogonalizer=functools.partial(newton_schulz, steps=3)
    ),
    "normuon": lambda m: NorMuon(matrices(m), nonfinite="skip"),
    "adamuon": lambda m: AdaMuon(matrices(m), nonfinite="skip"),
    "polargrad": lambda m: PolarGrad(matrices(m), nonfinite="skip"),
    "scion": lambda m: Scion(list(m.parameters()), nonfinite="skip"),
    "soap": lambda m: SOAP(list(m.parameters()), nonfinite="skip", precondition_frequency=1),
    "lion": lambda m: Lion(list(m.parameters()), nonfinite="skip"),
    "hybrid": lambda m: build_optimizer(m, nonfinite="skip", weight_decay=0.01),
    "hybrid_soap_lion": lambda m: build_optimizer(
        m, optimizer="soap", elementwise="lion", nonfinite="skip"
    ),
    "layerwise": lambda m: LayerwiseDistributedOptimizer(m, nonfinite="skip", bucket_mb=1e-4),
    "fsdp_world_size_1": lambda m: FSDPOptimizer(m, nonfinite="skip"),
}


def model_of(opt, model):
    """The model a (copied) optimizer steps: the one it holds, else the parameters' own."""
    return getattr(opt, "model", model)


def params_of(opt, model):
    """The parameters `opt` steps, in a fixed order (the same for an optimizer and its copy)."""
    if hasattr(opt, "model"):
        return list(opt.model.parameters())
    return [p for g in opt.param_groups for p in g["params"]]


def set_grads(params, seed, bad=False):
    g = torch.Generator().manual_seed(seed)
    for p in params:
        p.grad = torch.randn(p.shape, generator=g, dtype=p.dtype)
    if bad:
        params[0].grad[0, 0] = float("nan")


@pytest.mark.parametrize("how", sorted(COPIES))
@pytest.mark.parametrize("kind", sorted(FACTORIES))
def test_a_copy_steps_exactly_like_the_original(kind, how):
    model = tiny()
    opt = FACTORIES[kind](model)
    for seed in range(2):  # state to copy (SOAP: past its first, basis-only step)
        set_grads(params_of(opt, model), seed)
        opt.step()
    other = COPIES[how](opt)
    assert other.nonfinite == "skip"
    assert other.defaults == opt.defaults
    ours, theirs = params_of(opt, model), params_of(other, model)
    assert all(p is not q for p, q in zip(ours, theirs))
    for seed in (5, 6):
        for o in (opt, other):
            set_grads(params_of(o, model), seed)
            o.step()
    for p, q in zip(ours, theirs, strict=True):
        assert torch.equal(p, q)
    # the policy itself, not only its name: a NaN gradient skips the step of the copy
    before = [q.detach().clone() for q in theirs]
    set_grads(theirs, 7, bad=True)
    with pytest.warns(RuntimeWarning, match="skipping optimizer step"):
        other.step()
    assert all(torch.equal(a, q) for a, q in zip(before, theirs))


def test_a_copy_keeps_the_orthogonalizer_and_the_hybrid_shares_its_own_dicts():
    model = tiny()
    ortho = functools.partial(newton_schulz, steps=3)
    opt = build_optimizer(model, orthogonalizer=ortho)
    set_grads(list(model.parameters()), 0)
    opt.step()
    for make in COPIES.values():
        other = make(opt)
        assert other.inner["muon"].orthogonalizer.keywords == {"steps": 3}
        for key, inner in other.inner.items():
            assert inner.state is other.state
            assert [id(g) for g in inner.param_groups] == [
                id(g) for g in other.param_groups if g["optimizer"] == key
            ]
        other.param_groups[0]["lr"] = 0.5  # the copy's scheduler reaches the copy only
        assert other.inner["muon"].param_groups[0]["lr"] == 0.5
        assert opt.param_groups[0]["lr"] == 0.02


def _copies_over_process_groups(rank, world_size):
    """Copies of optimizers over a process group are refused, naming why and what to do."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    errors = {}
    model = tiny()
    opt = LayerwiseDistributedOptimizer(model, process_group=dist.group.WORLD)
    fsdp_model = fully_shard(tiny(), mesh=init_device_mesh("cpu", (world_size,)))
    fsdp = FSDPOptimizer(fsdp_model)
    for name, o in (("layerwise", opt), ("fsdp", fsdp)):
        for how, make in COPIES.items():
            try:
                make(o)
            except TypeError as e:
                errors[f"{name} {how}"] = str(e)
    return errors


def test_copies_of_optimizers_over_process_groups_fail_clearly():
    (errors,) = run_ranks(_copies_over_process_groups, 1)
    assert sorted(errors) == sorted(f"{n} {h}" for n in ("layerwise", "fsdp") for h in COPIES)
    for message in errors.values():
        assert "cannot be copied or pickled" in message and "state_dict()" in message


# -- defaults and schedulers ---------------------------------------------------------------


@pytest.mark.parametrize(
    "make",
    [
        lambda m: build_optimizer(m, lr=0.03),
        lambda m: build_optimizer(m, optimizer="soap", lr=0.03),
        lambda m: build_optimizer(m, lr=0.03, elementwise="lion"),
        lambda m: LayerwiseDistributedOptimizer(m, lr=0.03),
        lambda m: FSDPOptimizer(m, lr=0.03),
    ],
    ids=["hybrid", "soap", "lion", "layerwise", "fsdp"],
)
def test_defaults_serve_one_cycle_lr_and_readers_of_lr(make):
    model = tiny()
    opt = make(model)
    assert opt.defaults["lr"] == 0.03  # the matrix optimizer's
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=0.1, total_steps=10)
    key = "betas" if "betas" in opt.defaults else "momentum"
    for group in opt.param_groups:
        momentum = group["betas"][0] if key == "betas" else group["momentum"]
        assert momentum == 0.95 and group["lr"] == pytest.approx(0.1 / 25)
    matrix_group = opt.param_groups[0]
    for step in range(3):
        x = torch.randint(0, VOCAB, (4, 3), generator=torch.Generator().manual_seed(step))
        model(x).square().mean().backward()
        opt.step()
        opt.zero_grad()
        sched.step()
    # the cycle moves the matrix optimizer's momentum down from max_momentum
    momentum = matrix_group["betas"][0] if key == "betas" else matrix_group["momentum"]
    assert 0.85 < momentum < 0.95
    if key == "momentum":  # what the matrix optimizer reads: Muon's group key
        inner = getattr(opt, "inner", None) or getattr(opt, "template", None)
        if inner is not None and hasattr(inner, "inner"):
            assert inner.inner["muon"].param_groups[0]["momentum"] == momentum


def test_betas_are_in_the_defaults_only_when_every_group_has_them():
    hybrid = build_optimizer(tiny())
    assert "momentum" in hybrid.defaults and "betas" not in hybrid.defaults
    assert hybrid.defaults["eps"] == 1e-7  # Muon's, listed first
    soap = build_optimizer(tiny(), optimizer="soap")
    assert soap.defaults["betas"] == (0.95, 0.95)  # SOAP's; AdamW's groups have betas too


# -- global step hooks -----------------------------------------------------------------------


@pytest.mark.parametrize(
    "make",
    [
        lambda m: build_optimizer(m),
        lambda m: build_optimizer(m, optimizer="adamw"),
        lambda m: LayerwiseDistributedOptimizer(m),
        lambda m: FSDPOptimizer(m),
        lambda m: Muon(matrices(m)),
    ],
    ids=["hybrid", "adamw", "layerwise", "fsdp", "muon"],
)
def test_global_and_own_step_hooks_fire_once_per_step(make):
    from torch.optim.optimizer import (
        register_optimizer_step_post_hook,
        register_optimizer_step_pre_hook,
    )

    model = tiny()
    opt = make(model)
    calls: list[tuple[str, str]] = []
    handles = [
        register_optimizer_step_pre_hook(lambda o, a, k: calls.append(("pre", type(o).__name__))),
        register_optimizer_step_post_hook(lambda o, a, k: calls.append(("post", type(o).__name__))),
        opt.register_step_pre_hook(lambda o, a, k: calls.append(("own pre", type(o).__name__))),
        opt.register_step_post_hook(lambda o, a, k: calls.append(("own post", type(o).__name__))),
    ]
    try:
        for step in range(2):
            x = torch.randint(0, VOCAB, (4, 3), generator=torch.Generator().manual_seed(step))
            model(x).square().mean().backward()
            opt.step()
            opt.zero_grad()
    finally:
        for h in handles:
            h.remove()
    me = type(opt).__name__
    assert calls == [("pre", me), ("own pre", me), ("own post", me), ("post", me)] * 2


# -- add_param_group on the hybrid ------------------------------------------------------------


def test_hybrid_add_param_group_without_names_steps_like_a_separate_optimizer():
    model = tiny()
    opt = build_optimizer(model, lr=0.02)
    torch.manual_seed(3)
    extra, bias = nn.Parameter(torch.randn(6, 4)), nn.Parameter(torch.randn(6))
    opt.add_param_group({"params": [extra], "optimizer": "muon", "lr": 0.05})
    opt.add_param_group({"params": bias, "optimizer": "adamw"})
    assert opt.param_groups[-2]["param_names"] == ["param_groups[2]['params'][0]"]
    assert opt.param_groups[-1]["param_names"] == ["param_groups[3]['params'][0]"]
    ref_w, ref_b = extra.detach().clone().requires_grad_(), bias.detach().clone().requires_grad_()
    ref_muon = Muon([ref_w], lr=0.05)
    ref_adamw = torch.optim.AdamW([ref_b], lr=3e-4, betas=(0.9, 0.95), weight_decay=0.0)
    for seed in range(2):
        set_grads([*model.parameters(), extra, bias], seed)
        set_grads([ref_w, ref_b], 100 + seed)
        extra.grad, bias.grad = ref_w.grad.clone(), ref_b.grad.clone()
        opt.step()
        ref_muon.step()
        ref_adamw.step()
    assert torch.equal(extra, ref_w) and torch.equal(bias, ref_b)
    # the state dict names the new parameters; a fresh optimizer with the same groups loads it
    other = build_optimizer(model, lr=0.02)
    other.add_param_group({"params": [extra], "optimizer": "muon", "lr": 0.05})
    other.add_param_group({"params": [bias], "optimizer": "adamw"})
    other.load_state_dict(opt.state_dict())


def test_hybrid_add_param_group_messages_name_the_keys():
    opt = build_optimizer(tiny())
    extra = nn.Parameter(torch.randn(6, 4))
    with pytest.raises(ValueError, match="'optimizer' key naming one of.*'param_names'"):
        opt.add_param_group({"params": [extra]})
    with pytest.raises(ValueError, match="'param_names' must list one name per parameter"):
        opt.add_param_group({"params": [extra], "optimizer": "muon", "param_names": ["a", "b"]})
    unnamed = Muon([nn.Parameter(torch.randn(4, 4))])
    from orthoptim.optim.hybrid import HybridOptimizer

    hybrid = HybridOptimizer({"muon": unnamed})
    with pytest.raises(ValueError, match="do not name their parameters.*'param_names'"):
        hybrid.add_param_group({"params": [extra], "optimizer": "muon", "param_names": ["x"]})
    hybrid.add_param_group({"params": [extra], "optimizer": "muon"})
    assert "param_names" not in hybrid.param_groups[-1]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        extra.grad = torch.ones_like(extra)
        hybrid.step()


# -- Hugging Face Conv1D weights ([in, out]) ---------------------------------------------------


def conv1d_pair(optimizer="muon", layerwise=False):
    """Two float64 models of the same maps: one with Hugging Face Conv1D layers (weights
    [in, out]), one with nn.Linear (weights [out, in] = the transposes), and an optimizer each."""
    conv1d = pytest.importorskip("transformers.pytorch_utils").Conv1D

    def make(layer):
        torch.manual_seed(0)
        m = nn.Module()
        m.tok = nn.Embedding(VOCAB, WIDTH)  # so that no layer is taken for a head
        m.c_fc, m.c_proj = layer(WIDTH, 4 * WIDTH), layer(4 * WIDTH, WIDTH)
        return m.double()

    a = make(lambda i, o: conv1d(o, i))
    b = make(lambda i, o: nn.Linear(i, o))
    with torch.no_grad():
        for n in ("c_fc", "c_proj"):
            getattr(b, n).weight.copy_(getattr(a, n).weight.T)
            getattr(b, n).bias.copy_(getattr(a, n).bias)
    kw = dict(optimizer=optimizer, lr=0.02, weight_decay=0.1)
    if layerwise:
        return (a, LayerwiseDistributedOptimizer(a, **kw)), (
            b,
            LayerwiseDistributedOptimizer(b, **kw),
        )
    return (a, build_optimizer(a, **kw)), (b, build_optimizer(b, **kw))


@pytest.mark.parametrize(
    "optimizer, layerwise",
    [("muon", False), ("muon", True), ("normuon", False), ("scion", False)],
)
def test_conv1d_weight_steps_as_the_transpose_of_the_equivalent_linear(optimizer, layerwise):
    (a, opt_a), (b, opt_b) = conv1d_pair(optimizer, layerwise)
    start = {n: getattr(b, n).weight.detach().clone() for n in ("c_fc", "c_proj")}
    for seed in range(3):
        g = torch.Generator().manual_seed(seed)
        for n in ("c_fc", "c_proj"):
            grad = torch.randn(getattr(b, n).weight.shape, generator=g, dtype=torch.float64)
            getattr(b, n).weight.grad = grad
            getattr(a, n).weight.grad = grad.T.clone()
        opt_a.step()
        opt_b.step()
    for n in ("c_fc", "c_proj"):
        want = getattr(b, n).weight.detach() - start[n]
        got = getattr(a, n).weight.detach().T - start[n]
        # float64 Newton-Schulz of a matrix and of its transpose: equal up to the rounding of
        # a few hundred float64 operations per entry; a transposed LR scale is a factor 2
        assert torch.allclose(got, want, rtol=1e-10, atol=1e-12 * want.abs().max()), n


def test_explain_routing_and_build_optimizer_show_the_orientation():
    (a, opt), _ = conv1d_pair()
    from orthoptim.optim.routing import explain_routing

    rows = {r.name: r for r in explain_routing(a, quiet=True)}
    for n in ("c_fc.weight", "c_proj.weight"):
        assert rows[n].in_out and rows[n].optimizer == "muon"
        assert "stored [in, out] (Conv1D)" in rows[n].reason
    assert not rows["c_fc.bias"].in_out and not rows["tok.weight"].in_out
    assert opt.param_groups[0]["transposed"] == ("c_fc.weight", "c_proj.weight")
    plain = build_optimizer(tiny())
    assert "transposed" not in plain.param_groups[0]  # checkpoints from before still match
    with pytest.raises(ValueError, match="transposed names 'tok.weight', which is not routed"):
        build_optimizer(a, transposed=["tok.weight"])
    with pytest.raises(ValueError, match="transposed names.*only 2-D"):
        Muon([("w", nn.Parameter(torch.randn(2, 3, 4)))], transposed=["w"])


# -- routing of raw tables -----------------------------------------------------------------


@pytest.mark.parametrize("name", ["W_E", "W_pos", "pos_embedding"])
@pytest.mark.parametrize("holder", ["module", "parameter_dict", "nested_module"])
def test_raw_tables_route_to_adamw_whatever_module_holds_them(name, holder):
    from orthoptim.optim.routing import ModelRoute

    model = nn.Module()
    table = nn.Parameter(torch.randn(VOCAB, WIDTH))
    if holder == "module":
        setattr(model, name, table)
        full = name
    elif holder == "parameter_dict":
        model.tables = nn.ParameterDict({name: table})
        full = f"tables.{name}"
    else:
        model.inner = nn.Module()
        setattr(model.inner, name, table)
        full = f"inner.{name}"
    model.hidden = nn.Linear(WIDTH, WIDTH)
    model.out = nn.Linear(WIDTH, WIDTH)
    route = ModelRoute(model)
    assert dict(model.named_parameters())[full] is table
    d = route.decision(full, table)
    assert not d.matrix and "named like an embedding" in d.reason
    assert route("hidden.weight", model.hidden.weight)  # a torch layer's weight stays a matrix
    opt = build_optimizer(model)
    assert {n: g["optimizer"] for g in opt.param_groups for n in g["param_names"]}[full] == "adamw"


# -- Literal types of the string options -------------------------------------------------------


def literal_values(alias):
    """The strings a Literal type (or a union holding Literals) admits, in order."""
    if typing.get_origin(alias) is typing.Literal:
        return tuple(v for a in typing.get_args(alias) for v in literal_values(a))
    if typing.get_origin(alias) in (typing.Union, types.UnionType):
        return tuple(v for a in typing.get_args(alias) for v in literal_values(a))
    return (alias,) if isinstance(alias, str) else ()


def test_literal_types_list_exactly_the_values_the_runtime_accepts():
    from orthoptim import checkpoint
    from orthoptim.newton_schulz import COEFFICIENT_SETS, CoefficientSetName, NSDtype
    from orthoptim.optim import base, muon, registry, scion, soap
    from orthoptim.parallel import assignment, tensor_parallel

    pairs = [
        (base.NonfinitePolicy, base.NONFINITE_POLICIES),
        (muon.LRScaleName, muon.LR_SCALES),
        (muon.LRScale, (*muon.LR_SCALES, *muon.LR_SCALE_ALIASES)),
        (CoefficientSetName, tuple(COEFFICIENT_SETS)),
        (registry.MatrixOptimizerName, tuple(registry.MATRIX_OPTIMIZERS)),
        (registry.ElementwiseOptimizerName, tuple(registry.ELEMENTWISE_OPTIMIZERS)),
        (registry.OptimizerName, registry.OPTIMIZER_NAMES),
        (soap.RefreshMethod, soap.REFRESH_METHODS),
        (scion.ScionNorm, scion.NORMS),
        (assignment.Balance, assignment.BALANCES),
        (checkpoint.StateDictTo, checkpoint.STATE_DICT_TO),
        (tensor_parallel.TPMode, tensor_parallel.MODES),
        (tensor_parallel.TPForm, tensor_parallel.FORMS),
    ]
    for alias, allowed in pairs:
        assert literal_values(alias) == tuple(allowed), alias
    assert literal_values(NSDtype) == ("auto",)


def test_public_signatures_use_the_literal_types():
    from orthoptim import checkpoint
    from orthoptim.newton_schulz import CoefficientsLike, NSDtype
    from orthoptim.optim import base, muon, registry, routing, scion, soap
    from orthoptim.parallel import assignment, tensor_parallel

    def hint(fn, param):
        return typing.get_type_hints(fn)[param]

    expected = [
        (build_optimizer, "optimizer", registry.OptimizerName),
        (build_optimizer, "elementwise", registry.ElementwiseOptimizerName),
        (build_optimizer, "nonfinite", base.NonfinitePolicy),
        (routing.explain_routing, "optimizer", registry.OptimizerName),
        (Muon.__init__, "lr_scale", muon.LRScale),
        (Muon.__init__, "coefficients", CoefficientsLike),
        (Muon.__init__, "ns_dtype", NSDtype),
        (Muon.__init__, "nonfinite", base.NonfinitePolicy),
        (NorMuon.__init__, "lr_scale", muon.LRScale),
        (PolarGrad.__init__, "lr_scale", muon.LRScale),
        (muon.lr_scale_factor, "convention", muon.LRScale),
        (newton_schulz, "coefficients", CoefficientsLike),
        (SOAP.__init__, "refresh_method", soap.RefreshMethod),
        (SOAP.__init__, "nonfinite", base.NonfinitePolicy),
        (Lion.__init__, "nonfinite", base.NonfinitePolicy),
        (Scion.__init__, "norms", dict[str, scion.ScionNorm] | None),
        (LayerwiseDistributedOptimizer.__init__, "optimizer", registry.OptimizerName),
        (LayerwiseDistributedOptimizer.__init__, "balance", assignment.Balance),
        (LayerwiseDistributedOptimizer.__init__, "nonfinite", base.NonfinitePolicy),
        (LayerwiseDistributedOptimizer.__init__, "state_dict_to", checkpoint.StateDictTo),
        (FSDPOptimizer.__init__, "optimizer", registry.OptimizerName),
        (FSDPOptimizer.__init__, "balance", assignment.Balance),
        (FSDPOptimizer.__init__, "state_dict_to", checkpoint.StateDictTo),
        (tensor_parallel.TensorParallelOrthogonalizer.__init__, "mode", tensor_parallel.TPMode),
        (tensor_parallel.TensorParallelOrthogonalizer.__init__, "form", tensor_parallel.TPForm),
    ]
    for fn, param, alias in expected:
        assert hint(fn, param) == alias, (fn.__qualname__, param)


@pytest.mark.parametrize("how", sorted(COPIES))
def test_a_copy_taken_under_a_scheduler_steps_itself_not_the_original(how):
    model = tiny()
    opt = build_optimizer(model)
    torch.optim.lr_scheduler.StepLR(opt, step_size=1)  # patches opt.step
    other = COPIES[how](opt)
    before = [p.detach().clone() for p in model.parameters()]
    set_grads(params_of(other, model), 0)
    other.step()
    assert all(torch.equal(a, p) for a, p in zip(before, model.parameters()))
    assert not all(torch.equal(a, p) for a, p in zip(before, params_of(other, model)))


class Experts(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.tok = nn.Embedding(VOCAB, WIDTH)
        self.experts = nn.Parameter(torch.randn(4, WIDTH, WIDTH))
        self.out = nn.Linear(WIDTH, VOCAB)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(torch.einsum("bd,edf->bf", self.tok(x), self.experts))


@pytest.mark.parametrize("how", sorted(COPIES))
def test_a_layerwise_copy_with_expert_slices_steps_its_model(how):
    """Expert slices are views of their parameter; a pickled copy makes them views again."""
    torch.manual_seed(0)
    model = Experts()
    opt = LayerwiseDistributedOptimizer(model, split_experts=2, bucket_mb=1e-4)
    x = torch.randint(0, VOCAB, (5,), generator=torch.Generator().manual_seed(0))

    def step(m, o):
        m(x).square().mean().backward()
        o.step()
        o.zero_grad()

    step(model, opt)
    other = COPIES[how](opt)
    for _ in range(2):
        step(model, opt)
        step(other.model, other)
    for p, q in zip(model.parameters(), other.model.parameters(), strict=True):
        assert torch.equal(p, q)
