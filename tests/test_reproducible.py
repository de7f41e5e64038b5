"""`reproducible=True` (issue 53): the same 8 micro-batches per step, split over dp 1, 2 and 4
real gloo ranks (8, 4 and 2 micro-batches each, through `no_sync`), give the same bits in
every parameter, every state entry and every clip norm; the default mode does not (the
control), and each planted defect — one rank summing its micro-batches in arrival order,
one bucket reduced by the ring, a clip norm summed in the owners' order, Newton-Schulz
batches that follow what a rank owns — is seen."""

import math

import pytest
import torch
from tests.distributed import run_ranks
from tests.models.layerwise import TinyGPT
from tests.models.reproducible import micro_batch, train

from orthoptim import FSDPOptimizer, LayerwiseDistributedOptimizer
from orthoptim.optim.contract import MatrixOptimizer
from orthoptim.parallel import clip
from orthoptim.parallel.assignment import aligned_split
from orthoptim.parallel.layerwise.ownership import inner_parts
from orthoptim.parallel.ordered import block_power_sums, tree_power_sum, tree_sum_, tree_total

MUON = dict(optimizer="muon", lr=0.02, adamw_lr=3e-3, weight_decay=0.01, clip=0.5)


def runs(config, sizes=(1, 2, 4), steps=4, **kw):
    """Rank 0's result of `train` at each data-parallel size."""
    return {n: run_ranks(train, n, args=(config, steps), **kw)[0] for n in sizes}


def differing(a, b):
    """How many elements differ in their bits between two {name: bits} dicts."""
    assert a.keys() == b.keys()
    return sum(int((a[k] != b[k]).sum()) for k in a)


def assert_same_bits(results):
    base = results[1]
    for n, r in results.items():
        assert differing(base["params"], r["params"]) == 0, f"parameters at dp {n}"
        assert differing(base["state"], r["state"]) == 0, f"optimizer state at dp {n}"
        assert all(torch.equal(a, b) for a, b in zip(base["norms"], r["norms"])), n


def test_muon_with_clipping_has_the_same_bits_at_dp_1_2_4_and_the_default_does_not():
    assert_same_bits(runs({**MUON, "reproducible": True}))
    default = runs(MUON, sizes=(1, 2))
    # the control: the same runs without reproducible differ (so the check above can fail)
    assert differing(default[1]["params"], default[2]["params"]) > 0


@pytest.mark.slow
@pytest.mark.parametrize(
    "config",
    [
        dict(optimizer="normuon", lr=0.02, adamw_lr=3e-3, clip=0.5),
        dict(optimizer="soap", lr=3e-3, adamw_lr=3e-3, clip=0.5),
        dict(optimizer="adamw", lr=3e-3, clip=0.5),
        dict(MUON, param_dtype=torch.bfloat16),
        dict(MUON, state_dtype=torch.bfloat16),
        dict(MUON, overlap_grad_reduce=False, overlap_param_gather=False),
    ],
    ids=["normuon", "soap", "adamw", "bf16-params", "bf16-state", "no-overlap"],
)
def test_every_optimizer_and_precision_has_the_same_bits_at_dp_1_2_4(config):
    assert_same_bits(runs({**config, "reproducible": True}))


def test_adamw_units_cut_into_runs_of_whole_norm_blocks_keep_the_bits_at_dp_1_2_4():
    """With 64-element norm blocks the embedding (2048 elements) and the other AdamW units are
    sharded in runs over the ranks (the runs start and end on blocks): still the same bits, in
    float64 (AdamW steps runs of other lengths at each size; the norm over runs cut inside a
    block is the clip-norm test's plant)."""
    results = {n: run_ranks(_small_blocks, n, args=({**MUON, "reproducible": True}, 4))[0]
               for n in (1, 2, 4)}  # fmt: skip
    assert_same_bits(results)
    assert results[2]["cut"] > 0 and results[4]["cut"] > 0


def _small_blocks(rank, world_size, config, steps):
    import orthoptim.parallel.ordered as ordered

    ordered.NORM_BLOCK = 64
    return train(rank, world_size, config, steps, dtype=torch.float64)


