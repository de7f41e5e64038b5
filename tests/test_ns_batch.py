"""Muon's `ns_batch_mb`: where stacking pays, a stack of same-shape matrices goes through
Newton-Schulz in consecutive chunks of at most `batch_limit(rows, cols, ns_batch_mb)`.

The oracle for exactness: Newton-Schulz is per matrix, and on one CPU thread the batched
products give each matrix bitwise the result it gets alone (with more threads torch's CPU
batched products split their work by batch size and round differently, ~1e-7), so a
chunked step must equal the one-stack step bit for bit, and every block must equal its
matrices orthogonalized one at a time. Stacking is forced on (`stacking_pays`), as on a GPU:
on CPU the optimizers do not stack, and the cap changes nothing there.
"""

from __future__ import annotations

import importlib
import json
import math

import pytest
import torch
from torch import nn

from orthoptim import AdaMuon, Muon, NorMuon, PolarGrad, Scion, build_optimizer
from orthoptim import checkpoint as ckpt
from orthoptim.newton_schulz import NS_BATCH_MB, batch_chunks, batch_limit
from orthoptim.optim.muon import orthogonalize_blocks
from orthoptim.parallel import LayerwiseDistributedOptimizer

ns_module = importlib.import_module("orthoptim.newton_schulz")
muon_module = importlib.import_module("orthoptim.optim.muon")

ROWS, COLS = 16, 24
ONE = ROWS * COLS * 4 / 2**20  # MiB of one float32 16×24 matrix


def cap(limit: int) -> float:
    """An ns_batch_mb that lets `limit` 16×24 matrices into one call (halfway to the next,
    clear of the floor's rounding)."""
    return (limit + 0.5) * ONE


@pytest.fixture
def stacked(monkeypatch):
    """Stacking on (as on a GPU), on one thread: Newton-Schulz then gives each matrix bitwise
    what it gets alone."""
    monkeypatch.setattr(ns_module, "stacking_pays", lambda device: True)
    monkeypatch.setattr(muon_module, "stacking_pays", lambda device: True)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def test_batch_limit_and_chunks():
    assert batch_limit(512, 512, 2.5) == 2  # 1 MiB a matrix
    assert batch_limit(512, 512, 0.25) == 1  # at least one
    assert batch_limit(768, 3072, 1024) == 113  # 9 MiB a matrix: ⌊1024 / 9⌋
    assert batch_limit(768, 3072, None) is None
    # blocks of 3, 1 and 2 matrices, chunks of at most 2: the first block is cut
    assert batch_chunks([3, 1, 2], 2) == [[(0, 0, 2)], [(0, 2, 1), (1, 0, 1)], [(2, 0, 2)]]
    assert batch_chunks([3, 1, 2], None) == [[(0, 0, 3), (1, 0, 1), (2, 0, 2)]]
    # an empty block rides along in the chunk at hand
    assert batch_chunks([2, 0, 1], 2) == [[(0, 0, 2), (1, 0, 0)], [(2, 0, 1)]]
    assert NS_BATCH_MB > 0


def blocks():
    """Stacks of one shape (2-D and 3-D, one cut into row blocks of that shape too) and of
    its transpose."""
    torch.manual_seed(0)
    return [
        (torch.randn(3, ROWS, COLS), None),
        (torch.randn(1, ROWS, COLS), None),
        (torch.randn(2, COLS, ROWS), None),
        (torch.randn(2, 2 * ROWS, COLS), (ROWS, ROWS)),
        (torch.randn(4, ROWS, COLS), None),
        (torch.randn(1, COLS, ROWS), None),
    ]


