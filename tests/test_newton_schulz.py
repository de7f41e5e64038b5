import importlib

import pytest
import torch

from orthoptim.newton_schulz import (
    COEFFICIENT_SETS,
    SINGULAR_VALUE_BANDS,
    SINGULAR_VALUE_BANDS_BF16,
    coefficient_schedule,
    newton_schulz,
    polar_factor,
    resolve_ns_dtype,
)

from conftest import ill_conditioned

# the module itself: `orthoptim.newton_schulz` as an attribute is the function it exports
ns_module = importlib.import_module("orthoptim.newton_schulz")

SHAPES = [(64, 64), (48, 96), (96, 48), (128, 512)]


def _steps(name: str) -> int:
    return 30 if name == "cubic" else 5


@pytest.mark.parametrize("name", sorted(COEFFICIENT_SETS))
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("cond", [10.0, 1e3])
def test_singular_values_in_band_and_vectors_match_svd(name, shape, cond):
    X, U, V, s = ill_conditioned(*shape, cond=cond)
    out = newton_schulz(X.float(), steps=_steps(name), coefficients=name).double()
    # The output shares the input's singular vectors: Uᵀ·out·V is diagonal.
    D = U.T @ out @ V
    assert (D - torch.diag(torch.diagonal(D))).abs().max() < 1e-4
    f = torch.diagonal(D)
    low, high = SINGULAR_VALUE_BANDS[name]
    assert f.max() <= high
    assert f[s >= 0.01].min() >= low
    assert f.min() >= 0.0


@pytest.mark.parametrize("name", sorted(COEFFICIENT_SETS))
def test_random_gaussian_in_band(name):
    X = torch.randn(96, 256)
    out = newton_schulz(X, steps=_steps(name), coefficients=name)
    sv = torch.linalg.svdvals(out.double())
    low, high = SINGULAR_VALUE_BANDS[name]
    assert sv.max() <= high and sv.min() >= low


def test_cubic_converges_to_polar_factor():
    X, *_ = ill_conditioned(40, 70, cond=10.0)
    out = newton_schulz(X, steps=40, coefficients="cubic")
    assert out.dtype == torch.float64
    torch.testing.assert_close(out, polar_factor(X), atol=1e-9, rtol=0)


