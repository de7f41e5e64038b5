"""Independent float64 transcriptions ("oracles") of NorMuon, AdaMuon, PolarGrad, Scion and Lion.

Each reference follows the authors' published code (pinned commits in /tmp/ref/SPEC.md) and is
written from scratch here, with no import from orthoptim, so that tests can compare the library
against it. Every matrix reference takes ``orthogonalize=`` (default ``newton_schulz_ref``); pass
``polar`` for the exact polar factor. All functions return the list of weights after each step.

Source keys used in the comments:
  [NM]   zichongli5/NorMuon normuon.py @ d45c9a4280d7 (official NorMuon code)
  [NM-p] Li et al. 2025, "NorMuon", arXiv:2510.05491, Algorithm 1
  [MNG]  KellerJordan/modded-nanogpt train_gpt.py @ f411b3d346aa
  [AM]   Chongjie-Si/AdaMuon gpt2/models/optimizers/adamuon.py @ 369f0b3bd9d9 (official)
  [AM-p] Si et al. 2025, "AdaMuon", arXiv:2507.11005, Algorithm 1 (src/algorithm.png in [AM])
  [PG]   timlautk/polargrad polar_grad.py @ 79f3c6fc67c8 (official PolarGrad code)
  [SC]   LIONS-EPFL/scion scion.py and README.md @ f58a393e0103 (official Scion code)
  [EO]   NVIDIA-NeMo/Emerging-Optimizers @ fd7729267109
  [LN]   google/automl lion/lion_pytorch.py @ 6a54c8741e7c (official Lion code)
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Literal

import torch

Tensor = torch.Tensor
Orthogonalize = Callable[[Tensor], Tensor]

# Muon's quintic Newton-Schulz coefficients ([NM] l.16, [AM] l.9, [SC] scion.py l.420).
QUINTIC = (3.4445, -4.7750, 2.0315)


def polar(X: Tensor) -> Tensor:
    """Exact polar factor U @ Vh of X (reduced SVD, float64)."""
    U, _, Vh = torch.linalg.svd(X.double(), full_matrices=False)
    return U @ Vh


def newton_schulz_ref(
    X: Tensor, steps: int = 5, coeffs: tuple[float, float, float] = QUINTIC, eps: float = 1e-7
) -> Tensor:
    """Plain float64 quintic Newton-Schulz as in Muon: normalise by ||X||_F + eps, iterate on the
    wide orientation X <- aX + (bA + cA^2)X with A = X X^T, and transpose back."""
    a, b, c = coeffs
    X = X.double()
    tall = X.size(-2) > X.size(-1)
    if tall:
        X = X.mT
    X = X / (torch.linalg.matrix_norm(X) + eps)
    for _ in range(steps):
        A = X @ X.mT
        X = a * X + (b * A + c * A @ A) @ X
    return X.mT if tall else X


def _check(W0: Tensor, grads: Sequence[Tensor], matrix: bool = True) -> None:
    if W0.dtype != torch.float64 or any(g.dtype != torch.float64 for g in grads):
        raise TypeError("references take float64 W0 and grads")
    if matrix and W0.ndim != 2:
        raise ValueError(f"expected a matrix parameter, got shape {tuple(W0.shape)}")


def normuon_ref(
    W0: Tensor,
    grads: Sequence[Tensor],
    lr: float = 0.02,  # [NM] l.60 (NorMuon.__init__)
    momentum: float = 0.95,  # [NM] l.60; [NM] l.35 beta=0.95
    beta2: float = 0.95,  # [NM] l.60
    eps: float = 1e-10,  # [NM] l.49 (1/(sqrt(v)+1e-10)) and l.52 (norm ratio guard)
    weight_decay: float = 0.0,  # [NM] l.60
    nesterov: bool = True,  # [NM] l.35
    stat_dim: Literal["row", "longer"] = "row",  # [NM] l.47/87: per row [m,1]; [MNG]/[EO]: longer
    scale_mode: Literal["shape", "adam_rms"] = "shape",  # [NM] l.52-54; "adam_rms" is [NM-p]
    rms: float = 0.2,  # [NM-p] Alg. 1: eta_hat = 0.2 * eta * sqrt(mn) / ||O_hat||_F
    orthogonalize: Orthogonalize = newton_schulz_ref,
) -> list[Tensor]:
    """NorMuon: Muon's orthogonalised (Nesterov) momentum, divided per neuron by the root of an EMA
    of that neuron's mean squared update, then rescaled.

    scale_mode="shape" ([NM]): keep ||O||_F, then multiply by max(1, m/n)^0.5.
    scale_mode="adam_rms" ([NM-p]): multiply by rms * sqrt(mn) / ||O_hat||_F (update RMS = rms).
    stat_dim="row": v has shape [m, 1] ([NM]); "longer": [m, 1] if m >= n else [1, n] ([MNG], [EO]).
    """
    _check(W0, grads)
    m, n = W0.shape
    reduce_dim = -1 if stat_dim == "row" or m >= n else -2
    W = W0.clone()
    M = torch.zeros_like(W)
    v = torch.zeros_like(W).mean(dim=reduce_dim, keepdim=True)  # [m, 1] or [1, n]
    out = []
    for G in grads:
        M = momentum * M + (1 - momentum) * G
        U = (1 - momentum) * G + momentum * M if nesterov else M
        O = orthogonalize(U)
        v = beta2 * v + (1 - beta2) * (O * O).mean(dim=reduce_dim, keepdim=True)
        O_hat = O / (v.sqrt() + eps)
        if scale_mode == "shape":
            update = O_hat * (O.norm() / (O_hat.norm() + eps)) * max(1.0, m / n) ** 0.5
        else:
            update = O_hat * (rms * math.sqrt(m * n) / O_hat.norm())
        W = W * (1 - lr * weight_decay) - lr * update
        out.append(W)
    return out


def adamuon_ref(
    W0: Tensor,
    grads: Sequence[Tensor],
    lr: float = 0.02,  # [AM] l.26
    momentum: float = 0.95,  # [AM] l.26; [AM-p] Alg. 1 one beta for both moments
    beta2: float | None = None,  # None: equal to momentum ([AM] l.85, [AM-p] Alg. 1)
    eps: float = 1e-8,  # [AM] l.26
    weight_decay: float = 0.01,  # [AM] l.26
    nesterov: bool = True,  # [AM] l.26 (the paper's Alg. 1 has no Nesterov)
    sign: bool = True,  # [AM] l.79, [AM-p] Alg. 1 "sign-stabilized"
    rms: float = 0.2,  # [AM] l.88, [AM-p] Alg. 1 gamma_t = 0.2 sqrt(mn) / ||O_hat||_F
    orthogonalize: Orthogonalize = newton_schulz_ref,
) -> list[Tensor]:
    """AdaMuon: orthogonalise sign(momentum), divide elementwise by the root of an EMA of the
    squared orthogonal update, rescale to RMS ``rms``, decoupled weight decay."""
    _check(W0, grads)
    m, n = W0.shape
    beta2 = momentum if beta2 is None else beta2
    W = W0.clone()
    M = torch.zeros_like(W)
    V = torch.zeros_like(W)
    out = []
    for G in grads:
        M = momentum * M + (1 - momentum) * G
        U = (1 - momentum) * G + momentum * M if nesterov else M
        O = orthogonalize(torch.sign(U) if sign else U)
        V = beta2 * V + (1 - beta2) * O * O
        O_hat = O / (V.sqrt() + eps)
        update = O_hat * (rms * math.sqrt(m * n) / (O_hat.norm() + eps))
        W = W * (1 - lr * weight_decay) - lr * update
        out.append(W)
    return out


def polargrad_ref(
    W0: Tensor,
    grads: Sequence[Tensor],
    lr: float = 0.02,  # [PG] l.20
    momentum: float = 0.95,  # [PG] l.20
    weight_decay: float = 0.0,  # [PG] l.20
    polar_first: bool = False,  # [PG] l.20
    nesterov: bool = False,  # [EO] polargrad.py l.72 ([PG] has no Nesterov)
    orthogonalize: Orthogonalize = newton_schulz_ref,
) -> list[Tensor]:
    """PolarGrad: polar factor of the momentum scaled by its nuclear norm <M, polar(M)>.

    polar_first=True ([PG] l.36-40): polar-decompose the gradient, average the polar factors,
    and scale the average by <G, polar(G)>.
    """
    _check(W0, grads)
    W = W0.clone()
    M = torch.zeros_like(W)
    out = []
    for G in grads:
        if polar_first:
            U = orthogonalize(G)
            nuclear = (G * U).sum()
            M = momentum * M + (1 - momentum) * U
            update = nuclear * M
        else:
            M = momentum * M + (1 - momentum) * G
            X = (1 - momentum) * G + momentum * M if nesterov else M
            U = orthogonalize(X)
            update = (X * U).sum() * U
        W = W * (1 - lr * weight_decay) - lr * update
        out.append(W)
    return out


ScionNorm = Literal[
    "spectral", "spectral_max", "spectral_unnormalized", "sign", "colnorm", "rownorm", "bias_rms"
]


def scion_lmo(
    M: Tensor,
    norm: ScionNorm,
    orthogonalize: Orthogonalize = newton_schulz_ref,
    normalized: bool | None = None,
    transpose: bool = False,
    eps: float = 1e-8,  # [SC] scion.py l.32, l.72, l.99
) -> Tensor:
    """The direction D with W <- (1 - lr) W - lr * radius * D, per [SC] scion.py's Norm classes.

    normalized=None takes [SC]'s class default (Sign: True, ColNorm: False, RowNorm: True).
    transpose=True treats a (vocab, dim) embedding as (dim, vocab) for ColNorm/RowNorm.
    """
    if norm == "bias_rms":  # [SC] l.97-102: vector / its RMS
        return M / ((M * M).mean(dim=0, keepdim=True).sqrt() + eps)
    d_out, d_in = M.shape
    if norm.startswith("spectral"):  # [SC] l.139-157
        scale = {
            "spectral": (d_out / d_in) ** 0.5,
            "spectral_max": max(1.0, (d_out / d_in) ** 0.5),
            "spectral_unnormalized": d_out**0.5,
        }[norm]
        return orthogonalize(M) * scale
    if norm == "sign":  # [SC] l.176-186
        return torch.sign(M) / d_in if normalized in (None, True) else torch.sign(M)
    X = M.mT if transpose else M
    rows, cols = X.shape
    if norm == "colnorm":  # [SC] l.31-41: each column to RMS 1 (or 1/cols when normalized)
        rms_col = X.norm(dim=0, keepdim=True) / math.sqrt(rows)
        D = X / (rms_col * (cols if normalized else 1) + eps)
    elif norm == "rownorm":  # [SC] l.71-81: each row to norm 1/sqrt(cols) (1 when not normalized)
        row = X.norm(dim=-1, keepdim=True)
        D = X / (row * (math.sqrt(cols) if normalized in (None, True) else 1) + eps)
    else:
        raise ValueError(f"unknown Scion norm {norm!r}")
    return D.mT if transpose else D


def scion_ref(
    W0: Tensor,
    grads: Sequence[Tensor],
    lr: float = 1e-3,  # [SC] scion.py l.258
    momentum: float = 0.1,  # [SC] README "A good default is 0.1" (class default 1.0 = no averaging)
    radius: float = 1.0,  # [SC] l.258 `scale`
    norm: ScionNorm = "spectral",  # [SC] Auto -> Spectral for 2-D (l.200-205)
    unconstrained: bool = False,  # [SC] l.258
    orthogonalize: Orthogonalize = newton_schulz_ref,
    **lmo_kwargs: object,
) -> list[Tensor]:
    """Scion (Pethick et al. 2025): M <- (1 - a) M + a G (``momentum`` is a = 1 - usual beta);
    W <- (1 - lr) W - lr * radius * lmo(M), without the (1 - lr) shrink when unconstrained."""
    _check(W0, grads, matrix=norm != "bias_rms")
    W = W0.clone()
    M = torch.zeros_like(W)
    out = []
    for G in grads:
        M = (1 - momentum) * M + momentum * G if momentum != 1 else G
        D = scion_lmo(M, norm, orthogonalize, **lmo_kwargs)  # type: ignore[arg-type]
        if not unconstrained:
            W = W * (1 - lr)
        W = W - lr * radius * D
        out.append(W)
    return out


def lion_ref(
    W0: Tensor,
    grads: Sequence[Tensor],
    lr: float = 1e-4,  # [LN] l.23
    betas: tuple[float, float] = (0.9, 0.99),  # [LN] l.23
    weight_decay: float = 0.0,  # [LN] l.23
) -> list[Tensor]:
    """Lion (Chen et al. 2023), elementwise for any shape: decay, step by sign of the beta1
    interpolation, then update the momentum with beta2."""
    _check(W0, grads, matrix=False)
    beta1, beta2 = betas
    W = W0.clone()
    m = torch.zeros_like(W)
    out = []
    for G in grads:
        W = W * (1 - lr * weight_decay)
        W = W - lr * torch.sign(beta1 * m + (1 - beta1) * G)
        m = beta2 * m + (1 - beta2) * G
        out.append(W)
    return out
