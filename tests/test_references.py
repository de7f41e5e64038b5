"""Sanity checks of the float64 reference optimizers themselves (tests/reference_optimizers.py).

The 2x2 cases use G = R @ diag(5, 10) with the rotation R = [[0.6, -0.8], [0.8, 0.6]], so that
polar(G) = R, sign(G) = S = [[1, -1], [1, 1]] and polar(S) = S / sqrt(2); every expected weight
below is worked out by hand from the update rules in /tmp/ref/SPEC.md.
"""

import pytest
import torch

from reference_optimizers import (
    QUINTIC,
    adamuon_ref,
    lion_ref,
    newton_schulz_ref,
    normuon_ref,
    polar,
    polargrad_ref,
    scion_lmo,
    scion_ref,
)

from conftest import ill_conditioned

D = torch.float64
R = torch.tensor([[0.6, -0.8], [0.8, 0.6]], dtype=D)
G = torch.tensor([[3.0, -8.0], [4.0, 6.0]], dtype=D)  # R @ diag(5, 10)
S = torch.tensor([[1.0, -1.0], [1.0, 1.0]], dtype=D)
W0 = torch.tensor([[1.0, -1.0], [0.5, 2.0]], dtype=D)
G2 = -0.7 * G  # a second step that flips Nesterov's input but not the plain momentum's


def close(actual: torch.Tensor, expected: list[list[float]], atol: float = 1e-9) -> None:
    torch.testing.assert_close(actual, torch.tensor(expected, dtype=D), rtol=0, atol=atol)


def test_polar_is_orthogonal_factor():
    X = torch.randn(7, 4, dtype=D)
    U = polar(X)
    torch.testing.assert_close(U.mT @ U, torch.eye(4, dtype=D))
    H = U.mT @ X  # the symmetric positive factor
    torch.testing.assert_close(H, H.mT)
    assert torch.linalg.eigvalsh(H).min() > 0
    torch.testing.assert_close(polar(G), R)


@pytest.mark.parametrize("shape", [(64, 32), (32, 64), (24, 24)])
def test_newton_schulz_is_the_quintic_on_singular_values(shape):
    X, _, _, s = ill_conditioned(*shape, cond=50.0)
    Y = newton_schulz_ref(X)
    x = s / (s.square().sum().sqrt() + 1e-7)
    a, b, c = QUINTIC
    for _ in range(5):
        x = a * x + b * x**3 + c * x**5
    torch.testing.assert_close(torch.linalg.svdvals(Y), x.sort(descending=True).values)
    torch.testing.assert_close(polar(Y), polar(X))  # same singular vectors as X
    assert x.min() >= 0.68 and x.max() <= 1.14  # the band of 5 quintic steps on [0.01, 1]


def test_newton_schulz_misses_the_band_with_too_few_steps():
    X, _, _, _ = ill_conditioned(64, 32, cond=50.0)
    assert torch.linalg.svdvals(newton_schulz_ref(X, steps=2)).min() < 0.68


def test_lion_steps_are_signs_plus_decay():
    W = torch.randn(5, 3, dtype=D)
    grads = [torch.randn(5, 3, dtype=D) for _ in range(4)]
    grads[1][0, 0] = 0.0  # with a zero state, the first interpolation at [0, 0] is nonzero
    lr, wd = 0.01, 0.3
    prev = W
    for W_next in lion_ref(W, grads, lr=lr, weight_decay=wd):
        step = (prev * (1 - lr * wd) - W_next) / lr
        assert torch.all((step - step.round()).abs() < 1e-9)
        assert set(step.round().unique().tolist()) <= {-1.0, 0.0, 1.0}
        prev = W_next
    assert lion_ref(torch.zeros(3, dtype=D), [torch.zeros(3, dtype=D)])[0].abs().max() == 0


def test_lion_two_steps_by_hand():
    G2 = torch.tensor([[-1.0, 1.0], [0.0, -1.0]], dtype=D)
    W1, W2 = lion_ref(W0, [G, G2], lr=0.1, weight_decay=0.5)
    close(W1, [[0.85, -0.85], [0.375, 1.8]])  # 0.95 W0 - 0.1 S
    # m1 = 0.01 G; 0.9 m1 + 0.1 G2 = [[-.073, .028], [.036, -.046]] -> signs [[-1, 1], [1, -1]]
    close(W2, [[0.9075, -0.9075], [0.25625, 1.81]])


