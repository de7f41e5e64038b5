"""Each CPU Newton-Schulz path, forced (`kernels.force_path`), under the layer-wise, FSDP and
tensor-parallel drivers on real gloo ranks against single-process Muon with the same path.

The suite turns racing off (conftest), so without forcing every driver would run the plain
product. Here each path runs in turn: "matmul" (the control), "cpu_syrk", "gram_form" and
"gram_form_syrk", with the blocked SYRK's leaf at 8 rows so these small matrices really split.
The model's matrices, rows <= columns, are wide (16×128: the Gram form's) and not (16×24: the
step form's), also as tensor-parallel halves. One spawn of two ranks per driver runs every path.

Tolerance: float64 throughout (the paths take it). The runs differ from the single-process
ones only by rounding: the order of the averaged gradient's sum (data parallel) or of the
sharded products (tensor parallel), and each path's own order of products. That is ~1e-16
relative per sum of at most 128 terms, ~1e-14; Newton-Schulz grows a perturbation by at most
a = 3.4445 per step on the smallest singular values, 3.4445^5 ≈ 500, over 3 optimizer steps:
~2e-11 relative at worst (measured: at most 2.2e-15). TOL = 1e-10 is that with margin; a wrong
product moves the parameters by about the learning rate (1e-2 relative) or more.

Every forced path equals the plain one to TOL in one process too (the independent oracle), so
a defect a path shares with its single-process reference still fails. Matching values cannot
tell the paths apart (here the SYRK path's results are bitwise the plain ones'), so each run
also counts the calls of the path's kernels (the blocked SYRK, its one-triangle product, the
Gram-form iteration): a driver that silently ran the plain product would match within TOL but
not in its counts.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from orthoptim import build_optimizer, kernels
from orthoptim.kernels import syrk_cpu
from orthoptim.ns_cost import PATHS, SYRK_PATHS, PathName

from distributed import run_ranks

# the module (`orthoptim.newton_schulz` is also the name of the package's function)
ns = importlib.import_module("orthoptim.newton_schulz")

# PATHS: matmul (the control), cpu_syrk, gram_form, gram_form_syrk
STEPS, BATCH, WIDTH, NARROW, WIDE = 3, 8, 16, 24, 128
TOL = 1e-10
LR = dict(lr=0.02, adamw_lr=3e-3)
# The kernels a path runs through (counted): the blocked SYRK, the one-triangle product of two
# commuting symmetric matrices, the Gram-form iteration.
KERNELS = {
    "syrk": (syrk_cpu, "syrk"),
    "sym_matmul": (syrk_cpu, "sym_matmul"),
    "gram_form": (ns, "newton_schulz_gram_form"),
}
USES: dict[str, set[str]] = {
    "matmul": set(),
    "cpu_syrk": {"syrk"},
    "gram_form": {"gram_form"},
    "gram_form_syrk": {"syrk", "sym_matmul", "gram_form"},
}
# Tensor-parallel modes: (mode, distributed mode's form).
TP_MODES = (
    ("duplicated", "auto"),
    ("distributed", "apply"),
    ("distributed", "square"),
    ("blockwise", "auto"),
)


class Net(nn.Module):
    """Two residual MLPs: a narrow one (24×16, 16×24: the step form) and a wide one (128×16,
    16×128: the Gram form, also as halves), with a LayerNorm for AdamW. Column- then
    row-parallel under tensor parallelism."""

    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(WIDTH)
        self.a, self.b = nn.Linear(WIDTH, NARROW, bias=False), nn.Linear(NARROW, WIDTH, bias=False)
        self.fc1, self.fc2 = nn.Linear(WIDTH, WIDE, bias=False), nn.Linear(WIDE, WIDTH, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        x = x + self.b(torch.tanh(self.a(self.norm(x))))
        return x + self.fc2(torch.tanh(self.fc1(x)))


def make_model() -> Net:
    torch.manual_seed(0)
    return Net().double()


def batch(step: int) -> tuple[Tensor, Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    x = torch.randn(BATCH, WIDTH, generator=g, dtype=torch.float64)
    return x, torch.randn(BATCH, WIDTH, generator=g, dtype=torch.float64)


def matrices(name: str, p: Tensor) -> bool:
    return p.ndim >= 2


def train(model: nn.Module, opt: Any, rows: slice = slice(None)) -> None:
    for step in range(STEPS):
        x, y = batch(step)
        F.mse_loss(model(x[rows]), y[rows]).backward()
        opt.step()
        opt.zero_grad()


@contextmanager
def counting() -> Iterator[dict[str, int]]:
    """The calls of each of KERNELS within the block (top-level calls: the SYRK's recursion
    does not go through its entry point)."""
    counts = dict.fromkeys(KERNELS, 0)
    real = {key: getattr(mod, attr) for key, (mod, attr) in KERNELS.items()}

    def counted(key: str) -> Callable[..., Any]:
        def call(*args: Any, **kwargs: Any) -> Any:
            counts[key] += 1
            return real[key](*args, **kwargs)

        return call

    for key, (mod, attr) in KERNELS.items():
        setattr(mod, attr, counted(key))
    try:
        yield counts
    finally:
        for key, (mod, attr) in KERNELS.items():
            setattr(mod, attr, real[key])


@contextmanager
def small_leaves() -> Iterator[None]:
    """The blocked SYRK splits down to 8-row leaves at 8-row boundaries (16 rows: two leaves)."""
    saved = syrk_cpu.LEAF_ROWS, syrk_cpu.ALIGN
    syrk_cpu.LEAF_ROWS, syrk_cpu.ALIGN = 8, 8
    try:
        yield
    finally:
        syrk_cpu.LEAF_ROWS, syrk_cpu.ALIGN = saved


def run_path(path: PathName, build: Callable[[], tuple[nn.Module, Any, slice]]) -> dict[str, Any]:
    """Train what `build` makes (model, optimizer, this rank's rows) with `path` forced; the
    full parameters after STEPS steps and the kernel calls made."""
    with small_leaves(), kernels.force_path(path), counting() as counts:
        model, opt, rows = build()
        train(model, opt, rows)
        if hasattr(opt, "wait_for_params"):
            opt.wait_for_params()
    params = {
        n: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone()
        for n, p in model.named_parameters()
    }
    return {"params": params, "counts": dict(counts)}


# -- the drivers, one spawn each -----------------------------------------------------------------


def _half(rank: int, world_size: int) -> slice:
    per = BATCH // world_size
    return slice(rank * per, (rank + 1) * per)


def _layerwise(rank: int, world_size: int) -> dict[str, Any]:
    from orthoptim.parallel import LayerwiseDistributedOptimizer

    def build() -> tuple[nn.Module, Any, slice]:
        model = make_model()
        opt = LayerwiseDistributedOptimizer(model, optimizer="muon", route=matrices, **LR)
        return model, opt, _half(rank, world_size)

    return {path: run_path(path, build) for path in PATHS}


def _fsdp(rank: int, world_size: int) -> dict[str, Any]:
    from orthoptim.parallel.fsdp import FSDPOptimizer, shard_model

    def build() -> tuple[nn.Module, Any, slice]:
        model = shard_model(make_model())
        opt = FSDPOptimizer(model, optimizer="muon", route=matrices, **LR)
        return model, opt, _half(rank, world_size)

    return {path: run_path(path, build) for path in PATHS}


def _tensor_parallel(rank: int, world_size: int) -> dict[tuple[str, str, str], Any]:
    """Muon with a TensorParallelOrthogonalizer over the whole world as the tp group; every
    rank trains on the whole batch."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    from orthoptim.parallel import TensorParallelOrthogonalizer

    mesh = init_device_mesh("cpu", (world_size,))
    plan = {"a": ColwiseParallel(), "b": RowwiseParallel()}
    plan |= {"fc1": ColwiseParallel(), "fc2": RowwiseParallel()}
    out = {}
    for mode, form in TP_MODES:

        def build(mode: str = mode, form: str = form) -> tuple[nn.Module, Any, slice]:
            model = parallelize_module(make_model(), mesh, plan)
            orth = TensorParallelOrthogonalizer(mode=mode, form=form)  # type: ignore[arg-type]
            opt = build_optimizer(
                model, optimizer="muon", route=matrices, orthogonalizer=orth, **LR
            )
            return model, opt, slice(None)

        for path in PATHS:
            out[(mode, form, path)] = run_path(path, build)
    return out


@pytest.fixture(scope="module")
def layerwise() -> list[dict[str, Any]]:
    return run_ranks(_layerwise, 2)


@pytest.fixture(scope="module")
def fsdp() -> list[dict[str, Any]]:
    return run_ranks(_fsdp, 2)


@pytest.fixture(scope="module")
def tensor_parallel() -> list[dict[tuple[str, str, str], Any]]:
    return run_ranks(_tensor_parallel, 2)


# -- the single-process references ---------------------------------------------------------------


def _blockwise(mats: Tensor) -> Tensor:
    """Tensor-parallel blockwise mode in one process: Newton-Schulz of each rank's half on its
    own (the column-parallel weights' rows, the row-parallel weights' columns, split in two)."""
    dim = -2 if mats.shape[-1] == WIDTH else -1
    return torch.cat([ns.newton_schulz(h) for h in mats.chunk(2, dim=dim)], dim=dim)


@pytest.fixture(scope="module")
def single() -> dict[tuple[str, PathName], dict[str, Any]]:
    """Single-process Muon on the whole batch with each path forced: plain Newton-Schulz, and
    the blockwise orthogonalizer (keyed "blockwise")."""
    out = {}
    for kind, orth in (("muon", None), ("blockwise", _blockwise)):

        def build(orth: Any = orth) -> tuple[nn.Module, Any, slice]:
            model = make_model()
            opt = build_optimizer(
                model, optimizer="muon", route=matrices, orthogonalizer=orth, **LR
            )
            return model, opt, slice(None)

        for path in PATHS:
            out[(kind, path)] = run_path(path, build)
    return out


# -- the checks ----------------------------------------------------------------------------------


def assert_close(got: dict[str, Tensor], want: dict[str, Tensor], label: str) -> None:
    assert got.keys() == want.keys(), label
    errors = {n: ((got[n] - w).norm() / w.norm()).item() for n, w in want.items()}
    bad = {n: e for n, e in errors.items() if not e <= TOL}
    assert not bad, f"{label}: relative errors above {TOL}: {bad}"


def summed(results: list[dict[str, int]]) -> dict[str, int]:
    return {k: sum(r[k] for r in results) for k in KERNELS}


def ran(counts: dict[str, int]) -> set[str]:
    return {k for k, v in counts.items() if v}


@pytest.mark.parametrize("path", PATHS)
def test_each_path_in_one_process_runs_its_kernels_and_equals_the_plain_one(
    single: dict[tuple[str, PathName], dict[str, Any]], path: PathName
) -> None:
    for kind in ("muon", "blockwise"):
        got, plain = single[(kind, path)], single[(kind, "matmul")]
        assert ran(got["counts"]) == USES[path], (kind, got["counts"])
        assert_close(got["params"], plain["params"], f"{kind} {path} against the plain product")
    moved = single[("muon", path)]["params"]["fc1.weight"] - make_model().fc1.weight
    assert moved.norm() > 1e-2 * make_model().fc1.weight.norm()  # the steps did move it


@pytest.mark.parametrize("path", PATHS)
def test_layerwise_runs_the_forced_path_as_one_process(
    layerwise: list[dict[str, Any]], single: dict[tuple[str, PathName], Any], path: PathName
) -> None:
    """Each matrix orthogonalized on its owner alone: the ranks' calls add up to one process's."""
    ref = single[("muon", path)]
    for rank, res in enumerate(layerwise):
        assert_close(res[path]["params"], ref["params"], f"layer-wise rank {rank}, {path}")
    assert summed([r[path]["counts"] for r in layerwise]) == ref["counts"]


@pytest.mark.parametrize("path", PATHS)
def test_fsdp_runs_the_forced_path_as_one_process(
    fsdp: list[dict[str, Any]], single: dict[tuple[str, PathName], Any], path: PathName
) -> None:
    """Each full matrix orthogonalized on its owner alone: the ranks' calls add up to one
    process's."""
    ref = single[("muon", path)]
    for rank, res in enumerate(fsdp):
        assert_close(res[path]["params"], ref["params"], f"FSDP rank {rank}, {path}")
    assert summed([r[path]["counts"] for r in fsdp]) == ref["counts"]


@pytest.mark.parametrize("mode,form", TP_MODES)
@pytest.mark.parametrize("path", PATHS)
def test_tensor_parallel_runs_the_forced_path_as_one_process(
    tensor_parallel: list[dict[tuple[str, str, str], Any]],
    single: dict[tuple[str, PathName], Any],
    path: PathName,
    mode: str,
    form: str,
) -> None:
    """Duplicated: every rank orthogonalizes every full matrix, as one process does. Blockwise:
    each rank its halves, which one process's blockwise run orthogonalizes all of. Distributed:
    the step form by construction (the Gram is summed over ranks every step), its Grams (and
    in the square form its polynomials) by the SYRK on the SYRK paths and by plain products
    otherwise."""
    ref = single[("blockwise" if mode == "blockwise" else "muon", path)]
    runs = [r[(mode, form, path)] for r in tensor_parallel]
    for rank, res in enumerate(runs):
        assert_close(res["params"], ref["params"], f"tp {mode}/{form} rank {rank}, {path}")
    if mode == "duplicated":
        assert [r["counts"] for r in runs] == [ref["counts"]] * len(runs)
    elif mode == "blockwise":
        assert summed([r["counts"] for r in runs]) == ref["counts"]
    else:
        want = {"syrk"} if path in SYRK_PATHS else set()
        assert [ran(r["counts"]) for r in runs] == [want] * len(runs), [r["counts"] for r in runs]