def test_a_run_resumed_at_dp_4_from_dp_2_ends_on_the_uninterrupted_runs_bits():
    config = {**MUON, "reproducible": True}
    whole = run_ranks(train, 2, args=(config, 4))[0]
    half = run_ranks(train, 2, args=(config, 2))[0]["full"]
    resumed = run_ranks(_resume, 4, args=(config, half, 2, 4))[0]
    assert differing(whole["params"], resumed["params"]) == 0
    assert differing(whole["state"], resumed["state"]) == 0
    assert all(torch.equal(a, b) for a, b in zip(whole["norms"][2:], resumed["norms"]))


def _resume(rank, world_size, config, state, first, steps):
    return train(rank, world_size, config, steps, resume=(state, first))


@pytest.mark.parametrize("defect,size", [("linear", 2), ("ring", 4)])
def test_a_planted_defect_breaks_the_bits(defect, size):
    """One rank's linear accumulation, or one bucket left to the ring reduction (at 4 ranks:
    a ring of 2 adds its two terms once, as the tree does): the run no longer has dp 1's
    bits (so the bitwise test guards against each)."""
    config = {**MUON, "reproducible": True}
    ref = run_ranks(train, 1, args=(config, 3))[0]
    bad = run_ranks(_planted, size, args=(config, 3, defect))[0]
    assert differing(ref["params"], bad["params"]) > 0


def _planted(rank, world_size, config, steps, defect):
    return train(rank, world_size, config, steps, defect=defect)


# -- the clip norm ---------------------------------------------------------------------------


def _norm_terms():
    """Gradients whose float64 sum of squares rounds differently in another order: values
    spread over many magnitudes."""
    g = torch.Generator().manual_seed(3)
    return [
        torch.randn(257, generator=g) * 10.0 ** float(torch.randint(-6, 7, (), generator=g))
        for _ in range(24)
    ]


BLOCK = 64
SPLITS = {1: [4096], 2: [2000, 2096], 4: [1000, 1100, 996, 1000]}  # a sharded unit's runs


