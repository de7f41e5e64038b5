"""TensorParallelOrthogonalizer at 2 ranks sharing one GPU: every mode and every form of
distributed mode, on row- and column-sharded stacks and on DTensors, against the full
matrix's `newton_schulz` on the same device (one spawned run).

On CUDA the float32 and bf16 cases go through the Triton SYRK kernels where Triton is
installed (the Gram and b·A + c·A·A of the distributed forms), float64 through matmul.
"""

from __future__ import annotations

import pytest
import torch

from orthoptim.newton_schulz import newton_schulz
from orthoptim.parallel import TensorParallelOrthogonalizer
from orthoptim.parallel.tensor_parallel import FORMS, MODES

from ._models import setup_rank, spawn, to_cpu

STEPS = 5
# (mode, form): every mode, and distributed mode in every form ("auto" lets the cost model
# pick; duplicated and blockwise ignore the form).
VARIANTS = (
    *((m, "auto") for m in MODES if m != "distributed"),
    *(("distributed", f) for f in FORMS),
)
# (k, rows, cols): wide and tall, both sides divisible by 2.
SHAPES = ((2, 24, 40), (3, 48, 16))
# Uneven DTensor shards (10 rows, 13 columns over 2 ranks).
DTENSOR_SHAPE = (2, 10, 13)
# Entries of the result are O(1/√cols) ≈ 0.15–0.25. The sharded iteration sums its Gram
# over ranks (and the packed triangle) in another order than the single-device one: float64
# rounding (~1e-16 relative) amplified by at most ~10³ over 5 steps (the quintic's slope at
# 0 is ≈ 4) stays below 1e-12; float32 (6e-8) likewise below 2e-5 (as
# tests/test_tensor_parallel.py). bf16 keeps 8 bits: against the float32 result 0.05 (as
# tests/test_tensor_parallel.py's bf16 check). Measured on CPU: float64 ≤ 4e-15, float32
# ≤ 3e-6, bf16 ≤ 0.023 (distributed/apply).
TOL = {"float64": 1e-12, "float32": 2e-5, "default": 0.05}


def _full(k, rows, cols, seed, dtype, device):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(k, rows, cols, generator=g, dtype=torch.float64).to(device, dtype)


def _case(kind, cuda):
    """(input dtype, the orthogonalizer's ns_dtype, the reference's Newton-Schulz dtype).
    "default": the optimizers' default ("auto": bf16 on CUDA); on CPU "auto" is float32, so
    the CPU run asks for bf16 explicitly to exercise the same comparison."""
    if kind == "float64":
        return torch.float64, torch.float64, torch.float64
    if kind == "float32":
        return torch.float32, torch.float32, torch.float32
    return torch.float32, ("auto" if cuda else torch.bfloat16), torch.float32


def _modes(rank, world_size, device):
    cuda = torch.device(device).type == "cuda"
    results = {}
    for kind in TOL:
        in_dtype, ns_dtype, ref_dtype = _case(kind, cuda)
        for si, (k, rows, cols) in enumerate(SHAPES):
            G = _full(k, rows, cols, si, in_dtype, device)
            ref = newton_schulz(G, steps=STEPS, dtype=ref_dtype)
            for shard_dim in (0, 1):
                local = G.chunk(world_size, dim=1 + shard_dim)[rank].contiguous()
                ref_local = ref.chunk(world_size, dim=1 + shard_dim)[rank]
                for mode, form in VARIANTS:
                    orth = TensorParallelOrthogonalizer(
                        None, mode=mode, shard_dim=shard_dim, steps=STEPS, form=form,
                        ns_dtype=ns_dtype,
                    )  # fmt: skip
                    out = orth(local)
                    want = (
                        newton_schulz(local, steps=STEPS, dtype=ref_dtype)
                        if mode == "blockwise"
                        else ref_local
                    )
                    results[(kind, si, shard_dim, mode, form)] = {
                        "err": (out.double() - want.double()).abs().max().item(),
                        "like_input": (out.shape, out.dtype, str(out.device))
                        == (local.shape, local.dtype, str(local.device)),
                        "modes": list(orth.last_modes),
                        "forms": list(orth.last_forms),
                    }
    return results


def _dtensors(rank, world_size, device):
    """DTensor inputs (as Muon hands them over): group and shard dimension from the mesh
    and placements, uneven shards, on the suite's device mesh."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh(torch.device(device).type, (world_size,))
    G = _full(*DTENSOR_SHAPE, 7, torch.float64, device)
    ref = newton_schulz(G, steps=STEPS)
    results = {}
    for dim in (1, 2):
        D = distribute_tensor(G, mesh, [Shard(dim)])
        for mode in MODES:
            orth = TensorParallelOrthogonalizer(mode=mode, steps=STEPS, ns_dtype=torch.float64)
            out = orth(D)
            expected = ref
            if mode == "blockwise":  # each rank's shard on its own
                local = D.to_local()
                mine = newton_schulz(local, steps=STEPS)
                expected = None
                results[("dtensor_blockwise", dim)] = (out.to_local() - mine).abs().max().item()
            results[("dtensor", dim, mode)] = {
                "err": None if expected is None else (out.full_tensor() - ref).abs().max().item(),
                "placements": out.placements == D.placements,
                "device": str(out.to_local().device),
                "modes": list(orth.last_modes),
            }
    return results


def _ranks(rank, world_size, device):
    setup_rank(device)
    return to_cpu(
        {"modes": _modes(rank, world_size, device), **_dtensors(rank, world_size, device)}
    )


@pytest.fixture(scope="module")
def runs(env):
    return spawn(env, _ranks)


@pytest.mark.parametrize("kind", list(TOL))
def test_every_mode_and_form_matches_full_newton_schulz(runs, kind):
    tol = TOL[kind]
    seen = 0
    for rank, r in enumerate(runs):
        for (k, si, shard_dim, mode, form), res in r["modes"].items():
            if k != kind:
                continue
            seen += 1
            where = f"rank {rank} shape {SHAPES[si]} shard_dim {shard_dim} {mode}/{form}"
            assert res["like_input"], where
            assert res["err"] <= tol, f"{where}: max error {res['err']:.3g} > {tol}"
            assert res["modes"] == [mode if mode != "auto" else res["modes"][0]], where
            if mode == "auto":  # the cost model picks a full iteration, never blockwise
                assert res["modes"][0] in ("duplicated", "distributed"), where
            if res["modes"][0] == "distributed":
                want = [form] if form != "auto" else res["forms"]
                assert res["forms"] == want and res["forms"][0] in FORMS[1:], where
    assert seen == len(runs) * len(SHAPES) * 2 * len(VARIANTS)


def test_dtensor_inputs_with_uneven_shards(env, runs):
    for r in runs:
        for dim in (1, 2):
            for mode in MODES:
                res = r[("dtensor", dim, mode)]
                assert res["placements"] and res["device"] == str(torch.device(env.device))
                if res["err"] is not None:
                    assert res["err"] <= TOL["float64"], (dim, mode, res)
            assert r[("dtensor_blockwise", dim)] <= TOL["float64"]
            assert r[("dtensor", dim, "auto")]["modes"][0] in ("duplicated", "distributed")
