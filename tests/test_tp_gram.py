"""The `gram` tensor-parallel mode against the single-device Gram form, on real gloo ranks:
float64 equality at tp 2 and 4, its collectives (one packed all-reduce per run of the
restart schedule, none for the norm) and their bytes equal to `tp_cost`, `auto` among the
three modes, and Muon through the layer-wise driver with tp equal to one process."""

import traceback

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

from orthoptim import kernels
from orthoptim.comm_bytes import CommStats
from orthoptim.kernels import syrk_cpu
from orthoptim.newton_schulz import (
    coefficient_schedule,
    newton_schulz,
    newton_schulz_gram_form,
)
from orthoptim.parallel import TensorParallelOrthogonalizer
from orthoptim.parallel.tensor_parallel import (
    GRAM_KIND,
    NORM_KIND,
    ROWS_KIND,
    SHAPES_KIND,
    CostModel,
    _Layout,
    gram_mode_form,
    gram_restarts,
    gram_runs,
    tp_cost,
)
from orthoptim.shards import packed_triangle_size, shard_sizes

from distributed import run_ranks

# a slow link: the Gram matrices travel packed (`CostModel.packs`)
PACKED = CostModel(bandwidth=1e3)

STEPS = 5
# float64: the sharded Gram sums in another order and the norm comes from its trace; the
# iteration amplifies that rounding (~1e-16) to about 1e-14 measured (wide, tall, square,
# stacked, uneven, the `rows` route), so 1e-12 leaves a hundredfold margin.
F64_RTOL = 1e-12
# against the standard (step) iteration in float32: measured max |Δ| ≤ 1.2e-6 (64×256,
# 256×64, 128², 192×512 at tp 2), the tolerance test_tensor_parallel.py gives the other modes
FP32_TOL = 2e-5
# bfloat16 iteration against the float32 standard one. The Gram form squares the condition
# number (why single-device Newton-Schulz keeps it off half precision): measured at tp 4 over
# 6 seeds max |Δ| 0.057 on square 32² (distributed mode 0.019, duplicated 0.010), 0.039 on
# 24×64, 0.041 on 16×48; entries are O(0.2), bf16 keeps 8 bits
BF16_TOL = 0.08
# name: (global shape, shard dims) for plain local shards; each divides by 2 and 4
SHAPES = {
    "wide": ((2, 24, 64), (0, 1)),
    "tall": ((2, 64, 24), (0, 1)),
    "square": ((1, 32, 32), (0, 1)),
    "stacked": ((2, 3, 16, 48), (0, 1)),
}
# DTensor inputs with uneven shards (10 and 13 divide by neither 2 nor 4): (shape, tensor dim)
UNEVEN = {"uneven 13 rows": ((2, 13, 10), 1), "uneven 13 cols": ((2, 10, 13), 2),
          "uneven 10 rows": ((2, 10, 13), 1), "uneven 10 cols": ((2, 13, 10), 2)}  # fmt: skip


def _full(shape, seed, dtype=torch.float64):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=dtype)


def gram_reference(G: torch.Tensor, steps: int = STEPS) -> torch.Tensor:
    """The single-device Gram-form Newton-Schulz of every matrix of G (the oracle)."""
    tall = G.shape[-2] > G.shape[-1]
    Y = G.mT if tall else G
    Z = Y / torch.linalg.matrix_norm(Y, keepdim=True)
    out = newton_schulz_gram_form(Z, coefficient_schedule("quintic", steps))
    return out.mT if tall else out


def _matrix_dim(shape, shard_dim):
    return len(shape) - 2 + shard_dim


def _run(orth, local):
    stats = orth.stats
    stats.reset()
    with kernels.force_matmul(), FlopCounterMode(display=False) as counter:
        out = orth(local)
    # the mode's own collectives (tp_cost's); plain shards' shape check apart
    return {"out": out, "stats": stats.without(SHAPES_KIND).as_dict(),
            "shape_checks": stats.calls.get(SHAPES_KIND, 0),
            "flops": counter.get_total_flops(), "forms": list(orth.last_forms)}  # fmt: skip


def _recording_syrk(calls):
    """A plain-matmul SYRK that records each call: "G" for a Gram matrix X·Xᵀ (a restart),
    "Q" for a step's b·A + c·A·A. The string of calls spells the restart schedule."""

    def syrk(X, C, beta, alpha):
        calls.append("G" if C is None else "Q")
        return syrk_cpu.syrk_matmul(X, C, beta, alpha)

    return syrk


