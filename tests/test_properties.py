"""Property-based tests (hypothesis) over shapes, dtypes, scales, conditioning and coefficient
sets: `newton_schulz` and one Muon step give finite output in the input's shape and dtype,
and singular values inside the coefficient set's documented band where the band is defined
(input singular values ≥ 0.01·σ_max), never above it.
"""

import pytest
import torch

from orthoptim import Muon, newton_schulz
from orthoptim.newton_schulz import SINGULAR_VALUE_BANDS
from orthoptim.optim.muon import lr_scale_factor

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

SETS = sorted(SINGULAR_VALUE_BANDS)
DTYPES = [torch.float32, torch.float64, torch.bfloat16, torch.float16]
# rounding of the output into its dtype, on top of the band
ROUNDING = {torch.float32: 1e-4, torch.float64: 1e-6, torch.bfloat16: 2e-2, torch.float16: 2e-3}


def conditioned(batch, m, n, cond_exp, scale_exp, seed):
    """float64 [batch, m, n] matrices with log-spaced singular values 1 … 10^-cond_exp,
    times 2^scale_exp; returns them and their singular values."""
    g = torch.Generator().manual_seed(seed)
    k = min(m, n)
    U, _ = torch.linalg.qr(torch.randn(batch, m, k, dtype=torch.float64, generator=g))
    V, _ = torch.linalg.qr(torch.randn(batch, n, k, dtype=torch.float64, generator=g))
    s = torch.logspace(0, -cond_exp, k, dtype=torch.float64)
    return (U * s) @ V.mT * 2.0**scale_exp, s


def check_band(out, s_in, coefficients, dtype):
    low, high = SINGULAR_VALUE_BANDS[coefficients]
    tol = ROUNDING[dtype]
    assert torch.isfinite(out).all()
    sv = torch.linalg.svdvals(out.to(torch.float64))
    assert sv.max() <= high + tol, (sv.max().item(), high)
    defined = s_in >= 0.01 * s_in.max()
    # svdvals sorts descending, as s_in is
    assert (sv[..., defined] >= low - tol).all(), (sv[..., defined].min().item(), low)


shapes = dict(
    batch=st.integers(1, 3),
    m=st.integers(1, 24),
    n=st.integers(1, 24),
    cond_exp=st.floats(0.0, 3.0),
    scale_exp=st.integers(-10, 20),
    coefficients=st.sampled_from(SETS),
    dtype=st.sampled_from(DTYPES),
    seed=st.integers(0, 2**16),
)


@settings(max_examples=30, deadline=None)
@given(**shapes)
def test_newton_schulz_properties(batch, m, n, cond_exp, scale_exp, coefficients, dtype, seed):
    X, s = conditioned(batch, m, n, cond_exp, scale_exp, seed)
    X = X.to(dtype)
    if dtype in (torch.float16,) and not torch.isfinite(X).all():
        return  # 2^20 overflows fp16: not a representable input
    steps = 30 if coefficients == "cubic" else 5
    out = newton_schulz(X, steps=steps, coefficients=coefficients)
    assert out.shape == X.shape and out.dtype == X.dtype
    check_band(out, s, coefficients, dtype)


@settings(max_examples=20, deadline=None)
@given(**shapes, experts=st.booleans(), lr_scale=st.sampled_from(["keller", "spectral", "none"]))
def test_one_muon_step_properties(
    batch, m, n, cond_exp, scale_exp, coefficients, dtype, seed, experts, lr_scale
):
    """First step, no decay: the update divided by lr·scale is NS(G) (momentum and Nesterov
    only rescale G), so it lies in the band; the parameter keeps its dtype and stays finite."""
    G, s = conditioned(batch if experts else 1, m, n, cond_exp, scale_exp % 8, seed)
    shape = (batch, m, n) if experts else (m, n)
    p = torch.nn.Parameter(torch.zeros(shape, dtype=dtype))
    p.grad = G.reshape(shape).to(dtype)
    steps = 30 if coefficients == "cubic" else 5
    lr = 0.5
    opt = Muon([p], lr=lr, ns_steps=steps, coefficients=coefficients, lr_scale=lr_scale)
    opt.step()
    assert p.dtype == dtype and torch.isfinite(p).all()
    assert opt.state[p]["momentum_buffer"].dtype == (
        torch.float64 if dtype == torch.float64 else torch.float32
    )
    update = -p.detach().to(torch.float64) / (lr * lr_scale_factor(lr_scale, m, n))
    check_band(update.reshape(-1, m, n), s, coefficients, dtype)
