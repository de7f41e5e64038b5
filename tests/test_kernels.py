"""The symmetric-product kernels against plain matmul, and Newton-Schulz with and without them."""

from __future__ import annotations

import pytest
import torch

from orthoptim import kernels
from orthoptim.kernels import syrk_cpu
from orthoptim.newton_schulz import newton_schulz, polar_factor

from conftest import ill_conditioned

TOL = {torch.float32: 2e-5, torch.float64: 1e-12}


def _rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got - want).abs().max() / want.abs().max().clamp_min(1e-30)).item()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize(
    "shape",
    # rows around the leaf (16) and split alignment (32), odd sizes, batches, tall and wide
    [
        (15, 40),
        (16, 40),
        (17, 40),
        (31, 7),
        (32, 33),
        (33, 64),
        (63, 5),
        (65, 130),
        (3, 47, 29),
        (2, 3, 70, 20),
    ],
)
def test_blocked_syrk_matches_matmul(shape: tuple[int, ...], dtype: torch.dtype) -> None:
    X = torch.randn(*shape, dtype=dtype)
    want = X @ X.mT
    got = syrk_cpu.syrk(X, leaf=16)
    assert got.shape == want.shape and got.dtype == dtype
    assert _rel_err(got, want) < TOL[dtype]
    A = want / want.abs().max()
    fused = syrk_cpu.syrk(A, A, beta=0.7, alpha=-1.3, leaf=16)
    assert _rel_err(fused, 0.7 * A - 1.3 * (A @ A)) < TOL[dtype]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize(
    # with leaf 16 the rows first split at h (a multiple of 32, or m - 1)
    ("shape", "h"),
    [((17, 40), 16), ((33, 64), 32), ((70, 20), 64), ((3, 47, 29), 32)],
)
def test_sym_matmul_of_commuting_symmetric_matches_matmul(
    shape: tuple[int, ...], h: int, dtype: torch.dtype
) -> None:
    X = torch.randn(*shape, dtype=dtype)
    A = X @ X.mT
    A = A / A.abs().max()
    Q = 0.5 * A - 0.3 * (A @ A)  # a polynomial in A: commutes with it, so A·Q is symmetric
    want = A @ Q
    got = syrk_cpu.sym_matmul(A, Q, leaf=16)
    assert got.shape == want.shape and got.dtype == dtype
    assert _rel_err(got, want) < TOL[dtype]
    # only the block below the split is computed; the one above mirrors it (so a product
    # that is not symmetric shows it)
    B = torch.randn_like(A)
    got = syrk_cpu.sym_matmul(A, B, leaf=16)
    full = A @ B
    assert _rel_err(got[..., h:, :h], full[..., h:, :h]) < TOL[dtype]
    assert torch.equal(got[..., :h, h:], got[..., h:, :h].mT)
    assert _rel_err(got[..., :h, h:], full[..., :h, h:]) > 0.1


