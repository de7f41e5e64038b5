"""`torch.compile(opt.step, fullgraph=True)`: one graph (no breaks, no host reads), no
recompile across steps with a scheduler changing a tensor LR, results equal to eager, and the
non-finite policy kept on the device.

Tolerance: a step moves W by lr·scale·O with ‖O‖ ≈ 1 per entry; compiled and eager Newton-
Schulz round differently (float32, u ≈ 6e-8, 5 steps whose polynomials amplify a perturbation
at most ~100x), so |ΔO| ≲ 1e-5 and |ΔW| ≲ lr·1e-5 = 2e-7 per step: 1e-6 after 3 steps.
"""

import copy
import warnings

import pytest
import torch
from torch import nn
from torch._dynamo.utils import counters

from orthoptim import Muon, build_optimizer
from orthoptim.optim.base import NonFiniteGradientError

ATOL = 1e-6


def model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 8))


def set_grads(models, step, nan=False):
    gen = torch.Generator().manual_seed(step)
    for ps in zip(*(m.parameters() for m in models)):
        g = torch.randn(ps[0].shape, generator=gen) * 1e-2
        if nan and ps[0].shape == (8, 32):
            g[0, 0] = float("nan")
        for p in ps:
            p.grad = g.clone()  # a new tensor every step, as zero_grad(set_to_none) gives


def hybrid(name, nonfinite="raise"):
    return lambda m: build_optimizer(
        m, optimizer=name, lr=torch.tensor(0.02), adamw_lr=torch.tensor(3e-3), nonfinite=nonfinite
    )


def muon(nonfinite="raise"):
    return lambda m: Muon(
        [(n, p) for n, p in m.named_parameters() if p.ndim == 2],
        lr=torch.tensor(0.02),
        nonfinite=nonfinite,
    )


VARIANTS = ("muon", "normuon", "adamuon", "polargrad", "scion")
#: name -> (nonfinite policy -> build); a hybrid is the variant plus torch's AdamW (0.weight to
#: the variant, the biases and the head 2.weight to AdamW, where `set_grads` puts the NaN)
BUILDS = {"muon": muon, **{f"hybrid_{n}": lambda policy, n=n: hybrid(n, policy) for n in VARIANTS}}


@pytest.fixture(autouse=True)
def fresh_dynamo():
    torch._dynamo.reset()
    counters.clear()
    yield
    torch._dynamo.reset()


def compiled(opt):
    step = torch.compile(opt.step, fullgraph=True)  # before the scheduler wraps opt.step
    return step


@pytest.mark.parametrize("name", BUILDS)
def test_one_graph_equal_to_eager_without_recompiles(name):
    eager_model, compiled_model = model(), model()
    eager, opt = BUILDS[name]("raise")(eager_model), BUILDS[name]("raise")(compiled_model)
    step = compiled(opt)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the scheduler sees the unwrapped step called
        scheds = [torch.optim.lr_scheduler.LambdaLR(o, lambda s: 0.5**s) for o in (eager, opt)]
    for s in range(3):
        set_grads((eager_model, compiled_model), s)
        eager.step()
        step()
        for sched in scheds:
            sched.step()
    # one graph: state made before tracing (NorMuon's and AdaMuon's per-matrix moments,
    # AdamW's), no recompile for new grads and new LR values
    assert counters["stats"]["unique_graphs"] == 1
    assert not counters["graph_break"]
    for (n, p), q in zip(compiled_model.named_parameters(), eager_model.parameters()):
        torch.testing.assert_close(p, q, rtol=0, atol=ATOL, msg=n)
    assert float(opt.param_groups[0]["lr"]) == pytest.approx(0.02 * 0.5**3, rel=1e-6)


def snapshot(m, opt):
    """Every parameter and every tensor of the optimizer's state (AdamW's step count too)."""
    params = [p.detach().clone() for p in m.parameters()]
    state = {
        (i, k): v.clone()
        for i, p in enumerate(m.parameters())
        for k, v in opt.state.get(p, {}).items()
        if torch.is_tensor(v)
    }
    return params, state


def assert_untouched(m, opt, before):
    params, state = before
    for (n, p), q in zip(m.named_parameters(), params):
        assert torch.equal(p, q), n
    now = snapshot(m, opt)[1]
    assert now.keys() == state.keys()
    for key, value in state.items():
        assert torch.equal(now[key], value), key


def assert_all_moved(m, opt, before):
    """Every parameter the optimizer steps and every state tensor changed (a finite step
    after the masked ones)."""
    params, state = before
    stepped = {id(p) for g in opt.param_groups for p in g["params"]}
    for (n, p), q in zip(m.named_parameters(), params):
        assert torch.equal(p, q) != (id(p) in stepped), n
    now = snapshot(m, opt)[1]
    for key, value in state.items():
        assert not torch.equal(now[key], value), key


