"""AdamW sharded element-wise inside the layer-wise optimizer (ZeRO-1 for embeddings, head and
vectors; matrices owned whole), against the single-process `build_optimizer`.

Oracle: the single-process optimizer stepping on the mean of every rank's loss. The models are
float64 and the only difference is the order the gradients are summed in (a reduce-scatter of
per-rank gradients vs one backward over all ranks' losses): ~1e-16 relative per element,
carried through 6 steps of Muon and AdamW (measured: ~1e-15), so EXACT_TOL = 1e-12 leaves
room for other summation orders while a wrong step count, bias correction, weight decay or
misplaced element moves a parameter by orders of magnitude more (one AdamW step is ~3e-3).
"""

import copy
import itertools
import math
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from orthoptim import build_optimizer
from orthoptim import checkpoint as ckpt
from orthoptim.optim.base import NonFiniteGradientError
from orthoptim.parallel import LayerwiseDistributedOptimizer
from orthoptim.parallel.assignment import Unit, assign, deal_adamw, water_fill

from distributed import run_ranks

VOCAB, SEQ, WIDTH, PER_RANK = 13, 5, 6, 2  # 78-element tied embedding: uneven at 4 ranks
STEPS, BEFORE, AFTER = 6, 3, 4
EXACT_TOL = 1e-12
KW = dict(optimizer="muon", lr=0.02, adamw_lr=3e-3, weight_decay=0.01, adamw_weight_decay=0.1)
BUCKET_MB = 0.0004  # ~420 bytes: several buckets, some mixed, some single-owner


class Net(nn.Module):
    """Tied embedding / head (AdamW), a norm and odd-sized biases (AdamW), hidden matrices
    (Muon), a frozen matrix, and a branch only rank 0 runs (no gradient on the others)."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(VOCAB, WIDTH)
        self.ln = nn.LayerNorm(WIDTH)
        self.fc1 = nn.Linear(WIDTH, 11)
        self.fc2 = nn.Linear(11, WIDTH)
        self.frozen = nn.Linear(WIDTH, WIDTH, bias=False)
        self.frozen.weight.requires_grad_(False)
        self.side = nn.Linear(WIDTH, WIDTH)  # used by rank 0's batches only
        self.head = nn.Linear(WIDTH, VOCAB, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, idx, side=False):
        x = self.emb(idx)
        x = x + self.fc2(F.gelu(self.fc1(self.ln(x)))) + 0.1 * self.frozen(x)
        if side:
            x = x + self.side(x)
        return self.head(x)


def make_model(seed=0):
    torch.manual_seed(seed)
    return Net().double()


def batch(step, rank):
    g = torch.Generator().manual_seed(1000 * step + rank)
    idx = torch.randint(0, VOCAB, (PER_RANK, SEQ + 1), generator=g)
    return idx[:, :-1], idx[:, 1:]


def loss_on(model, step, rank):
    x, y = batch(step, rank)
    return F.cross_entropy(model(x, side=rank == 0).flatten(0, 1), y.flatten())


def params(model):
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def rel_err(got, want):
    return max(((got[n] - w).norm() / w.norm()).item() for n, w in want.items())


def reference(world_size, steps, kw=KW, model=None, opt=None, start=0):
    """Single process: each step on the mean of the `world_size` ranks' losses."""
    model = model if model is not None else make_model()
    opt = opt if opt is not None else build_optimizer(model, **kw)
    for step in range(start, start + steps):
        (sum(loss_on(model, step, r) for r in range(world_size)) / world_size).backward()
        opt.step()
        opt.zero_grad()
    return model, opt


def train(model, opt, rank, steps, start=0, micro=False):
    for step in range(start, start + steps):
        if micro:  # the same batch in two halves, accumulated without communication
            x, y = batch(step, rank)
            for half, last in ((slice(0, 1), False), (slice(1, 2), True)):
                logits = model(x[half], side=rank == 0).flatten(0, 1)
                loss = F.cross_entropy(logits, y[half].flatten()) / 2
                if last:
                    loss.backward()
                else:
                    with opt.no_sync():
                        loss.backward()
        else:
            loss_on(model, step, rank).backward()
        opt.step()
        opt.zero_grad()
    opt.wait_for_params()
    return params(model)


