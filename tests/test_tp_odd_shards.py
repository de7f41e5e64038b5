"""Odd tensor-parallel shards and the Newton-Schulz norm (issue 55, items 3 and 4).

- Empty and short shards (a DTensor of 6 rows over 4 ranks: 2, 2, 2, 0; a sharded side
  shorter than the TP size): every mode and form, at TP 2 and 4, equals the single-device
  Newton-Schulz of the full float64 matrix on every rank, and every rank of a group issues
  the same collectives.
- Unequal plain shards: refused on every rank with the same one line (the parameter's name
  or the shapes, and the fix), after which the group still works; blockwise takes them.
- The norm: a sum of squares accumulated accurately, on `newton_schulz` and on the
  tensor-parallel modes, against float64 on a 4 Mi-element float32 matrix.

Everything multi-rank runs in one spawn under a short process-group timeout, so a rank
left waiting on a collective its peer skipped fails the run in a minute, not thirty.
"""

from __future__ import annotations

import traceback

import pytest
import torch
import torch.distributed as dist

from orthoptim.comm_bytes import CommStats
from orthoptim.newton_schulz import newton_schulz, squared_frobenius
from orthoptim.parallel import TensorParallelOrthogonalizer
from orthoptim.parallel.tensor_parallel import SHAPES_KIND
from orthoptim.shards import shard_sizes

from distributed import run_ranks

STEPS = 5
# seconds any collective may wait: a hang fails the run fast (the checks take seconds)
TIMEOUT_S = 60
# float64 against the full matrix's float64 Newton-Schulz: the sharded sums run in another
# order and gram mode takes other products (the Gram form); five steps amplify a rounding of
# ~1e-16 on these O(1) entries to a measured max |Δ| of 2.4e-14 (gram mode, 2x3 at TP 4;
# the others ≤ 1e-14), so 1e-12 leaves a 40-fold margin and still catches any real error
# (a lost or doubled shard moves entries by O(0.1)).
F64_TOL = 1e-12
# (mode, form): every form distributed mode takes, gram (its "gram" or "rows" form by shape)
VARIANTS = (
    ("duplicated", "auto"),
    ("distributed", "apply"),
    ("distributed", "square"),
    ("distributed", "split"),
    ("distributed", "rows"),
    ("gram", "auto"),
    ("blockwise", "auto"),
    ("auto", "auto"),
)
# name: (global shape, tensor dim sharded). Local sizes along it at TP 4 / TP 2 in comments.
ODD = {
    "6x32 rows": ((2, 6, 32), 1),  # 2, 2, 2, 0 / 3, 3
    "32x6 cols": ((2, 32, 6), 2),
    "3x16 rows": ((2, 3, 16), 1),  # 1, 1, 1, 0 (shorter than TP) / 2, 1
    "16x3 cols": ((2, 16, 3), 2),
    "1x16 rows": ((1, 1, 16), 1),  # 1, 0, 0, 0 / 1, 0
    "3x2 rows": ((2, 3, 2), 1),  # along the long side (gram's "gram" form): 1, 1, 1, 0 / 2, 1
    "2x3 cols": ((2, 2, 3), 2),
    "5x8 matrix": ((5, 8), 0),  # one 2-D matrix: 2, 2, 1, 0 / 3, 2
}
# Plain local shards per rank, (k, rows, cols) by TP rank: unequal along the split side
# (shard_dim 0), and unequal elsewhere (the other side differs).
UNEQUAL = {
    4: [((2, 2, 32), 0), ((2, 2, 32), 0), ((2, 2, 32), 0), ((2, 0, 32), 0)],
    2: [((2, 4, 8), 1), ((2, 5, 8), 1)],
}
# the norm: 4 Mi float32 entries, all of one sign (a naive float32 sum drifts most there)
NORM_SHAPE = (1024, 4096)


def _full(shape, seed, dtype=torch.float64):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=dtype)


def _norm_matrix() -> torch.Tensor:
    return _full(NORM_SHAPE, seed=99, dtype=torch.float32).abs_().add_(0.01)


def _maxdiff(a: torch.Tensor, b: torch.Tensor) -> float:
    """max |a − b| (0 for empty blocks, which hold nothing to be wrong)."""
    return (a - b).abs().max().item() if a.numel() else 0.0


def _calls(stats: CommStats) -> dict[str, int]:
    return {k: v["calls"] for k, v in stats.as_dict().items()}


