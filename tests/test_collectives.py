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
