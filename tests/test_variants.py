"""NorMuon, AdaMuon, PolarGrad and Scion against independent float64 transcriptions of their
papers' algorithms (`reference_optimizers.py`, which imports nothing from orthoptim).

Both sides run in float64 with the same quintic Newton-Schulz (5 steps of Keller Jordan's
coefficients, orthoptim's "simple" set; the reference divides by the exact Frobenius norm,
orthoptim by max(norm, 1e-7), the same for any non-zero gradient): ours through orthoptim's
kernels, the reference through a plain loop. The two orders of
operations differ by ~1e-16 relative per product; five iterations amplify that by at most the
quintic's gain (a⁵ ≈ 480), and the normalisations add a few ulp, so 1e-11 relative is a
bound with margin that still catches any wrong formula (those differ at 1e-3 or more).
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import reference_optimizers as ref
from orthoptim import AdaMuon, Lion, NorMuon, PolarGrad, Scion, build_optimizer
from orthoptim.optim.scion import NORMS

TOL = 1e-11
STEPS = 4
NS = dict(coefficients="simple")  # Muon's (3.4445, -4.7750, 2.0315), as the reference


def ortho(x):
    return ref.newton_schulz_ref(x, eps=0.0)


def trajectory(make, shape, steps=STEPS, seed=0, name="w"):
    """(our weights after each step, W0, grads) for one float64 parameter."""
    g = torch.Generator().manual_seed(seed)
    w0 = torch.randn(*shape, generator=g, dtype=torch.float64)
    grads = [torch.randn(*shape, generator=g, dtype=torch.float64) for _ in range(steps)]
    p = nn.Parameter(w0.clone())
    opt = make([(name, p)])
    out = []
    for grad in grads:
        p.grad = grad.clone()
        opt.step()
        out.append(p.detach().clone())
    return out, w0, grads


def assert_same(got, want, tol=TOL):
    assert len(got) == len(want)
    for i, (a, b) in enumerate(zip(got, want)):
        scale = b.abs().max().item()
        err = (a - b).abs().max().item()
        assert err <= tol * scale, f"step {i + 1}: max error {err:.3e} (scale {scale:.3e})"


@pytest.mark.parametrize("shape", [(6, 10), (10, 6)])
@pytest.mark.parametrize("nesterov", [True, False])
def test_normuon_matches_reference(shape, nesterov):
    kw = dict(lr=0.05, momentum=0.9, beta2=0.8, weight_decay=0.1, nesterov=nesterov)
    got, w0, grads = trajectory(lambda p: NorMuon(p, eps=1e-10, **kw, **NS), shape)
    assert_same(got, ref.normuon_ref(w0, grads, eps=1e-10, **kw, orthogonalize=ortho))


def test_normuon_defaults_are_the_official_codes():
    got, w0, grads = trajectory(lambda p: NorMuon(p, **NS), (8, 5))
    assert_same(got, ref.normuon_ref(w0, grads, orthogonalize=ortho))
    g = NorMuon([nn.Parameter(torch.zeros(2, 2))]).param_groups[0]
    assert (g["lr"], g["momentum"], g["beta2"], g["moment_eps"]) == (0.02, 0.95, 0.95, 1e-10)
    assert (g["weight_decay"], g["nesterov"], g["lr_scale"]) == (0.0, True, "keller")


@pytest.mark.parametrize("shape", [(6, 10), (10, 6)])
@pytest.mark.parametrize("beta2", [None, 0.99])
def test_adamuon_matches_reference(shape, beta2):
    kw = dict(lr=0.03, momentum=0.9, beta2=beta2, weight_decay=0.05, rms=0.3)
    got, w0, grads = trajectory(lambda p: AdaMuon(p, **kw, **NS), shape)
    assert_same(got, ref.adamuon_ref(w0, grads, **kw, orthogonalize=ortho))


def test_adamuon_defaults_and_sign_step():
    got, w0, grads = trajectory(lambda p: AdaMuon(p, **NS), (7, 9))
    assert_same(got, ref.adamuon_ref(w0, grads, orthogonalize=ortho))
    # without the sign the reference ends elsewhere: the sign step is really taken
    with pytest.raises(AssertionError):
        assert_same(got, ref.adamuon_ref(w0, grads, sign=False, orthogonalize=ortho))
    g = AdaMuon([nn.Parameter(torch.zeros(2, 2))]).param_groups[0]
    assert (g["lr"], g["momentum"], g["beta2"], g["moment_eps"], g["rms"]) == (
        0.02, 0.95, None, 1e-8, 0.2,
    )  # fmt: skip
    assert (g["weight_decay"], g["nesterov"]) == (0.01, True)


@pytest.mark.parametrize("nesterov", [False, True])
def test_polargrad_matches_reference(nesterov):
    kw = dict(lr=0.01, momentum=0.8, weight_decay=0.02, nesterov=nesterov)
    got, w0, grads = trajectory(lambda p: PolarGrad(p, **kw, **NS), (9, 4))
    assert_same(got, ref.polargrad_ref(w0, grads, **kw, orthogonalize=ortho))
    got, w0, grads = trajectory(lambda p: PolarGrad(p, **NS), (4, 9))
    assert_same(got, ref.polargrad_ref(w0, grads, orthogonalize=ortho))


def test_polargrad_scales_by_the_nuclear_norm():
    """With the exact polar factor, ⟨M, U⟩ is the sum of M's singular values."""
    m = torch.randn(5, 8, dtype=torch.float64)
    u = ref.polar(m)
    torch.testing.assert_close((m * u).sum(), torch.linalg.svdvals(m).sum(), rtol=1e-12, atol=0)