def _odd_checks(mesh) -> dict:
    """Every odd case in every mode on DTensors over `mesh`: this rank's error against the
    full matrix's result, its shapes and placements, the collectives it issued."""
    from torch.distributed.tensor import Shard, distribute_tensor

    tp_rank, T = mesh.get_local_rank(), mesh.size()
    out = {}
    for i, (case, (shape, dim)) in enumerate(ODD.items()):
        G = _full(shape, seed=i)
        ref = newton_schulz(G, steps=STEPS)
        D = distribute_tensor(G, mesh, [Shard(dim)])
        local = D.to_local()
        want = ref.split(shard_sizes(shape[dim], T), dim=dim)[tp_rank]
        for mode, form in VARIANTS:
            stats = CommStats()
            orth = TensorParallelOrthogonalizer(mode=mode, form=form, steps=STEPS, stats=stats)
            try:
                got = orth(D)
            except Exception:  # recorded, so every case's outcome is seen, not the first
                out[(case, mode, form)] = {"error": traceback.format_exc()}
                continue
            expected = newton_schulz(local, steps=STEPS) if mode == "blockwise" else want
            mine = got.to_local()
            out[(case, mode, form)] = {
                "local": tuple(local.shape),
                "err": _maxdiff(mine, expected),
                "shape_ok": mine.shape == expected.shape and mine.dtype == torch.float64,
                "placements": got.placements == D.placements and got.shape == D.shape,
                "calls": _calls(stats),
                "modes": list(orth.last_modes),
            }
    return out


def _unequal_checks(group, T: int, tp_rank: int) -> dict:
    """Unequal plain shards in every mode: the error text each rank got (None: taken), then
    an equal-shard call on the same group, which must still work."""
    shape, shard_dim = UNEQUAL[T][tp_rank]
    local = _full(shape, seed=tp_rank)
    out: dict = {}
    for mode, form in VARIANTS:
        for name in ("layers.3.weight", None):
            orth = TensorParallelOrthogonalizer(
                group, mode=mode, form=form, shard_dim=shard_dim, steps=STEPS
            )
            try:
                got = orth(local, name=name)
                out[(mode, form, name)] = {
                    "error": None,
                    "err": _maxdiff(got, newton_schulz(local, steps=STEPS)),
                }
            except ValueError as exc:
                out[(mode, form, name)] = {"error": str(exc), "calls": _calls(orth.stats)}
    G = _full((2, 4 * T, 8), seed=7)
    orth = TensorParallelOrthogonalizer(group, mode="distributed", shard_dim=0, steps=STEPS)
    got = orth(G.chunk(T, dim=1)[tp_rank].contiguous())
    ref = newton_schulz(G, steps=STEPS).chunk(T, dim=1)[tp_rank]
    out["after"] = {"err": _maxdiff(got, ref), "calls": _calls(orth.stats)}
    return out


def _norm_checks(group, T: int, tp_rank: int) -> dict:
    """Each communicating mode's normalisation of the 4 Mi-element float32 matrix, split
    along its columns, read off with the identity step (a, b, c) = (1, 0, 0): the output is
    X / norm exactly, so its float64 norm over the ranks is ‖X‖ / norm."""
    X = _norm_matrix().chunk(T, dim=1)[tp_rank].contiguous()
    out = {}
    for mode, form in (("duplicated", "auto"), ("distributed", "apply"), ("distributed", "rows"),
                       ("gram", "auto")):  # fmt: skip
        orth = TensorParallelOrthogonalizer(
            group, mode=mode, form=form, shard_dim=1, steps=1, coefficients=[(1.0, 0.0, 0.0)]
        )
        sq = orth(X).double().square().sum().reshape(1)
        dist.all_reduce(sq, group=group)
        out[(mode, form)] = abs(sq.sqrt().item() - 1.0)
    return out


def _all_checks(rank: int, world_size: int) -> dict:
    from torch.distributed.device_mesh import init_device_mesh

    mesh4 = init_device_mesh("cpu", (4,))
    mesh2d = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    tp2 = mesh2d["tp"]
    return {
        "odd": {4: _odd_checks(mesh4), 2: _odd_checks(tp2)},
        "unequal": {
            4: _unequal_checks(None, 4, rank),
            2: _unequal_checks(tp2.get_group(), 2, rank % 2),
        },
        "norm": _norm_checks(tp2.get_group(), 2, rank % 2),
    }


@pytest.fixture(scope="module")
def ranks() -> list[dict]:
    return run_ranks(_all_checks, 4, timeout=TIMEOUT_S)


