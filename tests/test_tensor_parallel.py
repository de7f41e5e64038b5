"""Tensor-parallel Newton-Schulz against the full matrix, on real gloo ranks."""

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

from orthoptim import kernels
from orthoptim.collectives import all_reduce, all_reduce_symmetric
from orthoptim.comm_bytes import CommStats
from orthoptim.newton_schulz import newton_schulz
from orthoptim.parallel import TensorParallelOrthogonalizer
from orthoptim.parallel.tensor_parallel import (
    FORMS,
    GRAM_KIND,
    NORM_KIND,
    ROWS_KIND,
    SHAPES_KIND,
    SPLIT_KIND,
    CostModel,
    _Layout,
    split_plan,
    tp_cost,
)
from orthoptim.shards import packed_triangle_size, shard_sizes

from distributed import run_ranks

# a slow link: the Gram matrices travel packed (`CostModel.packs`)
PACKED = CostModel(bandwidth=1e3)

STEPS = 5
# fp32: the sharded iteration sums the Gram in another order than the single-device one;
# five steps amplify that rounding to well under this (entries are O(1/sqrt(cols))).
FP32_TOL = 2e-5
# bf16 iteration: entries are O(0.2) here, bf16 keeps 8 bits of mantissa.
BF16_TOL = 0.05
VARIANTS = (
    ("duplicated", "apply"),
    ("distributed", "apply"),
    ("distributed", "square"),
    ("distributed", "split"),
    ("distributed", "rows"),
    ("blockwise", "apply"),
)
# The Muon variants checked under dp2 × tp2 (their own maths runs on DTensor matrices).
TP_VARIANTS = ("normuon", "adamuon", "polargrad", "scion")
# (k, rows, cols): tall and wide, divisible by 2 and 4.
SHAPES = [(2, 24, 40), (3, 48, 16)]


