"""FSDPOptimizer (Muon over FSDP2-sharded parameters) against the single-process optimizer.

One spawned gloo run per world size (spawning is the slow part): 2 ranks train 10 steps and
save a DCP checkpoint, 4 ranks train 10 steps on the same model (uneven and empty shards)
and, separately, resume the 2-rank checkpoint for 2 more steps. The reference runs here.
"""

import tempfile
import warnings

import pytest
import torch

from models.fsdp import (
    EXTRA,
    KW,
    STEPS,
    batch,
    loss_fn,
    make_model,
    sharded_model,
    train,
)
from orthoptim import build_optimizer
from orthoptim import checkpoint as ckpt_mod
from orthoptim.optim.base import NonFiniteGradientError
from orthoptim.parallel.fsdp import FSDPOptimizer

from distributed import run_ranks

# SOAP refreshing its eigenbases every other step.
SOAP_KW = dict(
    optimizer="soap", lr=3e-3, weight_decay=0.01, adamw_lr=3e-3, adamw_weight_decay=0.01,
    precondition_frequency=2,
)  # fmt: skip


def local_params(model):
    return {n: p.to_local().detach().clone() for n, p in model.named_parameters()}


def train_same_batch(model, opt, steps):
    """Every rank trains on the whole batch: the averaged gradient is then exactly the
    single-process one (SOAP turns 1e-7 reduction-order differences into visible ones)."""
    for step in steps:
        x, y = batch(step)
        loss_fn(model, x, y).backward()
        opt.step()
        opt.zero_grad()


def soap_checks(rank, world_size):
    """SOAP over FSDP2 shards against single-process SOAP run in this same (one-thread) process."""
    out = {}
    if rank == 0:
        model = make_model()
        ref = build_optimizer(model, **SOAP_KW)
        train_same_batch(model, ref, range(STEPS))
        out["soap_ref"] = {n: p.detach().clone() for n, p in model.named_parameters()}
        out["soap_ref_state"] = ref.state_dict()
    model = sharded_model(world_size)
    opt = FSDPOptimizer(model, bucket_mb=0.01, **SOAP_KW)
    train_same_batch(model, opt, range(STEPS))
    out["soap"] = local_params(model)
    out["soap_stats"], out["soap_expected"] = opt.comm_stats(), opt.expected_comm_bytes()
    # The full per-matrix state lives on the owner only; other ranks keep the step count.
    p = dict(model.named_parameters())["blocks.0.fc.weight"]
    out["soap_state_keys"] = sorted(opt.state[p])
    out["soap_owner"] = opt.owner_of["blocks.0.fc.weight"]
    # the full dict joins the owners' whole-matrix state with every rank's step count
    out["soap_full"] = opt.state_dict()
    return out


def worker(rank, world_size, ckpt, full_sd=None):
    import torch.distributed.checkpoint as dcp

    out = {}
    model = sharded_model(world_size)
    opt = FSDPOptimizer(model, bucket_mb=0.01, **KW)
    train(model, opt, rank, world_size, range(STEPS))
    out["params"] = local_params(model)
    if world_size == 2:
        out["full"] = opt.state_dict()  # unsharded, on every rank
        opt.state_dict_to = "rank0"
        out["full_rank0"] = opt.state_dict()
    out["stats"] = opt.comm_stats()
    out["expected"] = opt.expected_comm_bytes()
    out["owners"] = dict(opt.owner_of)
    out["buckets"] = len(opt.assignment.buckets)
    if world_size == 2:
        ckpt_mod.save_sharded(ckpt, opt, model)
        out.update(nonfinite_checks(model, opt, rank))
        out.update(soap_checks(rank, world_size))
        # float64 end to end: updates travel and are orthogonalized in float64.
        model = sharded_model(world_size, torch.float64)
        opt = FSDPOptimizer(model, bucket_mb=0.01, **KW)
        train(model, opt, rank, world_size, range(STEPS))
        out["f64"] = local_params(model)
        out["f64_stats"], out["f64_expected"] = opt.comm_stats(), opt.expected_comm_bytes()
        try:
            FSDPOptimizer(make_model())
        except ValueError as e:
            out["plain_error"] = str(e)
        return out
    # 4 ranks: resume the 2-rank checkpoint (resharded by DCP) and take EXTRA more steps.
    model = sharded_model(world_size)
    opt = FSDPOptimizer(model, bucket_mb=0.01, **KW)
    ckpt_mod.load_sharded(ckpt, opt, model)
    train(model, opt, rank, world_size, range(STEPS, STEPS + EXTRA))
    out["resumed"] = local_params(model)
    # the same from the 2-rank full dict: each rank keeps its shard of every state tensor
    model = sharded_model(world_size)
    opt = FSDPOptimizer(model, bucket_mb=0.01, **KW)
    sd = {f"model/{k}": v for k, v in model.state_dict().items()}
    dcp.load(sd, checkpoint_id=ckpt)
    opt.load_state_dict(full_sd)
    train(model, opt, rank, world_size, range(STEPS, STEPS + EXTRA))
    out["resumed_full"] = local_params(model)
    # HSDP: 2 replicas × 2 shards; the optimizer works inside each replica's shard group.
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    model = make_model()
    for b in model.blocks:
        fully_shard(b, mesh=mesh)
    fully_shard(model, mesh=mesh)
    assert next(model.parameters()).placements[1].is_shard(0)
    opt = FSDPOptimizer(model, bucket_mb=0.01, **KW)
    train(model, opt, rank, world_size, range(STEPS))
    out["hsdp"] = local_params(model)
    # bf16 on the wire: half the all-to-all bytes, close to the fp32 result.
    model = sharded_model(world_size)
    opt = FSDPOptimizer(model, bucket_mb=0.01, comm_dtype=torch.bfloat16, **KW)
    train(model, opt, rank, world_size, range(1))
    out["bf16_params"] = local_params(model)
    out["bf16_stats"] = opt.comm_stats()
    return out