def _runs(opt):
    """{parameter: [(lo, hi)]} of the sharded AdamW runs this rank steps, and whether every
    owned AdamW state tensor is shaped like its run."""
    runs, shaped = {}, True
    for g in opt.param_groups:
        for name, p in zip(g["param_names"], g["params"]):
            base, run = ckpt._flat_range(name)
            if run is not None:
                runs.setdefault(base, []).append(run)
                st = opt.state.get(p, {})
                shaped &= all(v.shape == (run[1] - run[0],) for k, v in st.items() if k != "step")
    return runs, shaped


def _ranks(rank, world_size, path, load_from):
    out = {}
    # 1. hybrid, fp64: parameters, full state dict and runs
    model = make_model()
    opt = LayerwiseDistributedOptimizer(model, bucket_mb=BUCKET_MB, **KW)
    out["params"] = train(model, opt, rank, STEPS)
    out["runs"], out["run_state_shaped"] = _runs(opt)
    out["owner_of"] = dict(opt.owner_of)
    out["full"] = opt.state_dict()
    out["stats"] = {k: v for k, v in opt.comm_stats().items() if k != "total"}
    out["expected"] = opt.expected_comm_bytes()
    out["assignment"] = opt.assignment
    # 2. no_sync accumulation, overlap off, one big bucket
    model = make_model()
    opt = LayerwiseDistributedOptimizer(
        model, overlap_grad_reduce=False, overlap_param_gather=False, **KW
    )
    out["no_sync"] = train(model, opt, rank, 3, micro=True)
    # 3. plain AdamW everywhere: ZeRO-1 (every parameter sharded, no owner at all)
    model = make_model()
    opt = LayerwiseDistributedOptimizer(model, optimizer="adamw", lr=3e-3, bucket_mb=BUCKET_MB)
    out["adamw"] = train(model, opt, rank, STEPS)
    out["adamw_owners"] = set(opt.owner_of.values())
    # 4. bf16 gathers: masters of the runs, replicas hold the rounded values
    model = make_model()
    opt = LayerwiseDistributedOptimizer(
        model, bucket_mb=BUCKET_MB, gather_dtype=torch.bfloat16, **KW
    )
    out["bf16"] = train(model, opt, rank, 3)
    out["bf16_full"] = opt.state_dict()
    # 5. non-finite gradient in an AdamW run owned by another rank: everyone agrees
    for policy in ("raise", "skip"):
        model = make_model()
        opt = LayerwiseDistributedOptimizer(model, bucket_mb=BUCKET_MB, nonfinite=policy, **KW)
        if rank == world_size - 1:
            model.emb.weight.register_hook(lambda g: g.index_fill(0, torch.tensor([0]), math.nan))
        loss_on(model, 0, rank).backward()
        before = params(model)
        raised = None
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)
            try:
                opt.step()
            except NonFiniteGradientError as e:
                raised = str(e)
        opt.wait_for_params()
        same = all(torch.equal(p, before[n]) for n, p in model.named_parameters())
        out[policy] = (raised, same, len(opt.state))
    # 6. checkpoints: save here (DCP), or resume from one saved at another world size
    model = make_model()
    opt = LayerwiseDistributedOptimizer(model, bucket_mb=BUCKET_MB, **KW)
    if load_from is None:
        train(model, opt, rank, BEFORE)
        ckpt.save_sharded(path, opt, model, extra={"step": BEFORE})
        out["saved_full"] = opt.state_dict()
        out["saved_model"] = {k: v.clone() for k, v in model.state_dict().items()}
        out["sharded_keys"] = {
            k: [tuple(c.offsets) for c in v.__create_chunk_list__()]
            if isinstance(v, ckpt.FlatShard) else None
            for k, v in ckpt.sharded_state_dict(opt).items()
        }  # fmt: skip
    else:
        assert ckpt.load_sharded(path, opt, model) == {"step": BEFORE}
        out["resumed_dcp"] = train(model, opt, rank, AFTER, start=BEFORE)
        model = make_model(seed=1)
        model.load_state_dict(load_from[1])
        opt = LayerwiseDistributedOptimizer(model, bucket_mb=BUCKET_MB, **KW)
        opt.load_state_dict(load_from[0])
        out["resumed_full"] = train(model, opt, rank, AFTER, start=BEFORE)
    # with bf16 gathers: the runs' master copies are saved and resharded too
    model = make_model(seed=0 if load_from is None else 1)
    opt = LayerwiseDistributedOptimizer(
        model, bucket_mb=BUCKET_MB, gather_dtype=torch.bfloat16, **KW
    )
    if load_from is None:
        train(model, opt, rank, BEFORE)
        ckpt.save_sharded(path + "_bf16", opt, model)
    else:
        ckpt.load_sharded(path + "_bf16", opt, model)
    out["bf16_ckpt"] = opt.state_dict()
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """3 ranks save a checkpoint; 2 and 4 ranks (and 1 process) resume from it."""
    path = str(tmp_path_factory.mktemp("zero") / "ckpt")
    saved = run_ranks(_ranks, 3, args=(path, None))
    load = (saved[0]["saved_full"], saved[0]["saved_model"])
    return path, {3: saved, 2: run_ranks(_ranks, 2, args=(path, load)),
                  4: run_ranks(_ranks, 4, args=(path, load))}  # fmt: skip