def _mode_checks(group, mesh):
    """Gram mode (and the standard modes in float32 / bf16) on plain and DTensor shards."""
    from torch.distributed.tensor import Shard, distribute_tensor

    rank, T = dist.get_rank(group), dist.get_world_size(group)
    res = {}
    for i, (name, (shape, dims)) in enumerate(SHAPES.items()):
        G = _full(shape, seed=i)
        for shard_dim in dims:
            d = _matrix_dim(shape, shard_dim)
            local = G.chunk(T, dim=d)[rank].contiguous()
            orth = TensorParallelOrthogonalizer(
                group, "gram", shard_dim, STEPS, cost_model=PACKED, stats=CommStats()
            )
            res[(name, shard_dim)] = _run(orth, local)
            # float32 and bf16 iterations against the standard float32 iteration
            for dt in (torch.float32, torch.bfloat16):
                orth = TensorParallelOrthogonalizer(group, "gram", shard_dim, STEPS, ns_dtype=dt)
                res[(name, shard_dim, dt)] = orth(local.float())
    for j, (name, (shape, d)) in enumerate(UNEVEN.items()):
        D = distribute_tensor(_full(shape, seed=50 + j), mesh, [Shard(d)])
        orth = TensorParallelOrthogonalizer(
            mode="gram", steps=STEPS, cost_model=PACKED, stats=CommStats()
        )
        got = _run(orth, D)
        got["placements"] = got["out"].placements == D.placements
        got["out"] = got["out"].full_tensor()
        res[name] = got
    # the restart schedule, at every step count from 1 to 7: the sequence of Gram products
    # and steps is the single-device Gram form's (recorded SYRK calls), one all-reduce a run
    G = _full((1, 16, 48), seed=99)
    local = G.chunk(T, dim=2)[rank].contiguous()
    real = kernels.syrk_for
    for steps in range(1, 8):
        seen: dict[str, list[str]] = {"tp": [], "single": []}
        kernels.syrk_for = lambda X, calls=seen["tp"]: _recording_syrk(calls)
        try:
            orth = TensorParallelOrthogonalizer(group, "gram", 1, steps, stats=CommStats())
            out = orth(local)
        finally:
            kernels.syrk_for = real
        Z = G / torch.linalg.matrix_norm(G, keepdim=True)
        schedule = coefficient_schedule("quintic", steps)
        newton_schulz_gram_form(Z, schedule, syrk=_recording_syrk(seen["single"]))
        ref = gram_reference(G, steps).chunk(T, dim=2)[rank]
        own = orth.stats.without(SHAPES_KIND).as_dict()  # plain shards' shape check apart
        res[("restarts", steps)] = {"runs": seen, "stats": own,
                                    "err": ((out - ref).norm() / ref.norm()).item()}  # fmt: skip
    # auto among duplicated, distributed and gram, on DTensors: the same pick on every rank
    for name, d, model in AUTO_CASES:
        D = distribute_tensor(_full((2, 16, 64), seed=7), mesh, [Shard(d)])
        orth = TensorParallelOrthogonalizer(mode="auto", steps=STEPS, cost_model=model)
        out = orth(D)
        res[("auto", name)] = {"modes": orth.last_modes, "forms": orth.last_forms,
                               "out": out.full_tensor()}  # fmt: skip
    return res


# auto on 2 × 16×64 split along its columns (long side: the Gram route) or rows (short side:
# the rows route): where gram is cheapest. Slow matmuls and slow collectives: gram's two
# rounds and its small flops beat duplicated's whole iteration and distributed's 6 rounds;
# slow matmuls alone: the rows route is distributed's rows form without its norm round.
AUTO_CASES = (
    ("wide", 2, CostModel(bandwidth=1e12, latency=0.05, throughput=1e6)),
    ("rows", 1, CostModel(bandwidth=1e12, latency=1e-3, throughput=1e6)),
)


# -- Muon through the drivers ---------------------------------------------------------------

WIDTH, HIDDEN, NARROW, BATCH, TRAIN_STEPS = 16, 48, 8, 8, 3


