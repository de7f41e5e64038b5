"""Every `orthoptim.collectives` wrapper at 2 ranks on the suite's device (one GPU
shared under "cuda:gloo"): exact values (small integers, every sum exact in any order), byte
counts, and on CUDA the refusal of a CPU tensor by name, as NCCL would refuse it."""

from __future__ import annotations

import os

import pytest
import torch

from orthoptim.comm_bytes import CommStats

from ._models import WORLD, setup_rank, spawn, to_cpu

# The wrappers that take tensors, each called with one CPU tensor (what a CUDA-only backend
# refuses); the names are what the refusal must carry.
REFUSING = (
    "all_reduce", "reduce_scatter", "all_gather", "all_gatherv", "broadcast", "reduce",
    "all_to_all", "optimizer", "phase",
)  # fmt: skip


def _values(rank: int, n: int, device: str) -> dict:
    from orthoptim import collectives as C

    out: dict = {}
    stats = CommStats()
    t = torch.arange(4.0, device=device) + rank
    C.all_reduce(t, stats=stats)
    out["all_reduce"] = t
    t = torch.full((3,), float(rank + 1), device=device, dtype=torch.bfloat16)
    C.all_reduce(t)
    out["all_reduce_bf16"] = t
    t = torch.ones(5, device=device) * (rank + 1)
    work = C.all_reduce(t, async_op=True)
    C.wait(work, "async all-reduce")
    out["all_reduce_async"] = t
    inp = torch.arange(2.0 * n, device=device) * (rank + 1)
    rs = torch.empty(2, device=device)
    C.reduce_scatter(rs, inp, stats=stats)
    out["reduce_scatter"] = rs
    ag = torch.empty(2 * n, device=device)
    C.all_gather(ag, torch.full((2,), float(rank), device=device), stats=stats)
    out["all_gather"] = ag
    sizes = [r + 1 for r in range(n)]  # uneven: gloo pads to the largest
    local = torch.full((rank + 1,), float(10 + rank), device=device)
    out["all_gatherv"] = C.all_gatherv(local, sizes, stats=stats, async_op=True).wait()
    b = torch.full((3,), float(rank), device=device)
    C.broadcast(b, src=1, stats=stats)
    out["broadcast"] = b
    r = torch.full((3,), float(rank + 1), device=device)
    C.reduce(r, dst=0, stats=stats)
    out["reduce"] = r if rank == 0 else None
    # rank r sends (r + 1) elements to each peer p, valued 100·r + p
    in_splits = [rank + 1] * n
    out_splits = [p + 1 for p in range(n)]
    send = torch.cat([torch.full((rank + 1,), 100.0 * rank + p, device=device) for p in range(n)])
    recv = torch.empty(sum(out_splits), device=device)
    C.all_to_all(recv, send, out_splits, in_splits, stats=stats)
    out["all_to_all"] = recv
    out["objects"] = C.all_gather_object(
        {"rank": rank, "t": torch.arange(rank + 1, device=device)}, stats=stats
    )
    C.barrier(stats=stats)
    out["agree"] = C.agree([rank == 0, False], [False, rank == 1], device=device)
    packed = torch.eye(3, device=device) * (rank + 1)
    out["symmetric"] = C.all_reduce_symmetric(packed)
    out["stats"] = stats.as_dict()
    out["devices"] = {
        "backend_devices": C.backend_devices(),
        "device_for": str(C.device_for()),
        "results_on": sorted(
            {str(v.device) for v in (out["all_reduce"], ag, rs, b, recv, *out["all_gatherv"])}
        ),
        "object_tensor_on": str(out["objects"][1]["t"].device),
    }
    return out


def _refusals(rank: int, n: int) -> dict[str, str]:
    """Under a CUDA-only backend: every wrapper refuses a CPU tensor itself, by name."""
    from models.collectives import cpu_tensor_refusals

    return cpu_tensor_refusals(n)


def _ranks(rank: int, n: int, device: str, outdir: str) -> dict:
    from orthoptim import collectives as C

    setup_rank(device)
    out = {"values": to_cpu(_values(rank, n, device))}
    if torch.device(device).type == "cuda":
        out["refusals"] = _refusals(rank, n)
        # the group still works after the refusals (nothing was half-sent)
        t = torch.ones(1, device=device)
        C.all_reduce(t)
        out["after"] = t.item()
    # gather_object is point to point (send/recv), which gloo implements for CPU memory only
    # (it hands the tensor's raw pointer to its TCP transport): under "cuda:gloo" it may abort
    # the rank. It runs last, after the rest is saved, so a failure leaves the other checks.
    torch.save(out, os.path.join(outdir, f"partial{rank}.pt"))
    out["gather_object"] = C.gather_object({"rank": rank, "t": torch.full((2,), rank)}, dst=0)
    return to_cpu(out)