def test_batched_equals_per_slice():
    X = torch.randn(2, 3, 32, 80)
    out = newton_schulz(X)
    assert out.shape == X.shape
    for i in range(2):
        for j in range(3):
            torch.testing.assert_close(out[i, j], newton_schulz(X[i, j]), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("shape", [(3, 32, 80), (3, 80, 32), (2, 40, 130)])
def test_stacked_batch_equals_one_at_a_time(shape, monkeypatch):
    """The batch path GPUs take (all matrices at once, the last step written into the
    output, transposed for tall ones) against the CPU's one matrix at a time."""
    X = torch.randn(*shape)
    single = newton_schulz(X)
    monkeypatch.setattr(ns_module, "stacking_pays", lambda device: True)
    seen = []
    syrk_for = ns_module.kernels.syrk_for
    monkeypatch.setattr(
        ns_module.kernels, "syrk_for", lambda Z: seen.append(Z.shape) or syrk_for(Z)
    )
    stacked = newton_schulz(X)
    assert seen == [torch.Size([shape[0], min(shape[1:]), max(shape[1:])])]  # one stacked pass
    assert stacked.is_contiguous() and single.is_contiguous()
    torch.testing.assert_close(stacked, single, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(stacked[1], newton_schulz(X[1]), atol=1e-5, rtol=1e-5)


def test_tall_is_transpose_of_wide():
    X = torch.randn(100, 30)
    torch.testing.assert_close(
        newton_schulz(X), newton_schulz(X.T.contiguous()).T, atol=1e-5, rtol=1e-5
    )


def test_bf16_close_to_fp32():
    X = torch.randn(64, 128)
    ref = newton_schulz(X)
    low = newton_schulz(X, dtype=torch.bfloat16)
    assert low.dtype == torch.float32  # result comes back in the input's dtype
    rel = (low - ref).norm() / ref.norm()
    assert rel < 0.05
    # and the bf16 path really ran in bf16: it is not bit-identical to fp32
    assert rel > 0


@pytest.mark.parametrize("name", sorted(COEFFICIENT_SETS))
@pytest.mark.parametrize("shape", [(64, 128), (96, 48)])
@pytest.mark.parametrize("cond", [100.0, 1e3])
def test_bf16_singular_values_in_bf16_band(name, shape, cond):
    """bf16 Newton-Schulz (what "auto" runs on CUDA) keeps the output's singular values in
    SINGULAR_VALUE_BANDS_BF16: the float32 band widened by the margin bf16 rounding needs."""
    X, U, V, s = ill_conditioned(*shape, cond=cond)
    out = newton_schulz(X.float(), steps=_steps(name), coefficients=name, dtype=torch.bfloat16)
    assert out.dtype == torch.float32
    assert not torch.equal(out, newton_schulz(X.float(), steps=_steps(name), coefficients=name))
    out = out.double()
    low, high = SINGULAR_VALUE_BANDS_BF16[name]
    sv = torch.linalg.svdvals(out)
    assert sv.max() <= high
    if cond <= 100:  # every σ >= 0.01·σ_max: every output singular value in the band
        assert sv.min() >= low
    f = torch.diagonal(U.T @ out @ V)  # what the input's σ >= 0.01·σ_max map to
    assert f[s >= 0.01].min() >= low and f.max() <= high


def test_resolve_ns_dtype():
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    f32, f64, bf16, f16 = torch.float32, torch.float64, torch.bfloat16, torch.float16
    # "auto": bf16 on CUDA, float32 elsewhere; float64 input stays float64 everywhere
    assert resolve_ns_dtype("auto", cuda, f32) == bf16
    assert resolve_ns_dtype("auto", "cuda:1", bf16) == bf16
    assert resolve_ns_dtype("auto", cuda, f16) == bf16
    assert resolve_ns_dtype("auto", cuda, f64) == f64
    assert resolve_ns_dtype("auto", cpu, f32) == f32
    assert resolve_ns_dtype("auto", "cpu", bf16) == f32
    assert resolve_ns_dtype("auto", cpu, f64) == f64
    assert resolve_ns_dtype("auto", torch.device("meta"), f32) == f32
    # None: float32 on every device (float64 stays float64), as before "auto"
    assert resolve_ns_dtype(None, cuda, f32) == f32
    assert resolve_ns_dtype(None, cuda, bf16) == f32
    assert resolve_ns_dtype(None, cpu, f64) == f64
    # an explicit dtype wins, whatever the device and input
    assert resolve_ns_dtype(f32, cuda, f32) == f32
    assert resolve_ns_dtype(f32, cuda, f64) == f32
    assert resolve_ns_dtype(bf16, cpu, f32) == bf16
    with pytest.raises(ValueError, match="ns_dtype must be 'auto'.*got 'bf16'"):
        resolve_ns_dtype("bf16", cuda, f32)
    with pytest.raises(ValueError, match="dtype must be.*torch.int8"):
        resolve_ns_dtype(torch.int8, cuda, f32, name="dtype")


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_auto_on_cpu_is_the_float32_iteration_bitwise(dtype):
    """On CPU "auto" runs the very float32 iteration (float64 input: float64), so it equals
    the explicit dtype's result bit for bit, and None's."""
    X = torch.randn(3, 24, 40, dtype=torch.float64).to(dtype)
    auto = newton_schulz(X, dtype="auto")
    explicit = newton_schulz(X, dtype=torch.float64 if dtype == torch.float64 else torch.float32)
    assert auto.dtype == dtype
    assert torch.equal(auto, explicit)
    assert torch.equal(auto, newton_schulz(X))
    if dtype != torch.float64:  # and not the bf16 iteration
        assert not torch.equal(auto, newton_schulz(X, dtype=torch.bfloat16))


def test_dtype_preserved_and_default_compute_fp32():
    X = torch.randn(16, 24).to(torch.bfloat16)
    out = newton_schulz(X)
    assert out.dtype == torch.bfloat16
    ref = newton_schulz(X.float())
    torch.testing.assert_close(out.float(), ref, atol=2e-2, rtol=2e-2)


def test_zero_matrix_maps_to_zero():
    out = newton_schulz(torch.zeros(8, 12))
    assert torch.equal(out, torch.zeros(8, 12))


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_nonfinite_input_raises(bad):
    X = torch.randn(8, 8)
    X[3, 4] = bad
    with pytest.raises(ValueError, match="NaN or Inf"):
        newton_schulz(X)


@pytest.mark.parametrize("scale", [1e25, 1e-25])
def test_scale_invariant_where_the_norm_overflows_or_underflows(scale):
    X = torch.randn(3, 8, 12)
    # 1e25: the float32 sum of squares overflows; the norm is taken on a rescaled copy.
    # 1e-25: it underflows below eps, and eps rules (documented): the output shrinks.
    big = newton_schulz(X * scale)
    assert torch.isfinite(big).all()
    if scale > 1:
        assert torch.allclose(big, newton_schulz(X), atol=1e-6)
    else:
        assert big.abs().max() < 1e-6


def test_schedule_resolution():
    assert coefficient_schedule("simple", 3) == [(3.4445, -4.7750, 2.0315)] * 3
    q = coefficient_schedule("quintic", 7)
    assert q[0] == (4.0848, -6.8946, 2.9270) and q[5] == q[6] == q[4]
    pe = coefficient_schedule("polar_express", 10)
    assert pe[-1] == (1.875, -1.25, 0.375) and pe[0][0] == pytest.approx(8.28721201814563 / 1.01)
    assert coefficient_schedule([(1.5, -0.5, 0.0)], 2) == [(1.5, -0.5, 0.0)] * 2
    with pytest.raises(ValueError, match="unknown coefficient set"):
        coefficient_schedule("nope", 5)
    with pytest.raises(ValueError, match="triple"):
        coefficient_schedule([(1.0, 2.0)], 5)
    with pytest.raises(ValueError, match="steps"):
        coefficient_schedule("simple", 0)


def test_user_coefficients_match_named():
    X = torch.randn(20, 30)
    torch.testing.assert_close(
        newton_schulz(X, coefficients=COEFFICIENT_SETS["quintic"]),
        newton_schulz(X, coefficients="quintic"),
    )


def test_polar_factor_is_orthogonal_and_handles_zero():
    X = torch.randn(10, 20)
    P = polar_factor(X)
    torch.testing.assert_close(P @ P.T, torch.eye(10, dtype=torch.float64), atol=1e-10, rtol=0)
    assert torch.equal(polar_factor(torch.zeros(3, 4)), torch.zeros(3, 4, dtype=torch.float64))