@pytest.mark.parametrize("limit", [1, 2, 3])
def test_chunks_are_bitwise_one_stack(stacked, limit):
    items = blocks()
    calls = []

    def ortho(x):
        calls.append(tuple(x.shape))
        return ns_module.newton_schulz(x)

    whole = orthogonalize_blocks(items, ortho, "keller")
    assert calls == [(12, ROWS, COLS), (3, COLS, ROWS)]  # one call per shape
    calls.clear()
    chunked = orthogonalize_blocks(items, ortho, "keller", batch_mb=cap(limit))
    # 12 matrices of 16×24 in chunks of `limit` (the last one the remainder), and the 3 of
    # 24×16 (a 24×16 matrix is as big) likewise
    for shape, total in (((ROWS, COLS), 12), ((COLS, ROWS), 3)):
        sizes = [c[0] for c in calls if c[1:] == shape]
        assert sizes == [min(limit, total - s) for s in range(0, total, limit)]
    assert [(i, row, scale) for i, row, _, scale in chunked] == [
        (i, row, scale) for i, row, _, scale in whole
    ]
    for (i, row, a, _), (_, _, b, _) in zip(chunked, whole, strict=True):
        assert a.shape == b.shape and torch.equal(a, b), (i, row)
        # and each matrix as it comes out alone
        mats, _ = items[i]
        block = mats if row is None else mats[:, row : row + a.shape[1]]
        alone = torch.stack([ns_module.newton_schulz(m) for m in block])
        assert torch.equal(a, alone), (i, row)


def named_params():
    """Matrices of one shape as 2-D weights, a 3-D stack (cut by chunks) and a fused weight
    split into two blocks of that shape, and one matrix of another shape."""
    torch.manual_seed(1)
    shapes = {
        **{f"w{i}": (ROWS, COLS) for i in range(4)},
        "experts": (5, ROWS, COLS),
        "fused": (2 * ROWS, COLS),
        "tall": (COLS, ROWS),
    }
    return [(n, nn.Parameter(torch.randn(s) * 0.1)) for n, s in shapes.items()]


OPTIMIZERS = {
    "muon": Muon,
    "normuon": NorMuon,
    "adamuon": AdaMuon,
    "polargrad": PolarGrad,
    "scion": Scion,
}


def _steps(named, opt, seed, steps):
    """`steps` steps of `opt` on seeded random gradients; the parameters by name, and `opt`."""
    gen = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        for _, p in named:
            p.grad = torch.randn(p.shape, generator=gen)
        opt.step()
    return dict(named), opt


def run(cls, ns_batch_mb, steps=3):
    named = named_params()
    opt = cls(named, split={"fused": (ROWS, ROWS)}, ns_batch_mb=ns_batch_mb)
    return _steps(named, opt, seed=2, steps=steps)


@pytest.mark.parametrize("limit", [1, 2, 3])
@pytest.mark.parametrize("name", OPTIMIZERS)
def test_a_chunked_step_is_bitwise_the_one_stack_step(stacked, monkeypatch, name, limit):
    calls = []
    real = muon_module.newton_schulz

    def recording(x, **kw):
        calls.append(tuple(x.shape))
        return real(x, **kw)

    monkeypatch.setattr(muon_module, "newton_schulz", recording)
    whole, whole_opt = run(OPTIMIZERS[name], None)
    assert calls[:2] == [(11, ROWS, COLS), (1, COLS, ROWS)]  # 4 + 5 + 2 blocks of 16×24
    calls.clear()
    chunked, opt = run(OPTIMIZERS[name], cap(limit))
    step = [c[0] for c in calls if c[1:] == (ROWS, COLS)][: math.ceil(11 / limit)]
    assert step == [min(limit, 11 - s) for s in range(0, 11, limit)]
    for n, p in chunked.items():
        assert torch.equal(p, whole[n]), n
        for key, value in opt.state[p].items():
            assert torch.equal(value, whole_opt.state[whole[n]][key]), (n, key)


