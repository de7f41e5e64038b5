"""Scion: norm-constrained updates by linear minimisation oracles, one norm per layer type
(Pethick et al. 2025, "Training deep learning models with norm-constrained LMOs",
arXiv:2502.07529; the official code LIONS-EPFL/scion `scion.py`).

Per parameter W with gradient G, one step (Scion's momentum form, written with β = 1 − α)::

    M ← β·M + (1−β)·G
    W ← (1 − lr)·W − lr·ρ·lmo(M)        (constrained; unconstrained: W ← W − lr·ρ·lmo(M))

`lmo` by the parameter's norm (`norms` maps parameter names to one; matrices default to
"spectral", vectors to "bias_rms"), each as the official code's `Norm` classes:

    spectral    √(d_out/d_in)·orthogonalize(M)       hidden matrices (Newton-Schulz, batched)
    sign        sign(M) / d_in                        output heads
    colnorm     each column of M to RMS 1             input layers
    embedding   each row of M to RMS 1                nn.Embedding weights [vocab, dim]
                                                      (the official ColNorm with transpose)
    bias_rms    M / RMS(M)                            biases, norms' gains

Defaults: lr 1e-3 and radius ρ 1 (`Scion.__init__` of the official code), momentum 0.9 (its
README's α = 0.1, "a good default"; the class default α = 1 keeps no average), constrained.
The constrained form is decoupled weight decay with wd = 1 (`weight_decay` None, the
default: 1 when constrained, else 0; a number replaces it). Every LMO runs on the whole
matrix on its owner; the momentum is elementwise.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any, ClassVar, Literal, get_args

import torch
from torch import Tensor

from orthoptim._validate import check_choice, check_positive
from orthoptim.optim.contract import Directions, Group, Prepared, StateKind
from orthoptim.optim.muon import Muon
from orthoptim.optim.state import base_name

ScionNorm = Literal["spectral", "sign", "colnorm", "embedding", "bias_rms"]
NORMS: tuple[ScionNorm, ...] = get_args(ScionNorm)


def lmo(m: Tensor, norm: ScionNorm, eps: float) -> Tensor:
    """The non-spectral linear minimisation oracles of Scion, on a whole tensor `m`."""
    if norm == "bias_rms":
        return m / (m.square().mean().sqrt() + eps)
    if norm == "sign":
        return torch.sign(m) / m.shape[-1]
    if norm == "colnorm":
        rms = torch.linalg.vector_norm(m, dim=-2, keepdim=True) / m.shape[-2] ** 0.5
        return m / (rms + eps)
    if norm == "embedding":
        rms = torch.linalg.vector_norm(m, dim=-1, keepdim=True) / m.shape[-1] ** 0.5
        return m / (rms + eps)
    raise ValueError(f"Scion norm must be one of {NORMS}, got {norm!r}")


class Scion(Muon):
    """Scion for matrices (spectral LMO, as Muon: 2-D, 3-D experts, conv weights; `split`)
    and, through `norms`, for heads, embeddings and vectors.

    `radius`: ρ, the norm ball's radius; `constrained`: W ← (1 − lr)·W − lr·ρ·lmo(M), else W ← W −
    lr·ρ·lmo(M) (`weight_decay`, when given, replaces the 1 or 0); `norms`: {parameter name: one of
    `NORMS`}; `eps`: the guard of the non-spectral LMOs' divisions (the official 1e-8). `options`
    are Muon's (`ns_steps`, `coefficients`, `ns_dtype`, `orthogonalizer`, `nonfinite`, `split`,
    `ns_batch_mb`), with Muon's defaults; Newton-Schulz's own `eps` stays Muon's.
    """

    state_kinds: ClassVar[dict[str, StateKind]] = Muon.state_kinds
    matrices_only = False

    def __init__(
        self,
        params: Iterable[Any],
        lr: float = 1e-3,
        momentum: float = 0.9,
        radius: float = 1.0,
        constrained: bool = True,
        weight_decay: float | None = None,
        norms: dict[str, ScionNorm] | None = None,
        nesterov: bool = False,
        eps: float = 1e-8,
        **options: Any,
    ) -> None:
        check_positive("radius", radius)
        check_positive("eps", eps)
        for name, norm in (norms or {}).items():
            check_choice(f"norms[{name!r}]", norm, NORMS)
        if weight_decay is None:
            weight_decay = 1.0 if constrained else 0.0
        super().__init__(
            params, lr=lr, momentum=momentum, nesterov=nesterov, weight_decay=weight_decay,
            lr_scale="unit_rms_norm", **options,  # the spectral LMO's √(d_out/d_in)
        )  # fmt: skip
        self.add_defaults(radius=radius, norms=dict(norms or {}), moment_eps=eps)

    def norm_of(self, group: dict[str, Any], name: str, ndim: int) -> ScionNorm:
        """The norm of parameter `name`: as `norms` says, else by its number of dims."""
        return group["norms"].get(base_name(name), "spectral" if ndim >= 2 else "bias_rms")

    def lr_scale_factors(
        self, shape: Sequence[int], group: dict[str, Any], name: str
    ) -> tuple[float, ...]:
        """Muon's for a parameter under the spectral norm; 1 for the others (not scaled)."""
        if self.norm_of(group, name, len(shape)) != "spectral":
            return (1.0,)
        return super().lr_scale_factors(shape, group, name)

    def oriented_directions(
        self, items: Prepared, group: Group, names: Sequence[str]
    ) -> Directions:
        """ρ·lmo(M) per parameter; the spectral ones orthogonalized in shape batches."""
        norms = [self.norm_of(group, n, u.ndim) for (u, _), n in zip(items, names)]
        spectral = [i for i, norm in enumerate(norms) if norm == "spectral"]
        ortho = self.orthogonalized(
            [items[i][0] for i in spectral], group, [names[i] for i in spectral], "unit_rms_norm"
        )
        out: list[Tensor | None] = [None] * len(items)
        for i, o in zip(spectral, ortho):
            out[i] = o
        for i, norm in enumerate(norms):
            if norm != "spectral":
                out[i] = lmo(items[i][0], norm, group["moment_eps"])
        radius = group["radius"]
        if radius == 1.0:
            return out
        # the non-spectral LMOs' results are fresh; the spectral ones as `owns_results` says
        own = [self.owns_results() or norm != "spectral" for norm in norms]
        return [d.mul_(radius) if o else d * radius for d, o in zip(out, own)]  # type: ignore[union-attr]
