"""Checks of the Triton SYRK run on CPU under `TRITON_INTERPRET=1` (float32: the interpreter's
bf16 is unreliable). Run as `python triton_interpreter_checks.py NAME` by test_triton_syrk.py,
in a process of its own because the interpreter is chosen when triton is imported.
"""

from __future__ import annotations

import itertools
import sys

import torch
import triton
import triton.language as tl

if triton.__version__.startswith("3.6."):
    # triton 3.6's interpreter takes a runtime scalar (a shape-(1,) array) as a loop bound
    # through int(array), which numpy >= 2.4 rejects; backport 3.7's squeeze().
    from triton.runtime import interpreter

    patch_tensor = interpreter._patch_lang_tensor

    def _patch_lang_tensor(tensor, scope):  # type: ignore[no-untyped-def]
        patch_tensor(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.squeeze()))

    interpreter._patch_lang_tensor = _patch_lang_tensor

from orthoptim.kernels import triton_syrk, tuning
from orthoptim.kernels.tuning import SyrkConfig


def _rel(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got - want).abs().max() / want.abs().max()).item()


def products() -> None:
    """Gram and fused b·A + c·A·A against torch, on both load paths, over tile shapes (square
    and 1×2 super-tiles), launch orders (row-major, bands, persistent), batches and sizes that
    are not multiples of the tiles (pointer path; TMA needs 16-byte rows)."""
    torch.manual_seed(0)
    cases = [
        ((64, 96), SyrkConfig(16, 16, 16, 4, 2), (False, True)),
        ((2, 40, 48), SyrkConfig(16, 32, 16, 4, 2, group=2), (False, True)),
        ((72, 40), SyrkConfig(8, 16, 8, 4, 2, group=3, persistent=True), (False, True)),
        ((3, 24, 24), SyrkConfig(8, 8, 8, 4, 2, group=4, persistent=True), (False, True)),
        ((37, 50), SyrkConfig(16, 32, 16, 4, 2, group=2), (False,)),
        ((2, 33, 20), SyrkConfig(8, 16, 8, 4, 2, group=3), (False,)),
    ]
    worst = 0.0
    for shape, cfg, paths in cases:
        X = torch.randn(*shape)
        G = X @ X.mT
        A = G / G.abs().amax()
        for tma in paths:
            worst = max(worst, _rel(triton_syrk.syrk(X, config=cfg, tma=tma), G))
            P = triton_syrk.syrk(A, A, 0.5, -1.5, config=cfg, tma=tma)
            worst = max(worst, _rel(P, 0.5 * A - 1.5 * (A @ A)))
    print("worst", worst)
    assert worst < 1e-5, worst


@triton.jit
def _record_order(I, J, T, GROUP: tl.constexpr):
    t = tl.program_id(0)
    i, j = triton_syrk._super_tile(t, T, GROUP)
    tl.store(I + t, i)
    tl.store(J + t, j)


def order() -> None:
    """Every launch order visits each lower-triangle super-tile exactly once, and a band of
    GROUP rows is walked column by column (the L2-friendly order)."""
    for T in (1, 2, 5, 8, 13):
        want = {(i, j) for i in range(T) for j in range(i + 1)}
        for group in (1, 2, 3, 4, 8):
            n = T * (T + 1) // 2
            I = torch.full((n,), -1, dtype=torch.int32)
            J = torch.full((n,), -1, dtype=torch.int32)
            _record_order[(n,)](I, J, T, GROUP=group)
            seen = list(zip(I.tolist(), J.tolist()))
            assert sorted(seen) == sorted(want), (T, group, seen)
            if group > 1:  # within a band the column index never goes back
                for (i0, j0), (i1, j1) in itertools.pairwise(seen):
                    if i0 // group == i1 // group:
                        assert j1 >= j0, (T, group, seen)
    print("orders ok")


def tune() -> None:
    """`triton_syrk.tune` races the plain product against the configs and returns the fastest of
    the timings it reports; a config that cannot run is kept out of the race."""
    torch.manual_seed(0)
    X = torch.randn(24, 40)
    good = SyrkConfig(8, 8, 8, 4, 2)
    bad = SyrkConfig(8, 32, 8, 4, 2)  # block_n = 4·block_m: refused
    choice, times = triton_syrk.tune(
        X, None, [good, bad], timer=lambda fn: tuning.wall_timer(fn, 1)
    )
    assert times[bad.name] != times[bad.name], times  # NaN
    finite = {k: v for k, v in times.items() if v == v}
    assert set(finite) == {tuning.MATMUL, good.name}, times
    best = min(finite, key=finite.__getitem__)
    assert (choice == tuning.MATMUL) if best == tuning.MATMUL else (choice == good), (choice, times)
    print("tune ok", times)


if __name__ == "__main__":
    {"products": products, "order": order, "tune": tune}[sys.argv[1]]()
