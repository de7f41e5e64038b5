"""The layout object: sizes, refusals, rank order, and the groups it builds on real ranks."""

from __future__ import annotations

import itertools

import pytest
import torch

from orthoptim.parallel.layout import ParallelDims, as_flags

from distributed import run_ranks


def test_rank_order_and_groups_partition_the_world():
    d = ParallelDims(dp=4, tp=2, ep=2, pp=2)
    assert d.world == 16 and d.expert_dp == 2
    coords = [d.coordinate(r) for r in range(d.world)]
    # every coordinate once, tp fastest, then ep, then edp, then pp
    assert len(set(coords)) == 16
    assert [c.tp for c in coords[:4]] == [0, 1, 0, 1]
    assert [c.ep for c in coords[:4]] == [0, 0, 1, 1]
    assert [c.pp for c in coords] == [0] * 8 + [1] * 8
    for c in coords:
        assert c.dp == c.edp * d.ep + c.ep
    for dim, size in dict(dp=4, edp=2, ep=2, tp=2, pp=2, stage=8, world=16).items():
        groups = d.all_group_ranks(dim)
        assert all(len(g) == size for g in groups), dim
        assert sorted(itertools.chain(*groups)) == list(range(16)), dim
    # the groups' definitions, by coordinates
    for r in range(16):
        c = d.coordinate(r)
        for dim, same in dict(
            dp=("pp", "tp"), edp=("pp", "ep", "tp"), ep=("pp", "edp", "tp"),
            tp=("pp", "dp"), pp=("dp", "tp"), stage=("pp",),
        ).items():  # fmt: skip
            want = [q for q in range(16) if all(
                getattr(d.coordinate(q), k) == getattr(c, k) for k in same
            )]  # fmt: skip
            assert d.group_ranks(dim, r) == want, (dim, r)


# (arguments, the library's words, the command line's words)
BAD_SIZES = [
    (dict(world_size=8, ep=3), "ep 3 must divide dp 8", "--ep 3 must divide --dp 8"),
    (dict(world_size=6, pp=4), "world_size 6 must be a multiple of pp 4 × tp 1",
     "--nproc 6 must be a multiple of --pp 4 × --tp 1"),
    (dict(world_size=8, pp=2, dp=2), "pp 2 × dp 2 × tp 1 is 4 ranks, but world_size is 8",
     "--pp 2 × --dp 2 × --tp 1 is 4 ranks, but --nproc is 8"),
    (dict(world_size=8, tp=0), "tp must be a positive integer", "--tp must be a positive"),
    (dict(world_size=0), "world_size must be >= 1, got 0", "--nproc must be >= 1, got 0"),
]  # fmt: skip


@pytest.mark.parametrize(("kwargs", "words", "flags"), BAD_SIZES)
def test_bad_sizes_are_refused_in_library_terms_and_mapped_to_flags(kwargs, words, flags):
    """`ParallelDims` names its own arguments; `as_flags` (the command lines') names them as
    `orthoptim train`'s and `orthoptim plan`'s flags."""
    with pytest.raises(ValueError) as e:
        ParallelDims.for_world(**kwargs)
    assert words in str(e.value) and "--" not in str(e.value), str(e.value)
    with pytest.raises(ValueError) as e, as_flags():
        ParallelDims.for_world(**kwargs)
    assert flags in str(e.value), str(e.value)


def test_model_checks_name_their_size():
    with pytest.raises(ValueError, match="^pp 5 exceeds the model's 4 layers.*use pp 4 or"):
        ParallelDims(dp=1, pp=5).check(n_layer=4)
    with pytest.raises(ValueError, match="^ep 2: the model has no routed experts; use ep 1"):
        ParallelDims(dp=2, ep=2).check(n_expert=0)
    with pytest.raises(ValueError, match="^ep 4 must divide the model's 6 experts"):
        ParallelDims(dp=4, ep=4).check(n_expert=6)
    flags = "^--pp 5 exceeds the model's 4 layers.*use --pp 4"
    with pytest.raises(ValueError, match=flags), as_flags():
        ParallelDims(dp=1, pp=5).check(n_layer=4)
    ParallelDims(dp=4, ep=2, pp=2).check(n_layer=2, n_expert=8)