@pytest.fixture(scope="module")
def runs(env, tmp_path_factory):
    """(every rank's results, None), or when the run failed in gather_object (the last
    check) (every rank's results before it, the failure)."""
    outdir = tmp_path_factory.mktemp("collectives")
    try:
        return spawn(env, _ranks, str(outdir), timeout=60.0), None
    except AssertionError as exc:
        paths = [outdir / f"partial{r}.pt" for r in range(WORLD)]
        if not all(p.exists() for p in paths):
            raise
        cause = f"\n({exc.__cause__!r})" if exc.__cause__ is not None else ""
        return [torch.load(p, weights_only=False) for p in paths], f"{exc}{cause}"


def test_every_wrapper_gives_exact_values_on_the_suite_device(env, runs):
    runs, _ = runs
    n = len(runs)
    for rank, res in enumerate(runs):
        v = res["values"]
        assert torch.equal(v["all_reduce"], torch.arange(4.0) * n + sum(range(n)))
        assert torch.equal(v["all_reduce_bf16"], torch.full((3,), 3.0, dtype=torch.bfloat16))
        assert torch.equal(v["all_reduce_async"], torch.full((5,), 3.0))
        full = torch.arange(2.0 * n) * sum(range(1, n + 1))
        assert torch.equal(v["reduce_scatter"], full[2 * rank : 2 * rank + 2])
        assert torch.equal(v["all_gather"], torch.arange(n).float().repeat_interleave(2))
        assert [p.tolist() for p in v["all_gatherv"]] == [[10.0 + r] * (r + 1) for r in range(n)]
        assert torch.equal(v["broadcast"], torch.full((3,), 1.0))
        if rank == 0:
            assert torch.equal(v["reduce"], torch.full((3,), 3.0))
        want = torch.cat([torch.full((s + 1,), 100.0 * s + rank) for s in range(n)])
        assert torch.equal(v["all_to_all"], want)
        assert [o["rank"] for o in v["objects"]] == list(range(n))
        assert torch.equal(v["objects"][1]["t"], torch.arange(2))
        assert v["agree"] == ([True, False], [False, True])
        assert torch.equal(v["symmetric"], torch.eye(3) * 3)
        # everything stayed on the suite's device (nothing silently went through the CPU)
        d = v["devices"]
        assert d["results_on"] == [str(torch.device(env.device))]
        assert d["object_tensor_on"] == str(torch.device(env.device))
        if env.cuda:
            assert d["backend_devices"] == ("cuda",)
            assert d["device_for"] == "cuda:0"
        else:
            assert "cpu" in d["backend_devices"] and d["device_for"] == "cpu"
        # byte accounting (fp32, N = 2): all_reduce 2(N−1)/N·16 B, reduce_scatter and
        # all_gather (N−1)/N of the full 16 B, all_gatherv pads 1 and 2 elements to 2
        s = v["stats"]
        assert s["all_reduce"]["sent"] >= 16.0  # the 4-element tensor (plus object sizes)
        assert s["reduce_scatter"]["sent"] == s["reduce_scatter"]["received"] == 8.0
        assert s["all_gather"]["calls"] >= 2
        assert s["barrier"]["calls"] == 1
        assert s["broadcast"]["sent"] == (12.0 if rank == 1 else 0.0)
        assert s["reduce"]["received"] == (12.0 if rank == 0 else 0.0)


def test_cpu_tensors_are_refused_by_name_on_cuda(env, runs):
    if not env.cuda:
        pytest.skip(
            "CPU mode: gloo serves CPU tensors, so there is nothing to refuse; on a CUDA "
            "machine the ranks run under 'cuda:gloo', which takes CUDA tensors only"
        )
    for res in runs[0]:
        errors = res["refusals"]
        assert set(errors) == set(REFUSING), sorted(errors)
        for name, msg in errors.items():
            assert "cpu" in msg and "cuda:gloo" in msg, (name, msg)
            assert "died" not in msg, (name, msg)
        assert "parameter 'weight'" in errors["optimizer"]
        assert res["after"] == 2.0


def test_gather_object_to_one_rank(runs):
    results, failure = runs
    assert failure is None, f"gather_object (send/recv) failed on the suite's backend:\n{failure}"
    for rank, r in enumerate(results):
        got = r["gather_object"]
        if rank != 0:
            assert got is None
            continue
        assert [o["rank"] for o in got] == list(range(WORLD))
        for o in got:
            assert torch.equal(o["t"], torch.full((2,), o["rank"]))