class MLP(nn.Module):
    """Column- and row-parallel pairs, one split along each matrix's long side (48) and one
    along its short side (8: the `rows` route), then a replicated head."""

    def __init__(self):
        super().__init__()
        self.up = nn.Linear(WIDTH, HIDDEN, bias=False)  # [48, 16] split rows: long side
        self.down = nn.Linear(HIDDEN, WIDTH, bias=False)  # [16, 48] split cols: long side
        self.narrow_in = nn.Linear(WIDTH, NARROW, bias=False)  # [8, 16] split rows: short
        self.narrow_out = nn.Linear(NARROW, WIDTH, bias=False)  # [16, 8] split cols: short
        self.head = nn.Linear(WIDTH, 4, bias=False)

    def forward(self, x):
        x = x + self.down(nn.functional.gelu(self.up(x)))
        x = x + self.narrow_out(nn.functional.gelu(self.narrow_in(x)))
        return self.head(x)


def _model():
    torch.manual_seed(0)
    return MLP().double()


def _data():
    g = torch.Generator().manual_seed(3)
    return [(torch.randn(BATCH, WIDTH, generator=g, dtype=torch.float64),
             torch.randn(BATCH, 4, generator=g, dtype=torch.float64))
            for _ in range(TRAIN_STEPS)]  # fmt: skip


def _train(model, opt):
    for x, y in _data():
        nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        opt.zero_grad()


KW = dict(optimizer="muon", lr=0.02, adamw_lr=3e-3)


def _parallel(mesh):
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    plan = {"up": ColwiseParallel(), "down": RowwiseParallel(),
            "narrow_in": ColwiseParallel(), "narrow_out": RowwiseParallel()}  # fmt: skip
    return parallelize_module(_model(), mesh, plan)


def _full_params(model):
    return {
        n: (p.full_tensor() if hasattr(p, "full_tensor") else p.detach())
        for n, p in model.named_parameters()
    }


def _drivers(mesh1d, mesh2d):
    """Muon with the gram orthogonalizer: on its own over tp 4, and in the layer-wise driver
    over dp 2 × tp 2 (every dp rank the same batches, so the mean gradient is the batch's)."""
    from orthoptim import LayerwiseDistributedOptimizer, build_optimizer

    out = {}
    model = _parallel(mesh1d)
    orth = TensorParallelOrthogonalizer(mode="gram", steps=STEPS)
    _train(model, build_optimizer(model, orthogonalizer=orth, **KW))
    out["muon tp4"] = {"params": _full_params(model), "modes": set(orth.last_modes),
                       "forms": set(orth.last_forms)}  # fmt: skip
    model = _parallel(mesh2d["tp"])
    orth = TensorParallelOrthogonalizer(mode="gram", steps=STEPS)
    opt = LayerwiseDistributedOptimizer(
        model, orthogonalizer=orth, process_group=mesh2d["dp"].get_group(), **KW
    )
    _train(model, opt)
    opt.wait_for_params()
    out["layerwise dp2 tp2"] = {"params": _full_params(model), "modes": set(orth.last_modes),
                                "forms": set(orth.last_forms)}  # fmt: skip
    return out


def _all_checks(rank, world_size):
    from torch.distributed.device_mesh import init_device_mesh

    mesh4 = init_device_mesh("cpu", (4,))
    mesh2d = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    out = {4: _mode_checks(None, mesh4), 2: _mode_checks(mesh2d["tp"].get_group(), mesh2d["tp"])}
    try:  # a training run that fails (a non-finite step) fails its own test, not every one
        out["drivers"] = _drivers(mesh4, mesh2d)
    except Exception:
        out["drivers"] = traceback.format_exc()
    return out


@pytest.fixture(scope="module")
def ranks():
    return run_ranks(_all_checks, 4)


def _slices(full, T, d, sizes=None):
    return full.split(sizes or shard_sizes(full.shape[d], T), dim=d)


def _rel(a, b):
    return ((a - b).norm() / b.norm()).item()