def test_blocked_syrk_recurses_and_mirrors() -> None:
    # 70 rows with leaf 16 split at 64/32/16: the off-diagonal blocks are exact mirrors.
    X = torch.randn(70, 50, dtype=torch.float64)
    G = syrk_cpu.syrk(X, leaf=16)
    assert torch.equal(G[32:, :32], G[:32, 32:].mT)
    with pytest.raises(ValueError, match="leaf"):
        syrk_cpu.syrk(X, leaf=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("shape", [(512, 300), (513, 257), (2, 600, 100)])
def test_dispatch_uses_cpu_syrk_and_matches(shape: tuple[int, ...], dtype: torch.dtype) -> None:
    X = torch.randn(*shape, dtype=dtype)
    with kernels.force_path("cpu_syrk"):
        assert kernels.backend_for(X) == "cpu_syrk"
        assert _rel_err(kernels.gram(X), X @ X.mT) < TOL[dtype]
        A = kernels.gram(X) / X.shape[-1]
        assert _rel_err(kernels.sym_square(A), A @ A) < TOL[dtype]
        assert _rel_err(kernels.sym_poly(A, -2.0, 0.5), -2.0 * A + 0.5 * (A @ A)) < TOL[dtype]


def test_dispatch_falls_back_to_matmul() -> None:
    # unmeasured (the tests turn measuring off), every CPU shape takes the plain product
    for shape in ((600, 600), (1024, 4096), (2, 600, 100)):
        X = torch.randn(*shape)
        assert kernels.backend_for(X) == "matmul" and not kernels.gram_form_pays(X)
        assert kernels.path_for(X).reason == "default"
    with kernels.force_path("cpu_syrk"):
        assert kernels.backend_for(torch.randn(600, 600, dtype=torch.bfloat16)) == "matmul"
        assert kernels.backend_for(torch.randn(600, 60, requires_grad=True)) == "matmul"
        with torch.no_grad():
            assert kernels.backend_for(torch.randn(600, 60, requires_grad=True)) == "cpu_syrk"
    bf = torch.randn(40, 30, dtype=torch.bfloat16)
    assert torch.equal(kernels.gram(bf), bf @ bf.mT)
    with pytest.raises(ValueError, match="force_path.*gram_form_syrk"):  # noqa: SIM117
        with kernels.force_path("blocked"):  # type: ignore[arg-type]
            pass


def test_force_matmul_and_env_var(monkeypatch: pytest.MonkeyPatch) -> None:
    X = torch.randn(600, 64)
    assert kernels.kernel_mode() == "auto"
    with kernels.force_path("cpu_syrk"):
        with kernels.force_matmul():
            with kernels.force_matmul(False):
                assert kernels.backend_for(X) == "matmul"  # the outer block still forces
            assert kernels.kernel_mode() == "matmul"
        assert kernels.backend_for(X) == "cpu_syrk"
        monkeypatch.setenv(kernels.ENV_VAR, "matmul")
        assert kernels.backend_for(X) == "matmul"
        monkeypatch.setenv(kernels.ENV_VAR, "fast")
        with pytest.raises(ValueError, match=kernels.ENV_VAR):
            kernels.gram(X)


def test_bad_shapes_are_named() -> None:
    with pytest.raises(ValueError, match="gram"):
        kernels.gram(torch.randn(5))
    with pytest.raises(ValueError, match="square"):
        kernels.sym_poly(torch.randn(4, 5), 1.0, 1.0)


@pytest.fixture
def small_blocks(monkeypatch: pytest.MonkeyPatch) -> None:
    """Make the blocked SYRK split at small sizes so Newton-Schulz tests stay fast."""
    monkeypatch.setattr(syrk_cpu, "LEAF_ROWS", 16)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("shape", [(80, 130), (130, 80), (2, 72, 100)])
def test_newton_schulz_with_kernels_matches_matmul(
    shape: tuple[int, ...], dtype: torch.dtype, small_blocks: None
) -> None:
    G = torch.randn(*shape, dtype=dtype)
    with kernels.force_path("cpu_syrk"):
        assert kernels.backend_for(G.mT if shape[-2] > shape[-1] else G) == "cpu_syrk"
        fast = newton_schulz(G, steps=5)
    with kernels.force_matmul():
        plain = newton_schulz(G, steps=5)
    tol = 1e-4 if dtype == torch.float32 else 1e-11
    assert (fast - plain).abs().max().item() < tol
    # and it still orthogonalizes: the quintic maps singular values into roughly [0.7, 1.2]
    s = torch.linalg.svdvals(fast.double())
    assert s.min() > 0.5 and s.max() < 1.25
    P = polar_factor(G)
    assert ((fast.double() - P).norm() / P.norm()).item() < 0.35


@pytest.mark.parametrize("path", ["gram_form", "gram_form_syrk"])
@pytest.mark.parametrize("coefficients", ["quintic", "polar_express"])
@pytest.mark.parametrize("shape", [(48, 130), (130, 48), (2, 40, 96)])
def test_gram_form_matches_matmul_and_svd(
    shape: tuple[int, ...], coefficients: str, path: str, small_blocks: None
) -> None:
    X, U, V, _ = ill_conditioned(shape[-2], shape[-1], cond=1e3)
    if len(shape) == 3:
        X = torch.stack([X, X.flip(0)])
    G = X.float()
    wide = G.mT if shape[-2] > shape[-1] else G
    with kernels.force_path(path):  # type: ignore[arg-type]
        assert kernels.gram_form_pays(wide)
        assert kernels.backend_for(wide) == ("cpu_syrk" if path == "gram_form_syrk" else "matmul")
        fast = newton_schulz(G, steps=5, coefficients=coefficients)
        with kernels.force_matmul():
            assert not kernels.gram_form_pays(wide)
            plain = newton_schulz(G, steps=5, coefficients=coefficients)
    assert (fast - plain).abs().max().item() < 1e-4
    # same singular vectors as the input (the test of tests/test_newton_schulz.py)
    D = U.T @ fast[0 if len(shape) == 3 else ...].double() @ V
    assert (D - torch.diag(torch.diagonal(D))).abs().max() < 1e-4


def test_gram_form_only_where_it_applies(small_blocks: None) -> None:
    assert not kernels.gram_form_pays(torch.randn(40, 80))  # unmeasured: the plain product
    with kernels.force_path("gram_form_syrk"):
        assert kernels.gram_form_pays(torch.randn(40, 80))
        assert not kernels.gram_form_pays(torch.randn(40, 79))  # n < 2m: step form is cheaper
        assert kernels.path_for(torch.randn(40, 79)).path == "cpu_syrk"
        assert not kernels.gram_form_pays(torch.randn(40, 96, dtype=torch.bfloat16))
    with kernels.force_path("gram_form"):
        assert kernels.path_for(torch.randn(40, 79)).path == "matmul"


@pytest.mark.parametrize("path", ["matmul", "cpu_syrk", "gram_form", "gram_form_syrk"])
def test_newton_schulz_default_sizes_match_matmul(path: str) -> None:
    G = torch.randn(260, 600)
    with kernels.force_path(path):  # type: ignore[arg-type]
        fast = newton_schulz(G, steps=2)
    with kernels.force_matmul():
        plain = newton_schulz(G, steps=2)
    assert (fast - plain).abs().max().item() < 1e-4