def test_on_cpu_the_cap_changes_nothing(monkeypatch):
    """Where stacking does not pay (CPU) blocks go one call each, capped or not."""
    calls = []
    real = muon_module.newton_schulz
    monkeypatch.setattr(
        muon_module, "newton_schulz", lambda x, **kw: calls.append(tuple(x.shape)) or real(x, **kw)
    )
    whole, _ = run(Muon, None, steps=1)
    uncapped = list(calls)
    calls.clear()
    capped, _ = run(Muon, cap(1), steps=1)
    assert calls == uncapped and (5, ROWS, COLS) in calls  # the 3-D stack whole
    for n, p in capped.items():
        assert torch.equal(p, whole[n]), n


@pytest.mark.parametrize("cls", list(OPTIMIZERS.values()))
@pytest.mark.parametrize("bad", [0, -1.0, float("inf"), float("nan")])
def test_ns_batch_mb_must_be_positive_or_none(cls, bad):
    W = nn.Parameter(torch.zeros(4, 6))
    with pytest.raises(ValueError, match="ns_batch_mb must be a finite number > 0"):
        cls([W], ns_batch_mb=bad)
    with pytest.raises(TypeError, match="ns_batch_mb must be a real number"):
        cls([W], ns_batch_mb="64")
    opt = cls([W], ns_batch_mb=None)
    assert opt.param_groups[0]["ns_batch_mb"] is None
    with pytest.raises(ValueError, match="ns_batch_mb"):
        opt.add_param_group({"params": [nn.Parameter(torch.zeros(4, 6))], "ns_batch_mb": 0})
    assert cls([W]).param_groups[0]["ns_batch_mb"] == NS_BATCH_MB


def test_ns_batch_mb_reaches_the_inner_optimizer():
    """build_optimizer and the layer-wise optimizer hand it to the matrix optimizer as is;
    a custom orthogonalizer gets whole stacks."""
    model = nn.Sequential(nn.Linear(6, 8), nn.Linear(8, 8), nn.Linear(8, 3))
    hybrid = build_optimizer(model, ns_batch_mb=64.0)
    assert hybrid.param_groups[0]["ns_batch_mb"] == 64.0
    layerwise = LayerwiseDistributedOptimizer(model, ns_batch_mb=None)
    assert layerwise.param_groups[0]["ns_batch_mb"] is None
    own = Muon([nn.Parameter(torch.zeros(4, 6))], orthogonalizer=lambda x: x, ns_batch_mb=1.0)
    assert own.batch_mb(own.param_groups[0]) is None


def test_checkpoints_load_across_caps_and_from_before_the_cap(tmp_path):
    """How many matrices one call takes does not change what the state means: a checkpoint
    written with another cap, or before there was one, loads; the optimizer keeps its own
    cap (the layer-wise loader; torch's loader of a single-process dict takes the dict's
    group, so one from before the cap steps with the default)."""
    W = nn.Parameter(torch.randn(6, 10))
    muon = Muon([W], ns_batch_mb=None)
    W.grad = torch.randn(6, 10)
    muon.step()
    sd = muon.state_dict()
    del sd["param_groups"][0]["ns_batch_mb"]  # as saved before the option
    again = Muon([nn.Parameter(W.detach().clone())], ns_batch_mb=8.0)
    again.load_state_dict(sd)
    again.param_groups[0]["params"][0].grad = torch.randn(6, 10)
    again.step()

    def make_model():
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(6, 8), nn.Linear(8, 8), nn.Linear(8, 3))

    model = make_model()
    opt = LayerwiseDistributedOptimizer(model, ns_batch_mb=None)
    model(torch.randn(4, 6)).sum().backward()
    opt.step()
    torch.save(opt.full_state_dict(), tmp_path / "full.pt")
    other = LayerwiseDistributedOptimizer(make_model(), ns_batch_mb=2.0)
    other.load_state_dict(torch.load(tmp_path / "full.pt", weights_only=True))
    assert other.param_groups[0]["ns_batch_mb"] == 2.0
    # any other hyper-parameter still has to match
    with pytest.raises(ckpt.CheckpointMismatchError, match="ns_steps"):
        LayerwiseDistributedOptimizer(make_model(), ns_steps=4).load_state_dict(
            torch.load(tmp_path / "full.pt", weights_only=True)
        )