@pytest.mark.parametrize("T", [2, 4])
def test_gram_mode_equals_the_single_device_gram_form_in_float64(ranks, T):
    """Wide, tall, square and stacked plain shards along either side, and uneven DTensor
    shards: each rank's block of the result is the single-device Gram form's (1e-12)."""
    for rank in range(4):
        res, tp_rank = ranks[rank][T], rank % T
        for i, (name, (shape, dims)) in enumerate(SHAPES.items()):
            ref = gram_reference(_full(shape, seed=i))
            for shard_dim in dims:
                got = res[(name, shard_dim)]
                want = _slices(ref, T, _matrix_dim(shape, shard_dim))[tp_rank]
                assert got["out"].shape == want.shape and got["out"].dtype == torch.float64
                assert _rel(got["out"], want) <= F64_RTOL, (name, shard_dim, T)
        for j, (name, (shape, _)) in enumerate(UNEVEN.items()):
            got = res[name]
            ref = gram_reference(_full(shape, seed=50 + j))
            assert got["placements"], name
            assert _rel(got["out"], ref) <= F64_RTOL, (name, T)


@pytest.mark.parametrize("T", [2, 4])
def test_gram_mode_stays_within_the_tolerance_of_the_standard_iteration(ranks, T):
    """Float32 and bfloat16 gram iterations against the standard float32 step iteration."""
    for rank in range(4):
        res = ranks[rank][T]
        for i, (name, (shape, dims)) in enumerate(SHAPES.items()):
            ref = newton_schulz(_full(shape, seed=i).float(), steps=STEPS)
            for shard_dim in dims:
                want = _slices(ref, T, _matrix_dim(shape, shard_dim))[rank % T]
                for dt, tol in ((torch.float32, FP32_TOL), (torch.bfloat16, BF16_TOL)):
                    got = res[(name, shard_dim, dt)]
                    assert got.dtype == torch.float32
                    assert (got - want).abs().max().item() <= tol, (name, shard_dim, dt, T)


@pytest.mark.parametrize("T", [2, 4])
def test_gram_mode_collectives_bytes_and_flops_are_tp_cost(ranks, T):
    """Per batch: long side split: one packed Gram all-reduce per run of the restart
    schedule (2 at 5 steps), no norm all-reduce, nothing else; short side: the `rows`
    route's gathers, no all-reduce at all. Recorded bytes, calls and (busiest rank's)
    matmul flops equal `tp_cost("gram", ...)`."""
    for rank in range(4):
        res = ranks[rank][T]
        for name, (shape, dims) in SHAPES.items():
            rows, cols = shape[-2:]
            k = shape[0] * (shape[1] if len(shape) == 4 else 1)
            for shard_dim in dims:
                got = res[(name, shard_dim)]
                s = got["stats"]
                form = gram_mode_form(rows, cols, shard_dim)
                assert got["forms"] == [form]
                assert NORM_KIND not in s
                if form == "gram":
                    p = (cols, rows)[shard_dim]
                    assert set(s) == {GRAM_KIND, "total"}, s
                    assert s[GRAM_KIND]["calls"] == gram_restarts(STEPS) == 2
                    assert s[GRAM_KIND]["sent"] == pytest.approx(
                        2 * 2 * (T - 1) / T * k * packed_triangle_size(p) * 8
                    )
                else:
                    assert set(s) == {ROWS_KIND, "total"}, s
                    assert s[ROWS_KIND]["calls"] == 2 * STEPS
                model = tp_cost("gram", k, rows, cols, shard_dim, T, STEPS, 8)
                assert s["total"]["sent"] == pytest.approx(model.bytes_sent), (name, shard_dim)
                assert s["total"]["calls"] == model.rounds
                assert got["shape_checks"] == 1  # plain shards: one all-gather of the shapes
                flops = [ranks[q][T][(name, shard_dim)]["flops"] for q in range(4)]
                assert max(flops) == model.flops, (name, shard_dim, flops, model)
        for name, (shape, d) in UNEVEN.items():
            rows, cols = shape[-2:]
            s = res[name]["stats"]
            model = tp_cost("gram", shape[0], rows, cols, d - 1, T, STEPS, 8)
            assert res[name]["forms"] == [gram_mode_form(rows, cols, d - 1)]
            assert NORM_KIND not in s
            assert s["total"]["calls"] == model.rounds, name
            if res[name]["forms"] == ["gram"]:  # the all-reduce's bytes do not depend on shards
                assert s["total"]["sent"] == pytest.approx(model.bytes_sent), name