def _norms(rank, world_size, aligned):
    """The float64 clip norms of `_norm_terms` (units held whole, dealt round-robin) and a
    4096-element unit sharded in runs (`SPLITS`, moved onto 64-element blocks by the
    driver's `aligned_split` when `aligned`): ordered, and in the owners' order (`clip_`)."""
    terms, big = _norm_terms(), torch.cat(_norm_terms())[:4096]
    split = SPLITS[world_size]
    if aligned:
        split = aligned_split(split, [big.numel()], BLOCK)
    lo = sum(split[:rank])
    run = big[lo : lo + split[rank]]
    mine = [(i, t) for i, t in enumerate(terms) if i % world_size == rank]
    device = torch.device("cpu")
    items = [(i, tree_power_sum(t, 2.0, torch.float64, BLOCK).reshape(1)) for i, t in mine]
    items.append((len(terms) + lo // BLOCK, block_power_sums(run, 2.0, torch.float64, BLOCK)))
    spans = [(i, 1) for i in range(len(terms))] + [(len(terms), big.numel() // BLOCK)]
    ordered = clip.ordered_norm(items, spans, 2.0, device, [None])
    counted = [t for _, t in mine] + [run]
    default = clip.clip_(counted, [], 1e30, 2.0, False, device, [None], None)
    return ordered.view(torch.int64).item(), default.view(torch.int64).item()


def test_the_ordered_clip_norm_has_the_same_bits_on_1_2_4_ranks_and_the_default_does_not():
    """Units held whole and a unit sharded in runs on whole blocks: one norm's bits at every
    size; the owners' order (the default) and runs cut inside blocks (planted: no
    `aligned_split`) each give other bits."""
    got = {n: run_ranks(_norms, n, args=(True,))[0] for n in (1, 2, 4)}
    assert len({ordered for ordered, _ in got.values()}) == 1
    assert len({default for _, default in got.values()}) > 1  # the control
    unaligned = {n: run_ranks(_norms, n, args=(False,))[0][0] for n in (2, 4)}
    assert any(bits != got[1][0] for bits in unaligned.values())
    exact = math.fsum(float(t.double().square().sum()) for t in _norm_terms())
    exact += math.fsum(float(x) ** 2 for x in torch.cat(_norm_terms())[:4096].double())
    norm = torch.tensor(got[1][0]).view(torch.float64).item()
    assert math.isclose(norm**2, exact, rel_tol=1e-12)


def test_the_fixed_trees_sum_in_the_order_they_name():
    rows = torch.tensor([[1e16], [1.0], [-1e16], [1.0]], dtype=torch.float64)
    # ((1e16 + 1) + (-1e16 + 1)) = 1e16 + -1e16 = 0 in float64; left to right gives 1.0
    assert tree_sum_(rows.clone()).item() == 0.0
    assert tree_total(torch.tensor([1e16, 1.0, -1e16], dtype=torch.float64)).item() == 0.0
    x = torch.randn(1000, dtype=torch.float64)
    assert math.isclose(float(tree_power_sum(x, 2, torch.float64)), float(x.square().sum()))
    assert float(tree_power_sum(x, math.inf, torch.float64)) == float(x.abs().max())
    with pytest.raises(ValueError, match="power-of-two"):
        tree_sum_(torch.zeros(3, 1))


# -- Newton-Schulz batches -------------------------------------------------------------------


def _ns_batches(rank, world_size, batch_matrices, reproducible=True):
    """Every Newton-Schulz call's batch shape and why its path was taken (`kernels.path_for`),
    on a device where stacking pays (as a GPU's), through the layer-wise driver;
    `batch_matrices` forced back on for the control."""
    import orthoptim.optim.muon as muon
    from orthoptim import kernels

    calls = []
    real = muon.newton_schulz

    def recorded(mats, **kw):
        oriented = mats if mats.shape[-2] <= mats.shape[-1] else mats.mT
        calls.append((tuple(mats.shape), kernels.path_for(oriented).reason))
        return real(mats, **kw)

    muon.newton_schulz, muon.stacking_pays = recorded, lambda device: True
    torch.manual_seed(0)
    model = TinyGPT(layers=3)
    opt = LayerwiseDistributedOptimizer(model, optimizer="muon", lr=0.02, reproducible=reproducible)
    for part in inner_parts(opt.inner):
        if isinstance(part, MatrixOptimizer):
            part.batch_matrices = batch_matrices
    x, y = micro_batch(0, rank)
    torch.nn.functional.cross_entropy(model(x).flatten(0, 1), y.flatten()).backward()
    opt.step()
    return calls


def test_newton_schulz_takes_each_matrix_alone_on_a_path_its_shape_decides():
    """Planted: with same-shape matrices batched (as on a GPU), the batches follow what a
    rank owns (dp 1 stacks the 3 blocks' same-shape matrices); reproducible takes each alone,
    on a path its shape decides (`kernels.unraced`: "forced"), where the default's path is
    raced, read from the machine's cache or defaulted (never "forced")."""
    control = run_ranks(_ns_batches, 1, args=(True,))[0]
    assert any(shape[0] > 1 for shape, _ in control if len(shape) == 3)
    for n in (1, 2):
        for calls in run_ranks(_ns_batches, n, args=(False,)):
            assert all(len(shape) == 2 or shape[0] == 1 for shape, _ in calls), calls
            assert {why for _, why in calls} == {"forced"}
    default = run_ranks(_ns_batches, 1, args=(True, False))[0]
    assert "forced" not in {why for _, why in default}


# -- what the guarantee covers ---------------------------------------------------------------


def test_a_micro_batch_count_that_is_not_a_power_of_two_is_refused_on_every_rank():
    results = run_ranks(_three_micro_batches, 2)
    for lines in results:
        assert lines and any("power-of-two number" in line for line in lines), lines


def _three_micro_batches(rank, world_size):
    from orthoptim.parallel.base import StepRefusedError

    torch.manual_seed(0)
    model = TinyGPT(layers=1)
    opt = LayerwiseDistributedOptimizer(model, optimizer="muon", lr=0.02, reproducible=True)
    for i in range(3):
        x, y = micro_batch(0, 3 * rank + i)
        with opt.no_sync() if i < 2 else torch.enable_grad():
            torch.nn.functional.cross_entropy(model(x).flatten(0, 1), y.flatten()).backward()
    try:
        opt.step()
    except StepRefusedError as e:
        return e.lines
    return []


def test_layouts_outside_the_guarantee_are_refused_in_one_line():
    for line in run_ranks(_three_ranks, 3):
        assert "covers data parallelism alone over 1, 2, 4, 8" in line and "3 ranks" in line
    with pytest.raises(ValueError, match="LayerwiseDistributedOptimizer"):
        FSDPOptimizer(TinyGPT(layers=1), optimizer="muon", reproducible=True)


def _three_ranks(rank, world_size):
    try:
        LayerwiseDistributedOptimizer(TinyGPT(layers=1), optimizer="muon", reproducible=True)
    except ValueError as e:
        return str(e)
    return "built"