@pytest.mark.parametrize("cls", [Muon, NorMuon])  # NorMuon: its `finish` in place too
def test_compiled_chunked_step_is_one_graph_equal_to_eager(stacked, cls):
    """Chunks written into the updates, under `torch.compile(fullgraph=True)`."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    try:
        eager, eager_opt = run(cls, cap(2), steps=0)
        comp, comp_opt = run(cls, cap(2), steps=0)
        step = torch.compile(comp_opt.step, fullgraph=True)
        gen = torch.Generator().manual_seed(3)
        for _ in range(2):
            for n, p in eager.items():
                p.grad = torch.randn(p.shape, generator=gen) * 1e-2
                comp[n].grad = p.grad.clone()
            eager_opt.step()
            step()
        assert counters["stats"]["unique_graphs"] == 1 and not counters["graph_break"]
        # compiled and eager round differently: as tests/test_compile.py, 1e-6 after 2 steps
        for n, p in comp.items():
            torch.testing.assert_close(p, eager[n], rtol=0, atol=1e-6, msg=n)
    finally:
        torch._dynamo.reset()


def test_plan_flag(capsys):
    """`orthoptim plan --ns-batch-mb MB|none`: the layout's cap, and so the transient."""
    from orthoptim.cli import main

    transient = {}
    for flag in ("none", "4", None):
        argv = ["plan", "--model", "train:base", "--dp", "8", "--json"]
        assert main(argv + (["--ns-batch-mb", flag] if flag else [])) == 0
        out = json.loads(capsys.readouterr().out)
        transient[flag] = out["memory_per_rank"]["rank_0"]["transient"]
        assert out["layout"]["ns_batch_mb"] == {"none": None, "4": 4.0, None: NS_BATCH_MB}[flag]
    assert transient["4"] < transient["none"]
    for bad in ("0", "-1", "inf"):
        assert main(["plan", "--model", "train:base", "--dp", "8", "--ns-batch-mb", bad]) == 2
        assert "--ns-batch-mb must be a finite number > 0" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["plan", "--model", "train:base", "--dp", "8", "--ns-batch-mb", "lots"])
    assert "--ns-batch-mb: takes a number of MiB or 'none', got 'lots'" in capsys.readouterr().err


# -- the results written into the updates (`Muon.owns_updates`) ------------------------------


def in_place_params():
    """`named_params`' matrices, a 3-D stack of fused matrices split in two uneven blocks, a
    conv weight and a weight stored [in, out] (`transposed`: its update seen as [out, in] is
    not contiguous, so it gets a result of its own; a shape of its own, so that it goes to
    Newton-Schulz as the same strided view in every step compared)."""
    torch.manual_seed(3)
    shapes = {"fused3": (3, 2 * ROWS, COLS), "conv": (ROWS, 4, 2, 3), "t": (COLS, 12)}
    extra = [(n, nn.Parameter(torch.randn(s) * 0.1)) for n, s in shapes.items()]
    return named_params() + extra