def test_restarts_follow_the_single_device_schedule(ranks):
    """At 1 to 7 steps the mode restarts where the single-device Gram form does (the same
    sequence of Gram products and steps), one Gram all-reduce per run (≤ 2 up to 6 steps),
    and still equals it in float64."""
    for rank in range(4):
        for T in (2, 4):
            for steps in range(1, 8):
                got = ranks[rank][T][("restarts", steps)]
                runs = gram_runs(steps)
                spelled = "".join("G" + "Q" * n for n in runs)
                assert "".join(got["runs"]["tp"]) == "".join(got["runs"]["single"]) == spelled, (
                    steps,
                    got["runs"],
                )
                assert got["stats"][GRAM_KIND]["calls"] == len(runs) == gram_restarts(steps)
                assert got["stats"]["total"]["calls"] == len(runs)
                assert len(runs) <= 2 or steps > 6
                assert got["err"] <= F64_RTOL, (steps, got["err"])


def test_auto_picks_gram_where_latency_dominates_and_agrees_across_ranks(ranks):
    for T in (2, 4):
        for name, form in (("wide", "gram"), ("rows", "rows")):
            picks = {tuple(ranks[r][T][("auto", name)]["modes"]) for r in range(4)}
            assert picks == {("gram",)}, (T, name, picks)
            assert ranks[0][T][("auto", name)]["forms"] == [form]
            ref = gram_reference(_full((2, 16, 64), seed=7))
            assert _rel(ranks[0][T][("auto", name)]["out"], ref) <= F64_RTOL


def test_auto_cost_model_prices_all_three_modes():
    """`choose_mode` compares duplicated, distributed and gram (in float32): each wins where
    its cost is the lowest (gram: few rounds; distributed: flops split T ways; duplicated:
    one gather)."""
    layout = _Layout(None, 4, 0, -1, (1024,) * 4)
    k, rows, cols = 4, 1024, 4096
    cases = {
        "gram": CostModel(bandwidth=1e12, latency=1e-2, throughput=1e12),
        "distributed": CostModel(bandwidth=1e12, latency=0.0, throughput=1e6),
        "duplicated": CostModel(bandwidth=1e12, latency=1e-2, throughput=1e18),
    }
    for want, model in cases.items():
        orth = TensorParallelOrthogonalizer(cost_model=model, ns_dtype=torch.float32)
        args = (k, rows, cols, 1, 4, STEPS, 4)
        seconds = {
            "duplicated": model.seconds(tp_cost("duplicated", *args)),
            "distributed": model.seconds(
                tp_cost("distributed", *args, form=orth.choose_form(*args))
            ),
            "gram": model.seconds(tp_cost("gram", *args)),
        }
        assert min(seconds, key=seconds.__getitem__) == want, seconds
        assert orth.choose_mode(k, rows, cols, layout, "cpu") == want
    # in bfloat16 auto keeps to the step form's modes (gram squares the condition number),
    # even where gram would be the cheapest; mode="gram" still forces it
    bf16 = TensorParallelOrthogonalizer(cost_model=cases["gram"], ns_dtype=torch.bfloat16)
    assert bf16.choose_mode(k, rows, cols, layout, "cpu") in ("duplicated", "distributed")
    forced = TensorParallelOrthogonalizer(mode="gram", ns_dtype=torch.bfloat16)
    assert forced.choose_mode(k, rows, cols, layout, "cpu") == "gram"
    # gram's rounds: one per restart run whatever the steps; distributed's steps + 1
    for steps in (3, 5, 8):
        gram = tp_cost("gram", 1, rows, cols, 1, 8, steps, 2)
        dist_ = tp_cost("distributed", 1, rows, cols, 1, 8, steps, 2, "apply")
        assert gram.rounds == gram_restarts(steps) < dist_.rounds == steps + 1


@pytest.mark.parametrize("driver", ["muon tp4", "layerwise dp2 tp2"])
def test_muon_with_gram_mode_equals_one_process_in_float64(ranks, driver):
    """Three Muon steps of the MLP in float64: every parameter as the single process's
    (whose Newton-Schulz is the standard step iteration: equal to rounding, 1e-10)."""
    model = _model()
    from orthoptim import build_optimizer

    _train(model, build_optimizer(model, **KW))
    ref = dict(model.named_parameters())
    for r in ranks:
        assert isinstance(r["drivers"], dict), r["drivers"]
        got = r["drivers"][driver]
        assert got["modes"] == {"gram"}
        assert got["forms"] == {"gram", "rows"}
        for n, p in got["params"].items():
            torch.testing.assert_close(p, ref[n].detach(), rtol=1e-10, atol=1e-12, msg=n)