@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_sharded_adamw_equals_single_process(runs, world_size):
    results = runs[1][world_size]
    model, opt = reference(world_size, STEPS)
    want = params(model)
    adamw_names = {"emb.weight", "ln.weight", "ln.bias", "fc1.bias", "fc2.bias", "side.bias"}
    for rank, r in enumerate(results):
        assert rel_err(r["params"], want) <= EXACT_TOL, (rank, rel_err(r["params"], want))
        for n, p in r["params"].items():  # every replica the same
            assert torch.equal(p, results[0]["params"][n]), (rank, n)
        # AdamW parameters have no owner; their state lives in 1-D runs on several ranks
        assert {n for n, o in r["owner_of"].items() if o == -1} == adamw_names
        assert r["run_state_shaped"]
    runs_of = {}
    for r in results:
        for n, rs in r["runs"].items():
            runs_of.setdefault(n, []).extend(rs)
    numel = {n: p.numel() for n, p in model.named_parameters()}
    assert len(runs_of["emb.weight"]) >= 2  # the embedding really is split
    for n, rs in runs_of.items():  # the runs of one parameter tile it
        covered = sorted(rs)
        assert all(a[1] == b[0] for a, b in itertools.pairwise(covered)), (n, covered)
        assert covered[0][0] == 0 and covered[-1][1] == numel[n], (n, covered)

    # the full dict is the single-process optimizer's: full-size moments, same step counts
    full, ref = results[0]["full"], opt.state_dict()
    assert full["param_groups"][1]["param_names"] == ref["param_groups"][1]["param_names"]
    assert set(full["state"]) == set(ref["state"])
    for i, st in ref["state"].items():
        assert set(full["state"][i]) == set(st)
        for k, v in st.items():
            got = full["state"][i][k]
            assert got.shape == v.shape and got.dtype == v.dtype, (i, k)
            if k == "step":
                assert torch.equal(got, v), (i, got, v)
            else:
                assert ((got - v).norm() / v.norm()).item() <= 1e-10, (i, k)
    # comm_stats: what the layout says moves, through orthoptim.collectives
    for r in results:
        assert set(r["stats"]) == set(r["expected"])
        for kind, d in r["expected"].items():
            assert r["stats"][kind]["sent"] == pytest.approx(d["sent"]), kind
            assert r["stats"][kind]["received"] == pytest.approx(d["received"]), kind

    # no_sync accumulation of two half batches, and plain AdamW (ZeRO-1)
    half, _ = _reference_halves(world_size)
    adamw, _ = reference(world_size, STEPS, dict(optimizer="adamw", lr=3e-3))
    for r in results:
        assert rel_err(r["no_sync"], half) <= EXACT_TOL, rel_err(r["no_sync"], half)
        assert rel_err(r["adamw"], params(adamw)) <= EXACT_TOL
        assert r["adamw_owners"] == {-1}

    # bf16 gathers: replicas hold bf16 values; the masters follow the oracle that steps fp64
    # masters on gradients of the rounded model
    masters = _reference_bf16(world_size, 3)
    for r in results:
        for n, p in r["bf16"].items():
            assert n == "frozen.weight" or torch.equal(p, p.bfloat16().double()), n
            assert torch.equal(p, results[0]["bf16"][n]), n
        got = r["bf16_full"]["orthoptim"]["master"]
        assert set(got) == set(masters)
        assert rel_err(got, masters) <= 1e-10, rel_err(got, masters)

    # a NaN on the last rank in elements another rank steps: all raise / all skip, untouched
    for r in results:
        raised, same, nstate = r["raise"]
        assert raised is not None and "emb.weight" in raised and same and nstate == 0
        raised, same, nstate = r["skip"]
        assert raised is None and same and nstate == 0