def _groups(T: int) -> list[list[int]]:
    return [list(range(4))] if T == 4 else [[0, 1], [2, 3]]


@pytest.mark.parametrize("T", [2, 4])
def test_empty_and_short_shards_equal_the_full_matrix_in_every_mode(ranks, T):
    """Each rank's block of every mode's result is the full matrix's (float64), the empty
    ranks included, and the DTensor keeps its placements and global shape."""
    seen_empty = set()
    for rank in range(4):
        res = ranks[rank]["odd"][T]
        for (case, mode, form), got in res.items():
            assert "error" not in got, (T, rank, case, mode, form, got.get("error"))
            assert got["shape_ok"] and got["placements"], (T, rank, case, mode, form)
            assert got["err"] <= F64_TOL, (T, rank, case, mode, form, got["err"])
            if 0 in got["local"]:
                seen_empty.add(case)
    # the cases hold what they say: empty shards at both sizes
    assert {"1x16 rows", "6x32 rows", "3x16 rows", "5x8 matrix"} & seen_empty
    assert "1x16 rows" in seen_empty


@pytest.mark.parametrize("T", [2, 4])
def test_every_rank_of_a_group_issues_the_same_collectives(ranks, T):
    """No collective skipped by one rank alone: per case and mode, the same kinds and
    counts on every rank of a TP group (the empty rank's included), and auto picks alike."""
    for members in _groups(T):
        first = ranks[members[0]]["odd"][T]
        for key, got in first.items():
            for r in members[1:]:
                other = ranks[r]["odd"][T][key]
                assert other["calls"] == got["calls"], (T, r, key)
                assert other["modes"] == got["modes"], (T, r, key)
            if key[1] != "blockwise":
                assert got["calls"]["total"] > 0, key


@pytest.mark.parametrize("T", [2, 4])
def test_unequal_plain_shards_are_refused_on_every_rank_in_one_line(ranks, T):
    for members in _groups(T):
        for key in ranks[members[0]]["unequal"][T]:
            if key == "after":
                continue
            mode, _, name = key
            got = [ranks[r]["unequal"][T][key] for r in members]
            if mode == "blockwise":  # no communication: each rank orthogonalizes its own
                assert all(g["error"] is None and g["err"] <= F64_TOL for g in got), key
                continue
            errors = {g["error"] for g in got}
            assert len(errors) == 1, (T, key, errors)  # every rank refused, with one text
            (line,) = errors
            assert line is not None and "\n" not in line, (T, key, line)
            assert "DTensor" in line and "equal size" in line and "shard_dim=" in line, line
            if name is not None:
                assert repr(name) in line, line
            else:
                shapes = ", ".join("x".join(map(str, s)) for s, _ in UNEQUAL[T])
                assert shapes in line, line
            # one small all-gather of the shapes, and nothing else, before refusing
            assert got[0]["calls"] == {SHAPES_KIND: 1, "total": 1}, (T, key, got[0]["calls"])
        for r in members:  # the group is not left with a collective in flight
            assert ranks[r]["unequal"][T]["after"]["err"] <= F64_TOL, (T, r)


def test_newton_schulz_norm_is_accurate_where_torchs_fp32_norm_is_not():
    """The sum of squares against float64 on 4 Mi float32 entries: within 1e-6 relative,
    where torch's float32 norm (the control) is not; `newton_schulz` normalises with it."""
    X = _norm_matrix()
    exact = X.double().square().sum().sqrt().item()
    control = torch.linalg.matrix_norm(X).item()
    assert abs(control - exact) / exact > 1e-6  # the matrix is one torch's norm gets wrong
    ours = squared_frobenius(X, torch.float32).sqrt().item()
    assert abs(ours - exact) / exact <= 1e-6, abs(ours - exact) / exact
    # the identity step (1, 0, 0) returns X / norm: its float64 norm is ‖X‖ / norm
    out = newton_schulz(X, steps=1, coefficients=[(1.0, 0.0, 0.0)])
    assert abs(out.double().norm().item() - 1.0) <= 1e-6


def test_tensor_parallel_modes_normalise_as_accurately(ranks):
    """Duplicated, distributed (both Gram sides) and gram mode on the same matrix at TP 2:
    each within 1e-6 of the float64 norm, on every rank, as the single-device path."""
    for rank in range(4):
        for key, err in ranks[rank]["norm"].items():
            assert err <= 1e-6, (rank, key, err)