def test_hybrid_sharding_groups():
    d = ParallelDims(dp=4, tp=2, dp_replicate=2)
    assert d.dp_shard == 2 and d.describe().endswith("--dp-replicate 2")
    # dp indices 0,1 are replica 0 and 2,3 replica 1 (ranks: dp index · tp + tp index)
    assert d.group_ranks("dp_shard", 0) == [0, 2] and d.group_ranks("dp_shard", 5) == [5, 7]
    assert d.group_ranks("dp_replicate", 0) == [0, 4] and d.group_ranks("dp_replicate", 3) == [3, 7]
    with pytest.raises(ValueError, match="^dp_replicate 3 must divide dp 4"):
        ParallelDims(dp=4, dp_replicate=3)
    with pytest.raises(ValueError, match="^--dp-replicate 3 must divide --dp 4"), as_flags():
        ParallelDims(dp=4, dp_replicate=3)


def _fsdp_mesh(rank, world_size):
    from orthoptim.parallel.fsdp import shard_model

    mesh = ParallelDims.for_world(world_size, dp_replicate=2).build("cpu").fsdp_mesh
    model = shard_model(torch.nn.Sequential(torch.nn.Linear(4, 8)), mesh)
    weight = model[0].weight
    return (
        mesh.mesh.tolist(),
        mesh.mesh_dim_names,
        mesh.get_coordinate(),
        [str(p) for p in weight.placements],
        weight.to_local().shape[0],
        ParallelDims.for_world(world_size).build("cpu").fsdp_mesh.mesh.tolist(),
    )


def test_fsdp_mesh_is_replicate_by_shard_over_dp():
    """FSDP2 on the layout's mesh: replicated over 2 replicas, each row sharded over 2."""
    for rank, (ranks, names, coord, placements, rows, flat) in enumerate(run_ranks(_fsdp_mesh, 4)):
        assert ranks == [[0, 1], [2, 3]] and names == ("replicate", "shard")
        assert list(coord) == [rank // 2, rank % 2]
        assert placements == ["R", "S(0)"] and rows == 4  # (Replicate(), Shard(0))
        assert flat == [0, 1, 2, 3]


def _built_groups(rank, world_size):
    import torch.distributed as dist

    dims = ParallelDims.for_world(world_size, ep=2, pp=2)
    mesh = dims.build("cpu")
    out = {}
    for dim in ("dp", "edp", "ep", "tp", "pp", "stage"):
        g = mesh.group(dim)
        ranks = list(range(world_size)) if g is None else dist.get_process_group_ranks(g)
        total = torch.tensor([float(rank)])
        dist.all_reduce(total, group=g)
        out[dim] = (ranks, dims.group_ranks(dim, rank), total.item())
    return out, mesh.tp_mesh.mesh.tolist()


def test_build_makes_the_groups_the_sizes_describe():
    for rank, (groups, tp_mesh) in enumerate(run_ranks(_built_groups, 8)):
        for dim, (real, planned, total) in groups.items():
            assert real == planned, (rank, dim)
            assert total == sum(planned), (rank, dim)  # a collective over it reaches them
        assert tp_mesh == [rank]


@pytest.mark.parametrize("field", ["dp", "tp", "ep", "pp", "dp_replicate"])
@pytest.mark.parametrize("bad", [0, -2, True, 2.0, "2"])
def test_every_size_must_be_a_positive_int(field, bad):
    with pytest.raises(ValueError, match=f"^{field} must be a positive integer, got {bad!r}$"):
        ParallelDims(**{field: bad})