def test_normuon_step_by_hand():
    (W1,) = normuon_ref(W0, [G], lr=0.1, weight_decay=0.5, orthogonalize=polar)
    close(W1, [[0.89, -0.87], [0.395, 1.84]])  # 0.95 W0 - 0.1 R (R's rows are balanced)
    # M2 = 0.0125 G, Nesterov 0.05 G2 + 0.95 M2 = -0.023125 G: W2 = 0.95 W1 + 0.1 R
    W2 = normuon_ref(W0, [G, G2], lr=0.1, weight_decay=0.5, orthogonalize=polar)[1]
    close(W2, [[0.9055, -0.9065], [0.45525, 1.808]])
    (W1,) = normuon_ref(W0, [G], lr=0.1, scale_mode="adam_rms", orthogonalize=polar)
    close(W1, (W0 - 0.1 * 0.2 * 2**0.5 * R).tolist())  # 0.2 sqrt(4) R / ||R||_F


@pytest.mark.parametrize("shape", [(12, 5), (5, 12)])
@pytest.mark.parametrize("orth", [polar, newton_schulz_ref])
def test_normuon_update_rms_and_neuron_balance(shape, orth):
    grads = [torch.randn(*shape, dtype=D) for _ in range(3)]
    m, n = shape
    Ws = normuon_ref(torch.zeros(*shape, dtype=D), grads, lr=1.0, scale_mode="adam_rms",
                     orthogonalize=orth)  # fmt: skip
    for prev, W in zip([torch.zeros(*shape, dtype=D), *Ws[:-1]], Ws):
        update = prev - W
        torch.testing.assert_close(update.square().mean().sqrt(), torch.tensor(0.2, dtype=D))
    # after one step v = (1 - beta2) mean_sq, so every neuron (row) of the update has equal norm
    (W1,) = normuon_ref(torch.zeros(*shape, dtype=D), grads[:1], lr=1.0, orthogonalize=orth)
    rows = W1.norm(dim=1)
    torch.testing.assert_close(rows, rows.mean().expand(m))
    # the official code keeps ||O||_F, times max(1, m/n)^0.5: sqrt(min(m, n)) for the polar factor
    if orth is polar:
        expected = min(m, n) ** 0.5 * max(1.0, m / n) ** 0.5
        torch.testing.assert_close(W1.norm(), torch.tensor(expected, dtype=D))
    (W1,) = normuon_ref(torch.zeros(*shape, dtype=D), grads[:1], lr=1.0, stat_dim="longer",
                        orthogonalize=orth)  # fmt: skip
    norms = W1.norm(dim=1 if m >= n else 0)
    torch.testing.assert_close(norms, norms.mean().expand(max(m, n)))


def test_adamuon_step_by_hand():
    (W1,) = adamuon_ref(W0, [G], lr=0.1, weight_decay=0.5, orthogonalize=polar)
    # sign -> S, polar(S) = S/sqrt(2), V = 0.05 * 0.5: O_hat is constant, rescaled to RMS 0.2
    close(W1, [[0.93, -0.93], [0.455, 1.88]], atol=1e-7)  # 0.95 W0 - 0.1 * 0.2 S
    # Nesterov input -0.023125 G -> sign -S; V stays uniform, so W2 = 0.95 W1 + 0.1 * 0.2 S
    W2 = adamuon_ref(W0, [G, G2], lr=0.1, weight_decay=0.5, orthogonalize=polar)[1]
    close(W2, [[0.9035, -0.9035], [0.45225, 1.806]], atol=1e-7)


def test_adamuon_sees_only_the_sign_of_the_momentum():
    grads = [torch.randn(4, 3, dtype=D) for _ in range(3)]
    scale = torch.rand(4, 3, dtype=D) + 0.5  # a fixed positive rescaling keeps sign(M_t)
    plain = adamuon_ref(W0.new_zeros(4, 3), grads)
    scaled = adamuon_ref(W0.new_zeros(4, 3), [g * scale for g in grads])
    torch.testing.assert_close(plain[-1], scaled[-1])
    unsigned = adamuon_ref(W0.new_zeros(4, 3), [g * scale for g in grads], sign=False)
    assert not torch.allclose(unsigned[-1], plain[-1], atol=1e-6)