@pytest.mark.parametrize("constrained", [True, False])
@pytest.mark.parametrize("shape", [(6, 10), (10, 6)])
def test_scion_spectral_matches_reference(constrained, shape):
    got, w0, grads = trajectory(
        lambda p: Scion(p, lr=0.05, momentum=0.7, radius=3.0, constrained=constrained, **NS),
        shape,
    )
    want = ref.scion_ref(
        w0,
        grads,
        lr=0.05,
        momentum=0.3,
        radius=3.0,
        unconstrained=not constrained,
        orthogonalize=ortho,
    )
    assert_same(got, want)


@pytest.mark.parametrize("norm", [n for n in NORMS if n != "spectral"])
def test_scion_layer_norms_match_reference(norm):
    shape = (5,) if norm == "bias_rms" else (7, 4)
    got, w0, grads = trajectory(lambda p: Scion(p, lr=0.1, norms={"w": norm}), shape)
    lmo = {"embedding": dict(norm="colnorm", transpose=True)}.get(norm, dict(norm=norm))
    assert_same(got, ref.scion_ref(w0, grads, lr=0.1, momentum=0.1, **lmo))


def test_scion_refuses_an_unknown_norm_naming_it():
    with pytest.raises(ValueError, match=r"norms\['w'\].*spectral"):
        Scion([("w", nn.Parameter(torch.zeros(2, 2)))], norms={"w": "frobenius"})


@pytest.mark.parametrize("name", ["normuon", "adamuon", "polargrad", "scion"])
def test_variants_batch_experts_and_split_like_muon(name):
    """A 3-D expert weight steps as its experts one by one; a split fused matrix as its
    blocks (each block orthogonalized on its own)."""
    torch.manual_seed(0)
    experts = nn.Parameter(torch.randn(3, 6, 4, dtype=torch.float64))
    apart = [nn.Parameter(experts.detach()[e].clone()) for e in range(3)]
    build = {"normuon": NorMuon, "adamuon": AdaMuon, "polargrad": PolarGrad, "scion": Scion}[name]
    one = build([("e", experts)])
    many = [build([(f"e{e}", q)]) for e, q in enumerate(apart)]
    for _ in range(3):
        g = torch.randn(3, 6, 4, dtype=torch.float64)
        experts.grad = g.clone()
        one.step()
        for e, (q, o) in enumerate(zip(apart, many)):
            q.grad = g[e].clone()
            o.step()
    for e, q in enumerate(apart):
        torch.testing.assert_close(experts.detach()[e], q.detach(), rtol=1e-12, atol=1e-14)


@pytest.mark.parametrize("name", ["normuon", "adamuon", "polargrad", "scion"])
def test_build_optimizer_routes_matrices_to_each_variant(name):
    model = nn.Sequential(nn.Embedding(10, 8), nn.Linear(8, 8), nn.LayerNorm(8))
    opt = build_optimizer(model, optimizer=name)
    assert [g["optimizer"] for g in opt.param_groups] == [name, "adamw"]
    assert opt.param_groups[0]["param_names"] == ["1.weight"]


@pytest.mark.parametrize("shape", [(5,), (6, 4)])
def test_lion_matches_reference(shape):
    kw = dict(lr=0.01, betas=(0.8, 0.95), weight_decay=0.3)
    got, w0, grads = trajectory(lambda p: Lion(p, **kw), shape)
    assert_same(got, ref.lion_ref(w0, grads, **kw))
    got, w0, grads = trajectory(Lion, shape, seed=1)
    assert_same(got, ref.lion_ref(w0, grads))


def test_lion_is_the_elementwise_part_of_build_optimizer():
    model = nn.Sequential(nn.Embedding(10, 8), nn.Linear(8, 8), nn.LayerNorm(8))
    opt = build_optimizer(model, optimizer="normuon", elementwise="lion", adamw_lr=1e-4)
    assert [g["optimizer"] for g in opt.param_groups] == ["normuon", "lion"]
    assert isinstance(opt.inner["lion"], Lion) and opt.param_groups[1]["lr"] == 1e-4
    with pytest.raises(ValueError, match="elementwise.*'adamw', 'lion'"):
        build_optimizer(model, elementwise="sgd")


@pytest.mark.parametrize("build", [NorMuon, AdaMuon, PolarGrad, Scion])
def test_variants_take_muons_options_and_refuse_unknown_ones(build):
    p = [("w", nn.Parameter(torch.zeros(4, 3)))]
    g = build(p, ns_steps=3, coefficients="simple", nonfinite="skip").param_groups[0]
    assert (g["ns_steps"], g["coefficients"]) == (3, "simple")
    with pytest.raises(TypeError, match="ns_step"):
        build(p, ns_step=3)
    with pytest.raises(ValueError, match="ns_dtype"):
        build(p, ns_dtype="fp8")
