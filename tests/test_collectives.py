import pytest
import torch
import torch.distributed as dist

from orthoptim.parallel.collectives import (
    CommStats,
    all_gatherv,
    all_reduce,
    all_reduce_symmetric,
    pack_upper,
    packed_triangle_size,
    reduce_scatter,
    unpack_upper,
)

from distributed import run_ranks


def test_pack_unpack_round_trip():
    X = torch.randn(3, 7, 5)
    A = X @ X.mT
    packed = pack_upper(A)
    assert packed.shape == (3, packed_triangle_size(7))
    torch.testing.assert_close(unpack_upper(packed, 7), A)


def _collectives(rank, world_size):
    stats = CommStats()
    g = torch.Generator().manual_seed(rank)
    X = torch.randn(6, 9, generator=g)
    A = X @ X.T
    summed = all_reduce_symmetric(A, stats=stats)
    packed_bytes = stats.as_dict()["all_reduce"]["sent"]
    t = torch.full((4,), float(rank + 1))
    all_reduce(t, stats=stats)
    sizes = [3 + 2 * r for r in range(world_size)]
    parts = all_gatherv(
        torch.full((sizes[rank],), float(rank)), sizes, stats=stats, async_op=True
    ).wait()
    out = torch.empty(2)
    reduce_scatter(out, torch.arange(2.0 * world_size) * (rank + 1), stats=stats)
    return {
        "A": A,
        "summed": summed,
        "packed_bytes": packed_bytes,
        "t": t,
        "parts": parts,
        "rs": out,
    }


@pytest.mark.parametrize("world_size", [2, 3])
def test_collectives_against_local_sums(world_size):
    res = run_ranks(_collectives, world_size)
    total_A = sum(r["A"] for r in res)
    n = world_size
    for rank, r in enumerate(res):
        torch.testing.assert_close(r["summed"], total_A)
        assert r["packed_bytes"] == pytest.approx(2 * (n - 1) / n * packed_triangle_size(6) * 4)
        assert torch.equal(r["t"], torch.full((4,), float(sum(range(1, n + 1)))))
        for src, part in enumerate(r["parts"]):
            assert torch.equal(part, torch.full((3 + 2 * src,), float(src)))
        full = torch.arange(2.0 * n) * sum(range(1, n + 1))
        torch.testing.assert_close(r["rs"], full[2 * rank : 2 * rank + 2])
    assert dist.is_available()


def _device_checks(rank, world_size):
    """Under "cuda:gloo" (CUDA tensors only, like NCCL) on a machine without a GPU: every
    wrapper refuses a CPU tensor itself, naming the device and the backend."""
    from torch import nn

    from orthoptim.parallel import LayerwiseDistributedOptimizer
    from orthoptim.parallel import collectives as C

    cpu = torch.ones(2 * world_size)
    calls = {
        "all_reduce": lambda: C.all_reduce(cpu),
        "reduce_scatter": lambda: C.reduce_scatter(torch.empty(2), cpu),
        "all_gather": lambda: C.all_gather(torch.empty(2 * world_size), cpu[:2]),
        "all_gatherv": lambda: C.all_gatherv(cpu[:2], [2] * world_size),
        "broadcast": lambda: C.broadcast(cpu, src=0),
        "reduce": lambda: C.reduce(cpu, dst=0),
        "all_to_all": lambda: C.all_to_all(cpu.clone(), cpu, [2] * world_size, [2] * world_size),
        "optimizer": lambda: LayerwiseDistributedOptimizer(nn.Linear(4, 4)),
    }
    errors = {}
    for name, call in calls.items():
        try:
            call()
        except C.CollectiveDeviceError as exc:
            errors[name] = str(exc)
    # The backend's own refusal, met inside a named phase, is reported as a device problem.
    try:
        with C.phase("probe", None):
            dist.all_reduce(cpu)
    except C.CollectiveDeviceError as exc:
        errors["phase"] = str(exc)
    return {
        "devices": C.backend_devices(),
        "device_for": C.device_for().type,
        "device_for_cpu": C.device_for(like=torch.device("cpu")).type,
        "errors": errors,
    }


def test_cuda_only_backend_refuses_cpu_tensors_by_name():
    res = run_ranks(_device_checks, 2, backend="cuda:gloo")
    for r in res:
        assert r["devices"] == ("cuda",)
        assert r["device_for"] == r["device_for_cpu"] == "cuda"
        assert set(r["errors"]) == {
            "all_reduce", "reduce_scatter", "all_gather", "all_gatherv", "broadcast", "reduce",
            "all_to_all", "optimizer", "phase",
        }  # fmt: skip
        for name, msg in r["errors"].items():
            assert "cpu" in msg and "cuda:gloo" in msg, (name, msg)
            assert "died" not in msg, (name, msg)
        assert "parameter 'weight'" in r["errors"]["optimizer"]


def _gloo_devices(rank, world_size):
    from orthoptim.parallel import collectives as C

    return {
        "devices": C.backend_devices(),
        "device_for": C.device_for(),
        "cuda_like": C.device_for(like=torch.device("cuda", 0)),
        "objects": C.all_gather_object({"rank": rank, "t": torch.arange(rank + 1)}),
        "rank0": C.gather_object(rank * 10, dst=0),
        "agree": C.agree([rank == 0, False], [False, rank == 1]),
    }


def test_gloo_serves_cpu_and_cuda_and_objects_round_trip():
    res = run_ranks(_gloo_devices, 2)
    for rank, r in enumerate(res):
        assert r["devices"] == ("cpu", "cuda")
        assert r["device_for"] == torch.device("cpu")
        assert r["cuda_like"] == torch.device("cuda", 0)
        assert [o["rank"] for o in r["objects"]] == [0, 1]
        assert torch.equal(r["objects"][1]["t"], torch.arange(2))
        assert r["rank0"] == ([0, 10] if rank == 0 else None)
        assert r["agree"] == ([True, False], [False, True])
