"""The packed triangle of the Gram all-reduce: its layout by row blocks round-trips exactly,
the split form's per-rank pieces fit the same layout, and the cost model sends the Gram packed
only where the link, not the copy, is the bottleneck: both ways give the full Newton-Schulz
result and the bytes `tp_cost` prices."""

from __future__ import annotations

import itertools

import pytest
import torch

from orthoptim.comm_bytes import CommStats
from orthoptim.newton_schulz import newton_schulz
from orthoptim.parallel.tensor_parallel import (
    GRAM_KIND,
    CostModel,
    TensorParallelOrthogonalizer,
    split_plan,
    tp_cost,
)
from orthoptim.parallel.tp_model import pack_cost
from orthoptim.shards import (
    pack_block_row,
    pack_upper,
    packed_triangle_size,
    triangle_block_size,
    triangle_blocks,
    unpack_upper,
)

from distributed import run_ranks

STEPS = 5
SLOW_LINK = CostModel(bandwidth=1e3)  # every Gram worth packing
FAST_LINK = CostModel(bandwidth=1e18, memory_bandwidth=1e6)  # none


def _symmetric(k, m, seed):
    X = torch.randn(k, m, m + 5, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    return X @ X.mT


@pytest.mark.parametrize("m", [1, 2, 7, 127, 128, 129, 300])
@pytest.mark.parametrize("nblocks", [None, 1, 3, 8])
def test_pack_round_trips_bit_for_bit(m, nblocks):
    A = _symmetric(2, m, seed=m)
    blocks = triangle_blocks(m, nblocks)
    assert blocks[0][0] == 0 and blocks[-1][1] == m
    assert all(a < b and b == c for (a, b), (c, _) in itertools.pairwise(blocks))
    packed = pack_upper(A, blocks)
    assert packed.shape == (2, packed_triangle_size(m))
    assert sum(triangle_block_size(a, b, m) for a, b in blocks) == packed_triangle_size(m)
    # the upper triangle mirrored: what a symmetric sum of ranks' Grams is
    assert torch.equal(unpack_upper(packed, m, blocks), A.triu() + A.triu(1).mT)
    # the strictly lower triangle is never read: garbage there changes nothing
    noisy = A.triu() + torch.randn(2, m, m, dtype=A.dtype).tril(-1)
    assert torch.equal(pack_upper(noisy, blocks), packed)


def test_a_block_row_is_its_share_of_the_layout():
    """The split form sends pack_block_row of each of its row slabs; put in block order they
    are pack_upper of the whole triangle."""
    A = _symmetric(1, 50, seed=3)
    plan = split_plan(50, 3)
    blocks = sorted(b for blks in plan for b in blks)
    pieces = [pack_block_row(A[:, a:b, a:]) for a, b in blocks]
    assert torch.equal(torch.cat(pieces, dim=1), pack_upper(A, blocks))


def test_packing_is_chosen_where_the_link_is_the_bottleneck():
    assert SLOW_LINK.packs(1, 512, 4, 4)
    assert not FAST_LINK.packs(1, 512, 4, 4)
    assert not SLOW_LINK.packs(1, 512, 1, 4)  # nothing to send
    # the GPU node's defaults: small Grams go whole (the per-block operations cost more than
    # the NVLink time they save), the CPU figures pack a 1024-wide Gram
    assert not CostModel().packs(1, 256, 8, 2)
    assert CostModel.for_device("cpu").packs(1, 1024, 4, 4)
    # the decision weighs exactly the saved link time against pack_cost
    model = CostModel.for_device("cpu")
    for m in (16, 64, 256, 1024):
        saved = 1.5 * (m * m - packed_triangle_size(m)) * 4 / model.bandwidth
        assert model.packs(1, m, 4, 4) == (saved > model.seconds(pack_cost(1, m, 4)))


def _both_ways(rank, world_size):
    out = {}
    G = torch.randn(2, 48, 24, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    for shard_dim in (0, 1):
        local = G.chunk(world_size, dim=1 + shard_dim)[rank].contiguous()
        for name, model in (("packed", SLOW_LINK), ("whole", FAST_LINK)):
            for mode, form in (
                ("distributed", "apply"),
                ("distributed", "square"),
                ("gram", "auto"),
            ):
                stats = CommStats()
                orth = TensorParallelOrthogonalizer(
                    mode=mode, shard_dim=shard_dim, steps=STEPS, form=form, cost_model=model,
                    stats=stats,
                )  # fmt: skip
                out[(shard_dim, name, mode, form)] = (orth(local), stats.sent.get(GRAM_KIND, 0.0))
    return out


@pytest.mark.parametrize("world_size", [2, 3])
def test_packed_and_whole_gram_give_the_full_result_and_the_priced_bytes(world_size):
    res = run_ranks(_both_ways, world_size)
    G = torch.randn(2, 48, 24, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    ref = newton_schulz(G, steps=STEPS)
    for shard_dim in (0, 1):
        rows, cols = 48, 24
        p = (cols, rows)[shard_dim]
        for rank, r in enumerate(res):
            want = ref.chunk(world_size, dim=1 + shard_dim)[rank]
            for packed in (True, False):
                name = "packed" if packed else "whole"
                for mode, form in (("distributed", "apply"), ("distributed", "square")):
                    got, sent = r[(shard_dim, name, mode, form)]
                    torch.testing.assert_close(got, want, rtol=0, atol=1e-10)
                    model = tp_cost(
                        mode, 2, rows, cols, shard_dim, world_size, STEPS, 8, form, packed
                    )
                    norm = 2 * (world_size - 1) / world_size * 2 * 8
                    assert sent == pytest.approx(model.bytes_sent - norm)
                    elems = packed_triangle_size(p) if packed else p * p
                    assert sent == pytest.approx(
                        STEPS * 2 * (world_size - 1) / world_size * 2 * elems * 8
                    )
                got, sent = r[(shard_dim, name, "gram", "auto")]
                torch.testing.assert_close(got, want, rtol=0, atol=1e-9)
            # packed and whole sums are sums of the same numbers: the results agree closely
            a = r[(shard_dim, "packed", "distributed", "apply")][0]
            b = r[(shard_dim, "whole", "distributed", "apply")][0]
            torch.testing.assert_close(a, b, rtol=0, atol=1e-12)