def _reference_halves(world_size):
    model = make_model()
    opt = build_optimizer(model, **KW)
    for step in range(3):
        total = 0
        for rank in range(world_size):
            x, y = batch(step, rank)
            for half in (slice(0, 1), slice(1, 2)):
                logits = model(x[half], side=rank == 0).flatten(0, 1)
                total = total + F.cross_entropy(logits, y[half].flatten()) / 2
        (total / world_size).backward()
        opt.step()
        opt.zero_grad()
    return params(model), opt


def _reference_bf16(world_size, steps):
    master = make_model()
    opt = build_optimizer(master, **KW)
    view = make_model()  # what the replicas compute with: unrounded at first, then bf16
    for step in range(steps):
        (sum(loss_on(view, step, r) for r in range(world_size)) / world_size).backward()
        for p, q in zip(master.parameters(), view.parameters()):
            p.grad = None if q.grad is None else q.grad.clone()
        opt.step()
        opt.zero_grad()
        view.zero_grad()
        with torch.no_grad():
            for p, q in zip(master.parameters(), view.parameters()):
                if p.requires_grad:  # frozen parameters are not gathered
                    q.copy_(p.bfloat16().double())
    return {n: p.detach().clone() for n, p in master.named_parameters() if p.requires_grad}


def test_sharded_checkpoints_reshard_across_world_sizes(runs):
    path, results = runs
    saved = results[3][0]
    # every rank wrote its runs of the AdamW state under the parameter's key (no rank in it)
    keys = [r["sharded_keys"] for r in results[3]]
    key = "optim/state/emb.weight/exp_avg"
    emb = [set(k[key]) for k in keys if key in k]  # the chunks' offsets, per rank
    assert len(emb) >= 2 and not set.intersection(*emb)
    assert not any("rank" in k for ks in keys for k in ks)

    def uninterrupted(world_size):
        """3 ranks' batches up to the checkpoint, `world_size` ranks' after it."""
        model, opt = reference(3, BEFORE)
        return params(reference(world_size, AFTER, model=model, opt=opt, start=BEFORE)[0])

    # the 3-rank full dict loads into the single-process optimizer as is
    single = make_model(seed=1)
    single.load_state_dict(saved["saved_model"])
    sopt = build_optimizer(single, **KW)
    sopt.load_state_dict(copy.deepcopy(saved["saved_full"]))  # torch's loader shares tensors
    got, _ = reference(3, AFTER, model=single, opt=sopt, start=BEFORE)
    assert rel_err(params(got), uninterrupted(3)) <= EXACT_TOL
    # 2 and 4 ranks resume from the 3-rank DCP checkpoint and full dict; 1 process from DCP
    for world_size in (2, 4):
        want = uninterrupted(world_size)
        for r in results[world_size]:
            for key in ("resumed_dcp", "resumed_full"):
                assert rel_err(r[key], want) <= EXACT_TOL, (world_size, key)
            for n, p in r["resumed_full"].items():
                assert torch.equal(p, r["resumed_dcp"][n]), n
    # the bf16-gather checkpoint (masters of runs and whole units) loads the same everywhere
    bf16 = saved["bf16_ckpt"]
    trainable = {n for n, p in make_model().named_parameters() if p.requires_grad}
    assert set(bf16["orthoptim"]["master"]) == trainable
    for world_size in (2, 4):
        for r in results[world_size]:
            assert _same(r["bf16_ckpt"]["state"], bf16["state"]), world_size
            assert _same(r["bf16_ckpt"]["orthoptim"]["master"], bf16["orthoptim"]["master"])
    one = make_model(seed=1)
    lw = LayerwiseDistributedOptimizer(one, bucket_mb=BUCKET_MB, **KW)
    assert ckpt.load_sharded(path, lw, one) == {"step": BEFORE}
    got = train(one, lw, 0, 0)
    for n, p in got.items():
        assert torch.equal(p, saved["saved_model"][n]), n
    # (the world-size-1 continuation sees 1 rank's batches: compare states instead)
    full1 = lw.state_dict()["state"]
    full3 = saved["saved_full"]["state"]
    assert set(full1) == set(full3)
    for i in full3:
        for k in full3[i]:
            assert torch.equal(full1[i][k], full3[i][k]), (i, k)