def nonfinite_checks(model, opt, rank):
    """A NaN in one rank's gradient shard only: both ranks skip together, or both raise."""
    x, y = batch(0)
    loss_fn(model, x[:4], y[:4]).backward()
    if rank == 1:
        dict(model.named_parameters())["blocks.1.fc.weight"].grad.to_local()[0, 0] = float("nan")
    before = local_params(model)
    opt.nonfinite = "skip"
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        opt.step()
    after = local_params(model)
    out = {
        "skipped": all(torch.equal(before[n], after[n]) for n in before),
        "skip_warned": any("blocks.1.fc.weight" in str(w.message) for w in caught),
    }
    opt.nonfinite = "raise"
    try:
        opt.step()
    except NonFiniteGradientError as e:
        out["raised"] = str(e)
    opt.zero_grad()
    return out


def reference(steps, dtype=torch.float32):
    model = make_model(dtype)
    opt = build_optimizer(model, **KW)
    snaps = {}
    for step in range(steps):
        x, y = batch(step)
        loss_fn(model, x, y).backward()
        opt.step()
        opt.zero_grad()
        snaps[step + 1] = {n: p.detach().clone() for n, p in model.named_parameters()}
    return snaps


@pytest.fixture(scope="module")
def runs():
    with tempfile.TemporaryDirectory() as ckpt:
        two = run_ranks(worker, 2, (ckpt,))
        four = run_ranks(worker, 4, (ckpt, two[0]["full"]))
    return {
        2: two,
        4: four,
        "ref": reference(STEPS + EXTRA),
        "ref64": reference(STEPS, torch.float64),
    }


def full(results, key):
    """Concatenate every rank's dim-0 shard (rank order) into the full parameter."""
    names = results[0][key].keys()
    return {n: torch.cat([r[key][n] for r in results]) for n in names}


def chunk_rows(rows, world_size, rank):
    """Rows of dim 0 on `rank` under torch.chunk (DTensor's Shard(0) layout)."""
    chunks = torch.arange(rows).chunk(world_size)
    return len(chunks[rank]) if rank < len(chunks) else 0


def assert_close(got, ref, rtol):
    assert got.keys() == ref.keys()
    for n in ref:
        err = (got[n] - ref[n]).norm() / ref[n].norm()
        assert err <= rtol, f"{n}: relative error {err:.2e} > {rtol}"


@pytest.mark.parametrize("world_size", [2, 4])
def test_matches_single_process_muon(runs, world_size):
    ref = runs["ref"][STEPS]
    assert_close(full(runs[world_size], "params"), ref, 1e-5)
    # The run moved the parameters: the comparison is not trivially true.
    assert (
        full(runs[world_size], "params")["blocks.0.qkv.weight"] - make_model().blocks[0].qkv.weight
    ).norm() > 1e-3


