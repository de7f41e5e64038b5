"""The Triton SYRK on a real GPU: every candidate config, both load paths (TMA descriptors and
masked pointers), 16-bit and float32, odd sizes and stacks, against the float64 product of the
same inputs; and the CUDA dispatch inside Newton-Schulz against the plain-matmul path.

The tolerance is the output rounding: each entry is accumulated in float32 and rounded once to
the output dtype (≤ half an ulp of the largest entry, 2^-8 relative for bfloat16, 2^-11 for
float16; float32 runs with matmul precision "highest", so IEEE products).
CUDA only: the same kernels run under the CPU interpreter in tests/test_triton_syrk.py.
"""

from __future__ import annotations

import importlib.util

import pytest
import torch

from orthoptim import kernels
from orthoptim.newton_schulz import newton_schulz

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available() or importlib.util.find_spec("triton") is None,
    reason="needs a CUDA GPU and triton (the CPU interpreter checks are tests/test_triton_syrk.py)",
)

TOL = {torch.bfloat16: 2.0**-8, torch.float16: 2.0**-10, torch.float32: 1e-5}


def _rel(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.double() - want).abs().max() / want.abs().max()).item()


def _check(X: torch.Tensor, cfg: object, tma: bool) -> None:
    from orthoptim.kernels import triton_syrk

    Xd = X.double()
    G = Xd @ Xd.mT
    got = triton_syrk.syrk(X, None, 0.0, 1.0, cfg, tma=tma)
    assert _rel(got, G) <= TOL[X.dtype], (tuple(X.shape), cfg, tma)
    A = (G / G.abs().amax(dim=(-2, -1), keepdim=True)).to(X.dtype)
    Ad = A.double()
    got = triton_syrk.syrk(A, A, -4.775, 2.0315, cfg, tma=tma)
    assert _rel(got, -4.775 * Ad + 2.0315 * (Ad @ Ad)) <= 4 * TOL[X.dtype], (A.shape, cfg, tma)


def test_every_bf16_candidate_on_both_load_paths() -> None:
    from orthoptim.kernels import triton_syrk, tuning

    torch.manual_seed(0)
    for shape in ((512, 768), (3, 264, 392), (1, 1032, 2056)):
        X = torch.randn(*shape, device="cuda", dtype=torch.bfloat16)
        assert triton_syrk.tma_usable(X) or torch.cuda.get_device_capability()[0] < 9
        for cfg in tuning.candidates(X.shape[-2], X.dtype):
            _check(X, cfg, tma=triton_syrk.tma_usable(X))
        _check(X, tuning.default_config(X.dtype), tma=False)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_odd_sizes_take_the_pointer_path(dtype: torch.dtype) -> None:
    from orthoptim.kernels import triton_syrk, tuning

    torch.manual_seed(1)
    before = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("highest")
    try:
        for shape in ((333, 517), (2, 129, 77), (1, 5, 3)):
            X = torch.randn(*shape, device="cuda", dtype=dtype)
            assert not triton_syrk.tma_usable(X)
            _check(X, tuning.default_config(dtype), tma=False)
    finally:
        torch.set_float32_matmul_precision(before)


def test_dispatch_matches_the_plain_product_on_either_side_of_the_threshold() -> None:
    from orthoptim.kernels import tuning

    torch.manual_seed(2)
    for m in (256, tuning.FALLBACK_MIN_ROWS):
        X = torch.randn(m, m + 64, device="cuda", dtype=torch.bfloat16)
        assert kernels.backend_for(X) == "triton"
        assert _rel(kernels.gram(X), X.double() @ X.double().mT) <= TOL[torch.bfloat16]


def test_newton_schulz_with_kernels_is_as_accurate_as_plain_matmul() -> None:
    """bf16 runs through different kernels round differently; against the same iteration in
    float64, the kernels' run must be no further off than the plain-matmul bf16 run (up to a
    quarter more, for the spread of one rounding against another)."""
    torch.manual_seed(3)
    X = torch.randn(4, 1024, 1536, device="cuda")
    with kernels.force_matmul():
        exact = newton_schulz(X.double())
        plain = newton_schulz(X, dtype=torch.bfloat16)
    fast = newton_schulz(X, dtype=torch.bfloat16)

    def off(Y: torch.Tensor) -> float:
        return (
            (torch.linalg.matrix_norm(Y.double() - exact) / torch.linalg.matrix_norm(exact))
            .max()
            .item()
        )

    assert off(fast) <= 1.25 * off(plain), (off(fast), off(plain))