def test_adamuon_update_rms_is_point_two():
    grads = [torch.randn(6, 9, dtype=D) for _ in range(3)]
    Ws = adamuon_ref(torch.zeros(6, 9, dtype=D), grads, lr=1.0, weight_decay=0.0)
    for prev, W in zip([torch.zeros(6, 9, dtype=D), *Ws[:-1]], Ws):
        torch.testing.assert_close((prev - W).square().mean().sqrt(), torch.tensor(0.2, dtype=D))


def test_polargrad_step_by_hand():
    (W1,) = polargrad_ref(W0, [G], lr=0.1, weight_decay=0.5, orthogonalize=polar)
    # M = 0.05 G, <M, R> = 0.05 * (5 + 10) = 0.75 (its nuclear norm)
    close(W1, [[0.905, -0.89], [0.415, 1.855]])  # 0.95 W0 - 0.1 * 0.75 R
    # M2 = 0.0475 G + 0.05 G2 = 0.0125 G, nuclear norm 0.1875: W2 = 0.95 W1 - 0.01875 R
    W2 = polargrad_ref(W0, [G, G2], lr=0.1, weight_decay=0.5, orthogonalize=polar)[1]
    close(W2, [[0.8485, -0.8305], [0.37925, 1.751]])
    (W1,) = polargrad_ref(W0, [G], lr=0.1, polar_first=True, orthogonalize=polar)
    close(W1, (W0 - 0.1 * 15 * 0.05 * R).tolist())  # ||G||_* * 0.05 R


def test_scion_steps_by_hand():
    def step(norm: str, **kw: object) -> torch.Tensor:
        return scion_ref(W0, [G], lr=0.1, momentum=0.1, radius=2.0, norm=norm,
                         orthogonalize=polar, **kw)[0]  # fmt: skip

    close(step("spectral"), [[0.78, -0.74], [0.29, 1.68]])  # 0.9 W0 - 0.2 R
    close(step("sign"), [[0.8, -0.8], [0.35, 1.7]])  # 0.9 W0 - 0.2 S / 2
    # column norms of M = 0.1 G are 0.5 and 1: each column to RMS 1 gives sqrt(2) R
    close(step("colnorm"), (0.9 * W0 - 0.2 * 2**0.5 * R).tolist(), atol=1e-7)
    close(step("spectral", unconstrained=True), (W0 - 0.2 * R).tolist())
    # M2 = 0.9 * 0.1 G + 0.1 * (-0.5 G) = 0.04 G: W2 = 0.9 W1 - 0.2 R = 0.81 W0 - 0.38 R
    W2 = scion_ref(W0, [G, -0.5 * G], lr=0.1, momentum=0.1, radius=2.0, orthogonalize=polar)[1]
    close(W2, [[0.582, -0.506], [0.101, 1.392]])


def test_scion_lmo_norms():
    M = torch.randn(6, 4, dtype=D)
    torch.testing.assert_close(torch.linalg.svdvals(scion_lmo(M, "spectral", polar)),
                               torch.full((4,), (6 / 4) ** 0.5, dtype=D))  # fmt: skip
    rows = scion_lmo(M, "rownorm").norm(dim=1)
    torch.testing.assert_close(rows, torch.full((6,), 4**-0.5, dtype=D))
    cols = scion_lmo(M, "colnorm").norm(dim=0)
    torch.testing.assert_close(cols, torch.full((4,), 6**0.5, dtype=D))
    emb = scion_lmo(M, "colnorm", transpose=True).norm(dim=1)  # (vocab, dim): each row to RMS 1
    torch.testing.assert_close(emb, torch.full((6,), 4**0.5, dtype=D))
    b = scion_lmo(torch.randn(5, dtype=D), "bias_rms")
    torch.testing.assert_close(b.square().mean(), torch.tensor(1.0, dtype=D))