def test_float64_matches_single_process_muon_to_float64_rounding(runs):
    """The summation order of the averaged gradient is the only difference: ~1e-16 relative,
    grown by 10 steps of Newton-Schulz and AdamW; a float32 hop anywhere shows as ~1e-8."""
    assert_close(full(runs[2], "f64"), runs["ref64"][STEPS], 1e-11)
    for r in runs[2]:
        assert r["f64_stats"]["all_to_all"] == r["f64_expected"]["all_to_all"]


def test_uneven_and_empty_shards_are_exercised(runs):
    shards = [r["params"]["blocks.0.gate.weight"].shape[0] for r in runs[4]]
    assert shards == [1, 1, 1, 0]
    assert [r["params"]["tok.weight"].shape[0] for r in runs[4]] == [13, 13, 13, 11]


@pytest.mark.parametrize("world_size", [2, 4])
def test_bytes_equal_the_formula(runs, world_size):
    ref = runs["ref"][STEPS]
    results = runs[world_size]
    owners = results[0]["owners"]
    total_sent, matrix_bytes = 0.0, 0
    for rank, r in enumerate(results):
        assert r["owners"] == owners
        # Out: its shards of matrices owned elsewhere; back: the other ranks' shards of the
        # matrices it owns (fp32, 4 bytes). Received is the mirror image.
        local = {n: chunk_rows(ref[n].shape[0], world_size, rank) for n in owners}
        row = {n: ref[n][0].numel() for n in owners}
        out = sum(4 * local[n] * row[n] for n in owners if owners[n] != rank)
        back = sum(4 * (ref[n].shape[0] - local[n]) * row[n] for n in owners if owners[n] == rank)
        a2a = r["stats"]["all_to_all"]
        assert a2a["sent"] == out + back
        assert a2a["received"] == out + back
        # One all-to-all per bucket each way, not one per matrix.
        assert a2a["calls"] == 2 * r["buckets"]
        assert r["buckets"] < len(owners)
        assert world_size != 2 or r["buckets"] > 1
        for kind, d in r["expected"].items():
            assert r["stats"][kind]["sent"] == pytest.approx(d["sent"])
            assert r["stats"][kind]["received"] == pytest.approx(d["received"])
            assert r["stats"][kind]["calls"] == d["calls"]
        total_sent += a2a["sent"]
    matrix_bytes = sum(4 * ref[n].numel() for n in owners)
    sharded_per_rank = matrix_bytes / world_size
    # About 2 × the sharded matrix-gradient bytes per rank (exactly 2·(N−1)/N of it when
    # every owner holds an average shard).
    ratio = total_sent / world_size / sharded_per_rank
    assert 2 * (world_size - 1) / world_size * 0.8 <= ratio <= 2.0


def test_hsdp_matches_single_process_muon(runs):
    r4 = runs[4]
    for replica in (r4[:2], r4[2:]):
        assert_close(full(replica, "hsdp"), runs["ref"][STEPS], 1e-5)


def test_nonfinite_on_one_rank_is_agreed_and_plain_model_rejected(runs):
    for r in runs[2]:
        assert r["skipped"] and r["skip_warned"]
        assert "blocks.1.fc.weight" in r["raised"]
        assert "not a DTensor" in r["plain_error"] and "fully_shard" in r["plain_error"]


def test_state_dict_round_trip_at_world_size_one():
    model = make_model()
    opt = FSDPOptimizer(model, **KW)
    x, y = batch(0)
    loss_fn(model, x, y).backward()
    opt.step()
    opt.zero_grad()
    other = FSDPOptimizer(model, **KW)
    other.load_state_dict(opt.state_dict())
    other.param_groups[0]["lr"] = 0.5  # reaches the group the step reads
    assert other._matrices[0].group["lr"] == 0.5
    p = other._matrices[0].param
    assert torch.equal(other.state[p]["momentum_buffer"], opt.state[p]["momentum_buffer"])