def _full(k, rows, cols, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(k, rows, cols, generator=g)


def _matmul_flops(fn):
    # plain matmuls, so the count can be checked against the cost model's formula
    with kernels.force_matmul(), FlopCounterMode(display=False) as counter:
        out = fn()
    return out, counter.get_total_flops()


def _sharded_modes(group, mesh):
    """Every mode on plain shards and on DTensors, against the full matrix's Newton-Schulz."""
    from torch.distributed.tensor import Shard, distribute_tensor

    rank, world_size = dist.get_rank(group), dist.get_world_size(group)
    results = {}
    for si, (k, rows, cols) in enumerate(SHAPES):
        G = _full(k, rows, cols, seed=si)
        ref = newton_schulz(G, steps=STEPS)
        for shard_dim in (0, 1):
            local = G.chunk(world_size, dim=1 + shard_dim)[rank].contiguous()
            ref_local = ref.chunk(world_size, dim=1 + shard_dim)[rank]
            for mode, form in VARIANTS:
                stats = CommStats()
                orth = TensorParallelOrthogonalizer(
                    group,
                    mode=mode,
                    shard_dim=shard_dim,
                    steps=STEPS,
                    form=form,
                    cost_model=PACKED,
                    stats=stats,
                )
                out, flops = _matmul_flops(lambda o=orth, x=local: o(x))
                expected = newton_schulz(local, steps=STEPS) if mode == "blockwise" else ref_local
                results[(si, shard_dim, mode, form)] = {
                    "err": (out - expected).abs().max().item(),
                    "shape_ok": out.shape == local.shape and out.dtype == local.dtype,
                    "flops": flops,
                    "model": tp_cost(mode, k, rows, cols, shard_dim, world_size, STEPS, 4, form),
                    # the mode's own collectives, which tp_cost prices; plain shards' shape
                    # check (one all-gather, not in blockwise) apart
                    "stats": stats.without(SHAPES_KIND).as_dict(),
                    "shape_checks": stats.calls.get(SHAPES_KIND, 0),
                }

    # bf16 as the Newton-Schulz dtype: the shards and Grams travel in it (half the bytes),
    # the result comes back in the input's dtype.
    k, rows, cols = SHAPES[0]
    local = _full(k, rows, cols, seed=0).chunk(world_size, dim=2)[rank].contiguous()
    for mode in ("duplicated", "distributed"):
        stats = CommStats()
        orth = TensorParallelOrthogonalizer(
            group,
            mode=mode,
            shard_dim=1,
            steps=STEPS,
            form="apply",
            ns_dtype=torch.bfloat16,
            cost_model=PACKED,
            stats=stats,
        )
        out = orth(local)
        ref_local = newton_schulz(_full(k, rows, cols, seed=0), steps=STEPS).chunk(
            world_size, dim=2
        )[rank]
        results[("bf16", mode)] = {
            "err": (out - ref_local).abs().max().item(),
            "dtype": out.dtype,
            "stats": stats.as_dict(),
        }

    # The packed Gram all-reduce on its own: the full symmetric sum, m(m+1)/2 elements.
    m = 9
    X = _full(1, m, 5, seed=100 + rank)[0]
    stats = CommStats()
    summed = all_reduce_symmetric(X @ X.T, group=group, stats=stats, kind=GRAM_KIND)
    all_reduce((X @ X.T).contiguous(), group=group, stats=stats)
    results["packed"] = {"summed": summed, "stats": stats.as_dict()}

    # DTensor inputs (as Muon hands them over): group and shard dim come from the placement,
    # and uneven shards (rows 10 and cols 13 do not divide by 4) work.
    G = _full(2, 10, 13, seed=7)
    ref = newton_schulz(G, steps=STEPS)
    for dim in (1, 2):
        D = distribute_tensor(G, mesh, [Shard(dim)])
        for mode in ("duplicated", "distributed", "auto"):
            orth = TensorParallelOrthogonalizer(mode=mode, steps=STEPS)
            out = orth(D)
            results[("dtensor", dim, mode)] = {
                "err": (out.full_tensor() - ref).abs().max().item(),
                "placements": out.placements == D.placements,
                "modes": orth.last_modes,
            }
    return results


def _all_checks(rank, world_size, ckpt_dir):
    """Everything multi-rank in one spawn (starting ranks is the slow part): the modes at
    TP = 4 (all ranks) and TP = 2 (two subgroups), then the GPT on a (dp=2)×(tp=2) mesh
    (the distributed run saves a DCP checkpoint under `ckpt_dir`)."""
    from torch.distributed.device_mesh import init_device_mesh

    out = {4: _sharded_modes(None, init_device_mesh("cpu", (4,)))}
    mesh2d = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    out[2] = _sharded_modes(mesh2d["tp"].get_group(), mesh2d["tp"])
    out["gpt"] = {
        mode: _gpt_2d(mesh2d, mode, ckpt_dir if mode == "distributed" else None)
        for mode in ("duplicated", "distributed")
    }
    out["gpt_bad_group"] = _gpt_2d_whole_world_as_dp(mesh2d)
    out["variants"] = {name: _gpt_2d(mesh2d, "distributed", optimizer=name) for name in TP_VARIANTS}
    return out


@pytest.fixture(scope="module")
def ckpt_dir(tmp_path_factory):
    return str(tmp_path_factory.mktemp("tp_ckpt") / "dp2_tp2")


@pytest.fixture(scope="module")
def four_ranks(ckpt_dir):
    return run_ranks(_all_checks, 4, args=(ckpt_dir,))


@pytest.mark.parametrize("world_size", [2, 4])
def test_modes_match_full_newton_schulz(four_ranks, world_size):
    T = world_size
    res = [r[T] for r in four_ranks]
    # with TP = 2 the tp groups are {0, 1} and {2, 3}; each rank compared its own slice
    for r in res:
        for si, (k, rows, cols) in enumerate(SHAPES):
            for shard_dim in (0, 1):
                p = (cols, rows)[shard_dim]
                for mode, form in VARIANTS:
                    key = (si, shard_dim, mode, form)
                    got = r[key]
                    assert got["shape_ok"], key
                    tol = 0.0 if mode in ("duplicated", "blockwise") else FP32_TOL
                    assert got["err"] <= tol, (key, got["err"])
                    # counted flops and bytes are what the cost model says (flops: the
                    # busiest rank; split's shares of the triangle differ a little by rank)
                    assert got["flops"] <= got["model"].flops, (key, got)
                    assert max(q[key]["flops"] for q in res) == got["model"].flops, key
                    assert got["stats"]["total"]["sent"] == pytest.approx(
                        got["model"].bytes_sent
                    ), key
                    assert got["stats"]["total"]["calls"] == got["model"].rounds, key
                    assert got["shape_checks"] == (mode != "blockwise"), key
                # the packed Gram: p(p+1)/2 elements per step per matrix
                ring = 2 * (T - 1) / T
                for form in ("apply", "square", "split"):
                    stats = r[(si, shard_dim, "distributed", form)]["stats"]
                    assert stats[GRAM_KIND]["calls"] == STEPS
                    assert stats[GRAM_KIND]["sent"] == pytest.approx(
                        STEPS * ring * k * packed_triangle_size(p) * 4
                    )
                    assert stats[NORM_KIND]["sent"] == pytest.approx(ring * k * 4)
                assert r[(si, shard_dim, "distributed", "split")]["stats"][SPLIT_KIND]["calls"] == (
                    STEPS
                )
                # rows: the matrix and its small Gram's rows gathered each step, no Gram sum
                rows_stats = r[(si, shard_dim, "distributed", "rows")]["stats"]
                assert rows_stats[ROWS_KIND]["calls"] == 2 * STEPS
                assert GRAM_KIND not in rows_stats
                dup = r[(si, shard_dim, "duplicated", "apply")]["stats"]
                assert dup["total"]["calls"] == 1
                assert dup["all_gather"]["sent"] == pytest.approx((T - 1) * k * rows * cols / T * 4)
                assert r[(si, shard_dim, "blockwise", "apply")]["stats"]["total"]["calls"] == 0

        # bf16 halves the bytes of the gather and of every Gram all-reduce
        k, rows, cols = SHAPES[0]
        fp32_dup = r[(0, 1, "duplicated", "apply")]["stats"]
        fp32_dist = r[(0, 1, "distributed", "apply")]["stats"]
        bf16_dup, bf16_dist = r[("bf16", "duplicated")], r[("bf16", "distributed")]
        assert bf16_dup["stats"]["all_gather"]["sent"] == fp32_dup["all_gather"]["sent"] / 2
        assert bf16_dist["stats"][GRAM_KIND]["sent"] == fp32_dist[GRAM_KIND]["sent"] / 2
        for got in (bf16_dup, bf16_dist):
            assert got["dtype"] == torch.float32
            assert got["err"] <= BF16_TOL, got["err"]

        packed = r["packed"]
        total = sum((X @ X.T) for X in (_full(1, 9, 5, seed=100 + q)[0] for q in range(T)))
        torch.testing.assert_close(packed["summed"], total)
        torch.testing.assert_close(packed["summed"], packed["summed"].T, rtol=0, atol=0)
        s = packed["stats"]
        assert s[GRAM_KIND]["sent"] == pytest.approx(2 * (T - 1) / T * 9 * 10 / 2 * 4)
        assert s[GRAM_KIND]["sent"] / s["all_reduce"]["sent"] == pytest.approx(10 / 18)

        for dim in (1, 2):
            for mode in ("duplicated", "distributed", "auto"):
                got = r[("dtensor", dim, mode)]
                assert got["err"] <= FP32_TOL, (dim, mode, got)
                assert got["placements"]
                assert got["modes"] and got["modes"][0] in ("duplicated", "distributed")
    # auto decides on global shapes and a shared cost model: every rank picks the same mode.
    for d in (1, 2):
        assert len({tuple(r[("dtensor", d, "auto")]["modes"]) for r in res}) == 1


def test_blockwise_differs_from_full_newton_schulz():
    """Per-shard orthogonalization is not the full polar factor (why it is opt-in)."""
    G = _full(1, 16, 32, seed=3)
    full = newton_schulz(G, steps=STEPS)
    blocks = torch.cat([newton_schulz(b, steps=STEPS) for b in G.chunk(2, dim=1)], dim=1)
    assert (blocks - full).norm() / full.norm() > 0.1


def test_cost_model_and_forms():
    assert shard_sizes(10, 4) == [3, 3, 3, 1]
    assert shard_sizes(8, 4) == [2, 2, 2, 2]
    for p, T in ((24, 2), (40, 4), (1024, 4), (3, 4)):
        plan = split_plan(p, T)
        rows = sorted(r for blks in plan for a, b in blks for r in range(a, b))
        assert rows == list(range(p))  # every row of the triangle once
        load = [sum((b - a) * (p - a) for a, b in blks) for blks in plan]
        if p >= 4 * T:
            assert max(load) <= 1.35 * sum(load) / T, (p, T, load)
    # split halves the replicated p³ product, at the price of one more all-gather
    sq = tp_cost("distributed", 1, 256, 1024, 1, 4, 5, 4, "square")
    sp = tp_cost("distributed", 1, 256, 1024, 1, 4, 5, 4, "split")
    assert sp.flops < sq.flops and sp.bytes_sent > sq.bytes_sent
    plain = 5 * (4 * 256**2 * 1024 + 2 * 256**3)
    assert sp.flops <= plain / 4
    # Sharded along the short side (256 of 1024 × 256 split), the Gram over the sharded
    # dimension is the large 1024² one: every Gram form misses 1/T of the plain iteration,
    # rows (the small Gram, the matrix gathered each step) meets it exactly.
    short = {f: tp_cost("distributed", 1, 1024, 256, 1, 4, 5, 4, f) for f in FORMS[1:]}
    assert all(short[f].flops > plain / 4 for f in ("apply", "square", "split"))
    assert short["rows"].flops == plain / 4
    layout = _Layout(None, 4, 0, -1, (256,) * 4)
    # Slow links and fast matmuls favour one gather of a square matrix (of a wide one, the
    # two packed 256² Grams of gram mode are fewer bytes than the gathered matrix); fast
    # links and slow matmuls the distributed iteration; blockwise is never chosen by auto.
    slow_link = TensorParallelOrthogonalizer(
        cost_model=CostModel(bandwidth=1e6, latency=1e-3, throughput=1e15),
        ns_dtype=torch.float32,
    )
    assert slow_link.choose_mode(4, 256, 256, _Layout(None, 4, 0, -1, (64,) * 4)) == "duplicated"
    assert slow_link.choose_mode(4, 256, 1024, layout) == "gram"
    # in bf16 (the GPU default) auto leaves gram out: one gather of the wide matrix
    slow_link.ns_dtype = "auto"
    assert slow_link.choose_mode(4, 256, 1024, layout) == "duplicated"
    slow_math = TensorParallelOrthogonalizer(
        cost_model=CostModel(bandwidth=1e12, latency=0.0, throughput=1e6)
    )
    assert slow_math.choose_mode(4, 256, 1024, layout) == "distributed"
    assert tp_cost("blockwise", 1, 256, 1024, 1, 4, 5, 4).bytes_sent == 0


def test_auto_prices_the_wire_in_the_dtype_of_the_device():
    """ns_dtype "auto" (the default) resolves from the device of the shards: the cost model
    prices bf16 bytes (2 per element) on CUDA, float32 (4) on CPU; an explicit dtype wins."""
    layout = _Layout(None, 4, 0, -1, (256,) * 4)
    priced = []

    def spy(orth):
        real = orth.mode_cost

        def mode_cost(mode, k, rows, cols, shard_dim, world_size, element_size, device=None):
            if mode == "distributed":  # one of auto's candidates, priced once per choice
                priced.append(element_size)
            return real(mode, k, rows, cols, shard_dim, world_size, element_size, device)

        orth.mode_cost = mode_cost
        return orth

    auto = spy(TensorParallelOrthogonalizer())
    assert auto.ns_dtype == "auto"
    for device in ("cuda", torch.device("cpu"), None):  # None: the GPU the cost model describes
        auto.choose_mode(4, 256, 1024, layout, device)
    spy(TensorParallelOrthogonalizer(ns_dtype=torch.float32)).choose_mode(
        4, 256, 1024, layout, "cuda"
    )
    spy(TensorParallelOrthogonalizer(ns_dtype=None)).choose_mode(4, 256, 1024, layout, "cuda")
    assert priced == [2, 4, 2, 4, 4]


def test_bad_arguments_are_named():
    with pytest.raises(ValueError, match="mode"):
        TensorParallelOrthogonalizer(mode="fast")
    with pytest.raises(ValueError, match="shard_dim"):
        TensorParallelOrthogonalizer(shard_dim=2)
    with pytest.raises(ValueError, match="form"):
        TensorParallelOrthogonalizer(form="x")
    with pytest.raises(ValueError, match="shard_dim"):
        TensorParallelOrthogonalizer(mode="duplicated")(torch.randn(1, 4, 4))
    with pytest.raises(ValueError, match="bandwidth"):
        CostModel(bandwidth=0.0)


# -- end to end: a small GPT, (dp = 2) × (tp = 2) ----------------------------------------------

VOCAB, WIDTH, HEADS, LAYERS, SEQ, BATCH, TRAIN_STEPS = 32, 16, 4, 2, 8, 4, 10


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(WIDTH), nn.LayerNorm(WIDTH)
        self.q, self.k, self.v, self.o = (nn.Linear(WIDTH, WIDTH, bias=False) for _ in range(4))
        self.fc = nn.Linear(WIDTH, 4 * WIDTH, bias=False)
        self.proj = nn.Linear(4 * WIDTH, WIDTH, bias=False)

    def forward(self, x):
        B, S, _ = x.shape
        h = self.ln1(x)
        # -1 heads: under tensor parallelism each rank holds HEADS / tp of them.
        q, k, v = (
            f(h).view(B, S, -1, WIDTH // HEADS).transpose(1, 2) for f in (self.q, self.k, self.v)
        )
        att = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.o(att.transpose(1, 2).reshape(B, S, -1))
        return x + self.proj(nn.functional.gelu(self.fc(self.ln2(x))))


class TinyGPT(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, WIDTH)
        self.blocks = nn.ModuleList(Block() for _ in range(LAYERS))
        self.lm_head = nn.Linear(WIDTH, VOCAB, bias=False)

    def forward(self, idx):
        x = self.embed(idx)
        for b in self.blocks:
            x = b(x)
        return self.lm_head(x)


def _batches():
    """Counting sequences (random start and stride, mod VOCAB): learnable in a few steps."""
    g = torch.Generator().manual_seed(11)
    batches = []
    for _ in range(TRAIN_STEPS):
        start = torch.randint(0, VOCAB, (BATCH, 1), generator=g)
        stride = torch.randint(1, 3, (BATCH, 1), generator=g)
        batches.append((start + stride * torch.arange(SEQ + 1)) % VOCAB)
    return batches


def _loss(model, tokens):
    logits = model(tokens[:, :-1])
    return nn.functional.cross_entropy(logits.reshape(-1, VOCAB), tokens[:, 1:].reshape(-1))


def _train(model, opt, batches):
    losses = []
    for tokens in batches:
        loss = _loss(model, tokens)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.detach())
    return losses


def _build(orthogonalizer=None, optimizer="muon"):
    from orthoptim import build_optimizer

    torch.manual_seed(0)
    model = TinyGPT()
    return model, lambda: build_optimizer(
        model, optimizer=optimizer, lr=0.02, adamw_lr=3e-3, orthogonalizer=orthogonalizer
    )


# The layer-wise optimizer's bucket size per orthogonalizer mode: one bucket of several
# owners (reduce-scatter / all-gather), and ~1 KB buckets (most matrices alone in theirs:
# reduce to the owner / broadcast from it).
GPT_BUCKET_MB = {"duplicated": 25.0, "distributed": 2**-10}


def _parallel_gpt(mesh):
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    torch.manual_seed(0)
    model = TinyGPT()
    plan = {}
    for i in range(LAYERS):
        plan.update({f"blocks.{i}.{n}": ColwiseParallel() for n in ("q", "k", "v", "fc")})
        plan.update({f"blocks.{i}.{n}": RowwiseParallel() for n in ("o", "proj")})
    return parallelize_module(model, mesh["tp"], plan)


def _gpt_2d_whole_world_as_dp(mesh):
    """The whole world as the data-parallel group would split tp ranks' ownership: refused."""
    from orthoptim import LayerwiseDistributedOptimizer

    try:
        LayerwiseDistributedOptimizer(_parallel_gpt(mesh), optimizer="muon")
    except ValueError as e:
        return str(e)
    return None


def _layerwise(model, mesh, orth, optimizer="muon", **kw):
    """Layer-wise Muon (or a variant) over mesh['dp'] with the reference's hyper-parameters."""
    from orthoptim import LayerwiseDistributedOptimizer

    return LayerwiseDistributedOptimizer(
        model,
        optimizer=optimizer,
        lr=0.02,
        adamw_lr=3e-3,
        orthogonalizer=orth,
        process_group=mesh["dp"].get_group(),
        **kw,
    )


def _gpt_2d(mesh, mode, ckpt_dir=None, optimizer="muon"):
    """The GPT tensor-parallel over mesh['tp'], data-parallel over mesh['dp'] through the
    layer-wise optimizer (each matrix owned by one dp rank, whose tp ranks orthogonalize it
    together with the TP orthogonalizer)."""
    dp_rank = mesh["dp"].get_local_rank()
    orth = TensorParallelOrthogonalizer(mode=mode, steps=STEPS)
    model = _parallel_gpt(mesh)
    opt = _layerwise(model, mesh, orth, optimizer, bucket_mb=GPT_BUCKET_MB[mode])
    halves = [t.chunk(2)[dp_rank] for t in _batches()]
    losses = _train(model, opt, halves)
    opt.wait_for_params()
    if ckpt_dir is not None:
        from orthoptim import checkpoint

        checkpoint.save_sharded(ckpt_dir, opt, model)
    full = {
        n: (p.full_tensor() if hasattr(p, "full_tensor") else p.detach())
        for n, p in model.named_parameters()
    }
    return {
        "losses": torch.stack(losses),
        "params": full,
        "modes": set(orth.last_modes),
        "owners": opt.assignment.owners,
        "units": [(u.name, u.shape, u.nbytes) for u in opt.units],
        "buckets": [len(b.owners) == 1 for b in opt.grad_sync.buckets],
        "comm": opt.comm_stats(),
        "expected_comm": opt.expected_comm_bytes(),
    }


@pytest.fixture(scope="module")
def reference():
    """Single-process Muon on the full batches: (model, optimizer, losses)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny matrices: one thread is many times faster on a busy host
    try:
        model, make_opt = _build()
        opt = make_opt()
        losses = torch.stack(_train(model, opt, _batches()))
    finally:
        torch.set_num_threads(threads)
    return model, opt, losses


@pytest.mark.parametrize("mode", ["duplicated", "distributed"])
def test_gpt_dp2_tp2_follows_single_process(four_ranks, reference, mode):
    model, _, ref_losses = reference
    ref = dict(model.named_parameters())
    assert ref_losses[-1] < ref_losses[0] - 0.1  # it trains
    res = [r["gpt"][mode] for r in four_ranks]
    # every rank (both tp ranks of each dp rank) computed the same ownership, from global
    # shapes: a column-parallel fc is costed as the full 64×16 matrix, its bytes are a shard's
    for r in res:
        assert r["owners"] == res[0]["owners"]
        assert r["modes"] == {mode}
        units = {name: (shape, nbytes) for name, shape, nbytes in r["units"]}
        assert units["blocks.0.fc.weight"] == ((4 * WIDTH, WIDTH), 4 * WIDTH * WIDTH * 4 // 2)
        assert units["blocks.0.ln1.weight"] == ((WIDTH,), WIDTH * 4)
        assert set(r["owners"]) == {0, 1}
        for kind, want in r["expected_comm"].items():
            assert r["comm"][kind]["sent"] == pytest.approx(want["sent"]), kind
    singles = set(res[0]["buckets"])
    assert singles == ({False} if mode == "duplicated" else {True, False}), singles
    # each dp rank's loss is over its half of the batch; their mean is the full batch's
    mean_losses = (res[0]["losses"] + res[2]["losses"]) / 2
    # fp32; the only differences are summation orders (gradient halves, sharded matmuls,
    # the sharded Gram). Measured: losses and parameters within 5e-7 after 10 steps.
    torch.testing.assert_close(mean_losses, ref_losses, rtol=1e-5, atol=1e-5)
    for r in res:
        for n, p in r["params"].items():
            torch.testing.assert_close(p, ref[n].detach(), rtol=1e-5, atol=1e-5, msg=n)


@pytest.mark.parametrize("name", TP_VARIANTS)
def test_variants_dp2_tp2_follow_single_process(four_ranks, name):
    """Each variant's own step on the orthogonalized matrix (NorMuon's row moments, AdaMuon's
    second moment, Scion's norms) sees the tensor-parallel matrices as DTensors: the result
    must still be the single-process one, to the same summation-order tolerance as Muon's."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        model, make_opt = _build(optimizer=name)
        ref_losses = torch.stack(_train(model, make_opt(), _batches()))
    finally:
        torch.set_num_threads(threads)
    assert ref_losses[-1] < ref_losses[0] - 0.1  # it trains
    res = [r["variants"][name] for r in four_ranks]
    torch.testing.assert_close(
        (res[0]["losses"] + res[2]["losses"]) / 2, ref_losses, rtol=1e-5, atol=1e-5
    )
    for r in res:
        for n, p in model.named_parameters():
            torch.testing.assert_close(r["params"][n], p.detach(), rtol=1e-5, atol=1e-5, msg=n)


def test_tp_parameters_need_the_data_parallel_group(four_ranks):
    for r in four_ranks:
        msg = r["gpt_bad_group"]
        assert msg is not None and "mesh['dp'].get_group()" in msg, msg


def test_sharded_checkpoint_of_dp2_tp2_loads_in_one_process(four_ranks, reference, ckpt_dir):
    """DCP checkpoint written by the (dp 2) × (tp 2) layer-wise run (momentum buffers as
    DTensors, each tp rank its shards, only the owner dp rank's) loads into a single-process
    optimizer: parameters and every momentum buffer match single-process Muon's."""
    from orthoptim import checkpoint

    ref_model, ref_opt, _ = reference
    model, make_opt = _build()
    opt = make_opt()
    checkpoint.load_sharded(ckpt_dir, opt, model)
    ref_params = dict(ref_model.named_parameters())
    ref_state = {n: ref_opt.state[p] for n, p in ref_params.items()}
    for n, p in model.named_parameters():
        torch.testing.assert_close(p, ref_params[n], rtol=1e-5, atol=1e-5, msg=n)
        for k, v in ref_state[n].items():
            torch.testing.assert_close(opt.state[p][k], v, rtol=1e-5, atol=1e-5, msg=(n, k))
    assert len(opt.state) == len(ref_opt.state) > 0


def _resume_dp1_tp2(rank, world_size, ckpt_dir):
    """Load the (dp 2) × (tp 2) checkpoint at (dp 1) × (tp 2) and train one more step."""
    from torch.distributed.device_mesh import init_device_mesh

    from orthoptim import checkpoint

    mesh = init_device_mesh("cpu", (1, 2), mesh_dim_names=("dp", "tp"))
    model = _parallel_gpt(mesh)
    opt = _layerwise(model, mesh, TensorParallelOrthogonalizer(mode="auto", steps=STEPS))
    checkpoint.load_sharded(ckpt_dir, opt, model)

    def full(t):
        return t.full_tensor() if hasattr(t, "full_tensor") else t.detach().clone()

    named = dict(model.named_parameters())
    out = {
        "params": {n: full(p) for n, p in named.items()},
        "momentum": {n: full(opt.state[p]["momentum_buffer"]) for n, p in named.items()
                     if "momentum_buffer" in opt.state.get(p, {})},
    }  # fmt: skip
    _train(model, opt, [_extra_batch()])
    opt.wait_for_params()
    out["after"] = {n: full(p) for n, p in named.items()}
    return out


def _extra_batch():
    g = torch.Generator().manual_seed(12)
    start = torch.randint(0, VOCAB, (BATCH, 1), generator=g)
    return (start + torch.arange(SEQ + 1)) % VOCAB


def test_sharded_checkpoint_of_dp2_tp2_resumes_at_dp1_tp2(four_ranks, reference, ckpt_dir):
    ref_model, ref_opt, _ = reference
    res = run_ranks(_resume_dp1_tp2, 2, args=(ckpt_dir,))
    ref_params = dict(ref_model.named_parameters())
    matrices = sum(1 for st in ref_opt.state.values() if "momentum_buffer" in st)
    for r in res:
        assert len(r["momentum"]) == matrices > 0
        for n, p in r["params"].items():
            torch.testing.assert_close(p, ref_params[n].detach(), rtol=1e-5, atol=1e-5, msg=n)
        for n, m in r["momentum"].items():
            want = ref_opt.state[ref_params[n]]["momentum_buffer"]
            torch.testing.assert_close(m, want, rtol=1e-5, atol=1e-5, msg=n)
    # one more step from the loaded state follows the single process's next step
    model, make_opt = _build()
    model.load_state_dict(ref_model.state_dict())
    opt = make_opt()
    opt.load_state_dict(ref_opt.state_dict())
    _train(model, opt, [_extra_batch()])
    for r in res:
        for n, p in model.named_parameters():
            torch.testing.assert_close(r["after"][n], p.detach(), rtol=1e-5, atol=1e-5, msg=n)