@pytest.mark.parametrize("name", BUILDS)
def test_skip_under_compile_leaves_params_and_state_untouched(name):
    m = model()
    opt = BUILDS[name]("skip")(m)
    step = compiled(opt)  # traced on a first step that makes every state tensor
    set_grads((m,), 0)
    step()
    before = snapshot(m, opt)
    if name != "muon":  # AdamW's step count and moments of 0.bias, 2.weight, 2.bias
        assert {k for k in before[1] if k[1] in ("step", "exp_avg", "exp_avg_sq")} == {
            (i, k) for i in (1, 2, 3) for k in ("step", "exp_avg", "exp_avg_sq")
        }
    set_grads((m,), 1, nan=True)
    step()  # no host read, no warning here: skipped on the device
    assert_untouched(m, opt, before)
    set_grads((m,), 2)
    step()  # a finite step moves again
    assert_all_moved(m, opt, before)
    with pytest.warns(RuntimeWarning, match=r"skipped compiled optimizer step.*2\.weight"):
        opt.check_nonfinite()
    assert not bool(opt.nonfinite_latch.any())
    assert counters["stats"]["unique_graphs"] == 1


@pytest.mark.parametrize("name", BUILDS)
def test_raise_under_compile_stops_stepping_and_raises_at_the_next_eager_step(name):
    m = model()
    opt = BUILDS[name]("raise")(m)
    step = compiled(opt)
    set_grads((m,), 0)
    step()
    before = snapshot(m, opt)
    set_grads((m,), 1, nan=True)
    step()
    set_grads((m,), 2)
    step()  # finite, but after a latched non-finite step under "raise": still untouched
    assert_untouched(m, opt, before)
    with pytest.raises(NonFiniteGradientError, match=r"2\.weight.*compiled step") as err:
        opt.step()  # eager: reads the latch first
    assert err.value.names == ["2.weight"]
    assert_untouched(m, opt, before)
    opt.step()  # the latch is cleared once raised: steps again
    assert_all_moved(m, opt, before)
    assert counters["stats"]["unique_graphs"] == 1


def test_float_lr_is_a_guarded_constant():
    """What torch 2.13's dynamo does with a float LR: it guards on its value, so a scheduler
    changing it compiles again (a tensor LR is the documented way, tested above)."""
    m = model()
    opt = Muon([p for p in m.parameters() if p.ndim == 2], lr=0.02)
    step = compiled(opt)
    for s, lr in enumerate((0.02, 0.02, 0.01)):
        opt.param_groups[0]["lr"] = lr
        set_grads((m,), s)
        step()
    assert counters["stats"]["unique_graphs"] == 2


@pytest.mark.parametrize("name", ["muon", "hybrid_muon"])
def test_compiled_step_copy_is_independent(name):
    # a deep copy of a compiled-stepped optimizer keeps working eagerly, with its own latch
    m = model()
    opt = BUILDS[name]("raise")(m)
    set_grads((m,), 0)
    compiled(opt)()
    other = copy.deepcopy(opt)
    assert other.nonfinite_latch is not opt.nonfinite_latch
    if name != "muon":
        assert other._trace_time_init.owner is other
    other.step()


@pytest.mark.parametrize("variant", ["normuon", "adamuon"])
def test_state_made_ahead_is_the_state_the_step_makes(variant):
    """`init_compiled_state` makes the per-matrix moments `finish` would (shape, dtype), for a
    matrix stored [in, out] (`transposed`), a 3-D expert stack and a plain one: eager steps
    after it equal eager steps without it, bit for bit. No compiling here."""
    from orthoptim.optim.registry import MATRIX_OPTIMIZERS

    def run(ahead):
        torch.manual_seed(0)
        named = [
            ("flipped", nn.Parameter(torch.randn(12, 5))),
            ("experts", nn.Parameter(torch.randn(3, 6, 4))),
            ("plain", nn.Parameter(torch.randn(7, 9))),
            ("frozen_out", nn.Parameter(torch.randn(4, 4))),  # no gradient: no state
        ]
        opt = MATRIX_OPTIMIZERS[variant](named, lr=0.02, transposed=("flipped",))
        for s in range(2):
            gen = torch.Generator().manual_seed(s)
            for _, p in named[:3]:
                p.grad = torch.randn(p.shape, generator=gen)
            if ahead and s == 0:
                opt.init_compiled_state()
                made = {k: v.clone() for k, v in opt.state[named[0][1]].items()}
            opt.step()
        assert named[3][1] not in opt.state
        return [p.detach() for _, p in named], opt, (made if ahead else None)

    plain, plain_opt, _ = run(False)
    ahead, ahead_opt, made = run(True)
    assert "matrix" in {ahead_opt.state_kinds[k] for k in made}  # the moment, made ahead
    assert all(not bool(v.any()) for v in made.values())  # fresh: zeros
    for p, q in zip(plain, ahead):
        assert torch.equal(p, q)
    for (_, p), (_, q) in zip(plain_opt.state.items(), ahead_opt.state.items()):
        assert p.keys() == q.keys()
        for key in p:
            assert p[key].shape == q[key].shape and p[key].dtype == q[key].dtype, key
            assert torch.equal(p[key], q[key]), key