def test_soap_matches_single_process_soap_bitwise(runs):
    """Same batch on both ranks, reference in the same one-thread process: the owner steps the
    full gradient through SOAP and every shard adds its rows of the same update, so the
    result is bit-identical (refreshes of the eigenbases included)."""
    two = runs[2]
    ref, got = two[0]["soap_ref"], full(two, "soap")
    assert got.keys() == ref.keys()
    for n in ref:
        assert torch.equal(got[n], ref[n]), n
    assert not torch.equal(ref["blocks.0.fc.weight"], make_model().blocks[0].fc.weight)
    owner = two[0]["soap_owner"]
    assert "basis_left" in two[owner]["soap_state_keys"]
    assert two[1 - owner]["soap_state_keys"] == ["step"]
    for r in two:
        # Gradient shards travel as Muon's update shards do: the same bytes formula.
        assert r["soap_stats"]["all_to_all"] == r["soap_expected"]["all_to_all"]
    # the full dict equals single-process SOAP's state, bit for bit
    want, got = two[0]["soap_ref_state"], two[1]["soap_full"]
    assert [g["param_names"] for g in got["param_groups"]] == [
        g["param_names"] for g in want["param_groups"]
    ]
    assert got["state"].keys() == want["state"].keys()
    for i, st in want["state"].items():
        assert got["state"][i].keys() == st.keys(), i
        for k, v in st.items():
            assert torch.equal(torch.as_tensor(got["state"][i][k]), torch.as_tensor(v)), (i, k)


def test_resume_2_rank_checkpoint_at_4_ranks(runs):
    assert_close(full(runs[4], "resumed"), runs["ref"][STEPS + EXTRA], 1e-5)
    # from the full dict: the same state as through DCP, so the same parameters
    resumed, from_full = full(runs[4], "resumed"), full(runs[4], "resumed_full")
    for n in resumed:
        assert torch.equal(from_full[n], resumed[n]), n


def test_full_state_dict_loads_into_single_process_optimizer(runs):
    """The 2-rank full dict is build_optimizer's format over the unsharded model."""
    sd = runs[2][0]["full"]
    assert runs[2][1]["full_rank0"] == {} and runs[2][0]["full_rank0"].keys() == sd.keys()
    model = make_model()
    with torch.no_grad():
        for n, p in model.named_parameters():
            p.copy_(full(runs[2], "params")[n])
    opt = build_optimizer(model, **KW)
    opt.load_state_dict(sd)
    for step in range(STEPS, STEPS + EXTRA):
        loss_fn(model, *batch(step)).backward()
        opt.step()
        opt.zero_grad()
    got = {n: p.detach() for n, p in model.named_parameters()}
    assert_close(got, runs["ref"][STEPS + EXTRA], 1e-5)
    fresh = make_model()  # without the loaded state the run ends elsewhere
    with torch.no_grad():
        for n, p in fresh.named_parameters():
            p.copy_(full(runs[2], "params")[n])
    fresh_opt = build_optimizer(fresh, **KW)
    for step in range(STEPS, STEPS + EXTRA):
        loss_fn(fresh, *batch(step)).backward()
        fresh_opt.step()
        fresh_opt.zero_grad()
    with pytest.raises(AssertionError):
        assert_close({n: p.detach() for n, p in fresh.named_parameters()},
                     runs["ref"][STEPS + EXTRA], 1e-5)  # fmt: skip


def test_bf16_on_the_wire(runs):
    r4 = runs[4]
    for r in r4:
        assert r["bf16_stats"]["all_to_all"]["sent"] * 2 == r["expected"]["all_to_all"]["sent"]
    got = full(r4, "bf16_params")
    ref = runs["ref"][1]
    assert_close(got, ref, 2e-2)
    with pytest.raises(AssertionError):
        assert_close(got, ref, 1e-7)


def test_world_size_one_matches_hybrid_and_rejects_bad_arguments():
    model, ref_model = make_model(), make_model()
    opt, ref = FSDPOptimizer(model, **KW), build_optimizer(ref_model, **KW)
    for step in range(3):
        for m, o in ((model, opt), (ref_model, ref)):
            x, y = batch(step)
            loss_fn(m, x, y).backward()
            o.step()
            o.zero_grad()
    assert_close(dict(model.named_parameters()), dict(ref_model.named_parameters()), 1e-6)
    model, ref_model = make_model(), make_model()
    opt, ref = FSDPOptimizer(model, **SOAP_KW), build_optimizer(ref_model, **SOAP_KW)
    train_same_batch(model, opt, range(4))
    train_same_batch(ref_model, ref, range(4))
    for (n, p), q in zip(model.named_parameters(), ref_model.parameters()):
        assert torch.equal(p, q), n
    with pytest.raises(ValueError, match="optimizer"):
        FSDPOptimizer(make_model(), optimizer="sgd")
    with pytest.raises(ValueError, match="comm_dtype"):
        FSDPOptimizer(make_model(), comm_dtype=torch.int32)
    with pytest.raises(ValueError, match="bucket_mb"):
        FSDPOptimizer(make_model(), bucket_mb=0)