def _same(a, b):
    if isinstance(a, torch.Tensor):
        return torch.equal(a, b)
    return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)


# ---- the deal, without processes ---------------------------------------------------------------


def test_water_fill_levels_within_caps():
    assert water_fill([0, 0, 0, 0], [9, 9, 9, 9], 10) == [3, 3, 2, 2]
    assert water_fill([5, 0, 3], [10, 10, 10], 4) == [0, 4, 0]  # ties: the lower rank
    assert water_fill([0, 0, 0], [1, 10, 10], 9) == [1, 4, 4]
    assert sum(water_fill([7, 1, 4, 0], [3, 2, 8, 1], 11)) == 11
    with pytest.raises(ValueError):
        water_fill([0, 0], [1, 1], 3)


def test_deal_levels_state_and_tiles_every_bucket():
    """Muon matrices owned whole, AdamW dealt: every bucket's AdamW elements are split
    exactly, the state per rank is level, and `bucket_shard_bytes` / `rank_bytes` count it."""
    units = [Unit(f"m{i}", (64, 48 + 16 * (i % 3)), "muon", 4 * 64 * (48 + 16 * (i % 3)))
             for i in range(7)]  # fmt: skip
    units += [Unit("emb", (500, 64), "adamw", 4 * 500 * 64), Unit("v", (7,), "adamw", 28)]
    for n in (2, 3, 4, 5):
        a = assign(units, n, bucket_bytes=20_000, shard_adamw=True)
        assert [a.owners[i] for i in (7, 8)] == [-1, -1]
        for b, bucket in enumerate(a.buckets):
            numel = sum(units[i].numel for i in bucket if units[i].kind == "adamw")
            assert sum(a.adamw_split[b] or [0]) == numel
        state = [
            sum(units[i].numel for i in a.units_of(r)) + 2 * sum(s[r] for s in a.adamw_split if s)
            for r in range(n)
        ]
        assert max(state) / (sum(state) / n) <= 1.0 + 0.011, (n, state)
        assert sum(a.rank_bytes) == sum(u.nbytes for u in units)
        # the same owners with master copies, another deal of the same elements
        m = deal_adamw(units, a, masters=True)
        assert m.owners == a.owners and sum(m.rank_bytes) == sum(a.rank_bytes)


def test_plan_state_per_rank_is_level():
    """The issue's layouts: AdamW whole made kimi-k2 (dp 64, ep 64) 132 vs 120 GiB and put a
    llama3-8b embedding's state on one rank (6.6x the mean); dealt, both within 2 %."""
    from orthoptim.plan.hardware import load_hardware
    from orthoptim.plan.layouts import Layout
    from orthoptim.plan.model import load_model
    from orthoptim.plan.planner import make_plan

    for name, layout in (("kimi-k2", Layout(dp=64, ep=64)), ("llama3-8b", Layout(dp=64))):
        mem = make_plan(load_model(name), load_hardware("h200"), layout)["memory"]
        ratio = mem["layerwise_state_bytes_max"] / mem["layerwise_state_bytes_mean"]
        assert ratio <= 1.02, (name, ratio)