SPLIT = {"fused": (ROWS, ROWS), "fused3": (ROWS // 2, ROWS + ROWS // 2)}
#: what each optimizer takes beyond Muon's options: Scion a radius (its directions scaled
#: after the LMOs) and a non-spectral norm
EXTRA = {"scion": {"radius": 0.7, "norms": {"tall": "colnorm"}}}


def stepped(name, oracle, steps=3, **options):
    """Parameters and optimizer after `steps` steps; `oracle`: Newton-Schulz as a custom
    orthogonalizer, whose results the step keeps apart from the updates (and scales and
    finishes out of place), stacked whole where stacking pays, else one call per block as
    Muon's own (a transposed weight's block goes in as the same strided view)."""
    named = in_place_params()
    if oracle:
        options["orthogonalizer"] = lambda x: ns_module.newton_schulz(x)
    opt = OPTIMIZERS[name](named, split=SPLIT, transposed=["t"], **EXTRA.get(name, {}), **options)
    if oracle:
        opt.stacks = lambda device: muon_module.stacking_pays(device)
    return _steps(named, opt, seed=4, steps=steps)


@pytest.mark.parametrize("stack", [True, False], ids=["stacked", "one-by-one"])
@pytest.mark.parametrize("limit", [None, 1, 3])
@pytest.mark.parametrize("nesterov", [True, False])
@pytest.mark.parametrize("name", OPTIMIZERS)
def test_results_written_into_the_updates_are_bitwise_those_kept_apart(
    monkeypatch, name, nesterov, limit, stack
):
    """Every variant, with Nesterov (updates the step owns, written over) and without (the
    momentum buffer, never written over), stacked in chunks of `limit` matrices or one by one
    (CPU), split blocks, a conv weight and a transposed one: bitwise the step whose results
    stay apart (one thread: Newton-Schulz gives each matrix what it gets alone)."""
    if stack:
        monkeypatch.setattr(ns_module, "stacking_pays", lambda device: True)
        monkeypatch.setattr(muon_module, "stacking_pays", lambda device: True)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        mb = None if limit is None else cap(limit)
        got, opt = stepped(name, False, nesterov=nesterov, ns_batch_mb=mb)
        want, want_opt = stepped(name, True, nesterov=nesterov)
    finally:
        torch.set_num_threads(threads)
    for n, p in got.items():
        assert torch.equal(p, want[n]), n
        state = opt.state[p]
        assert state.keys() == want_opt.state[want[n]].keys()
        for key, value in state.items():
            assert torch.equal(value, want_opt.state[want[n]][key]), (n, key)


#: whether the step writes each variant's results into its updates, with Nesterov and without
OWNS = {
    "muon": (True, False),
    "normuon": (True, False),
    "scion": (True, False),
    "adamuon": (True, True),  # its update is the sign of Muon's, a fresh tensor either way
    "polargrad": (False, False),  # its `finish` reads the update again
}


@pytest.mark.parametrize("nesterov", [True, False])
@pytest.mark.parametrize("name", OPTIMIZERS)
def test_the_directions_take_the_updates_storage_where_the_step_owns_them(stacked, name, nesterov):
    """The step holds the updates or their results, not both: each direction is its update's
    storage where the update is the step's own (`owns_updates`; a variant's `finish` and
    Scion's radius in place too), except the transposed weight's (not contiguous) and a
    non-spectral LMO's; the momentum buffer an update without Nesterov is stays as `prepare`
    left it."""
    named, opt = stepped(name, False, steps=0, nesterov=nesterov, ns_batch_mb=cap(2))
    group = opt.param_groups[0]
    owns = OWNS[name][not nesterov]
    gen = torch.Generator().manual_seed(5)
    items = []
    for p in named.values():
        p.grad = torch.randn(p.shape, generator=gen)
        items.append((opt.prepare(p.grad, opt.state_of(p, group), group), opt.state[p]))
    before = [u.clone() for u, _ in items]
    found = opt.directions(items, group, list(named))
    for n, (u, state), d, u0 in zip(named, items, found, before, strict=True):
        shared = d.untyped_storage().data_ptr() == u.untyped_storage().data_ptr()
        spectral = n not in EXTRA.get(name, {}).get("norms", {})  # Scion's LMOs read it
        assert shared is (owns and spectral and n != "t"), n
        if not owns:
            assert torch.equal(u, u0), n  # the update (the momentum buffer) read only
        if name != "adamuon" and not nesterov:
            assert u is state["momentum_buffer"]
    assert opt.owns_updates(group) is owns
