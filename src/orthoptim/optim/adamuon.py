"""AdaMuon: Muon with an elementwise second moment of the orthogonal update (Si, Zhang,
Shen 2025, arXiv:2507.11005, Algorithm 1; the official code Chongjie-Si/AdaMuon
`adamuon.py`). NVIDIA Emerging-Optimizers ships it as `AdaptiveMuon`.

Per matrix parameter W (m×n) with gradient G, one step::

    M ← β·M + (1−β)·G;   U = (1−β)·G + β·M if nesterov else M     (Muon's momentum)
    O = orthogonalize(sign(U))                                      (sign-stabilised)
    V ← β₂·V + (1−β₂)·O⊙O                                           (elementwise, m×n)
    Ô = O / (√V + ε)
    W ← (1 − lr·wd)·W − lr·γ·Ô,   γ = rms·√(mn) / (‖Ô‖_F + ε)     (update RMS = rms)

Defaults are the official code's: lr 0.02, momentum 0.95, β₂ = momentum (the paper's one β
for both moments), ε 1e-8, weight decay 0.01, Nesterov on (the paper's Algorithm 1 has none),
rms 0.2 (Algorithm 1's 0.2·√(mn)). No bias correction. The sign is elementwise, so under FSDP
only signs travel to the owner; V is whole-matrix state held by the owner. Emerging-
Optimizers' "adamuon" mode (no sign, no 0.2 rescale) is a different algorithm.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any, ClassVar

import torch
from torch import Tensor

from orthoptim._validate import check_positive, check_unit_interval
from orthoptim.optim.contract import StateKind
from orthoptim.optim.muon import LRScale, Muon
from orthoptim.optim.shapes import matrix_view


class AdaMuon(Muon):
    """AdaMuon for matrix parameters (as Muon: 2-D, 3-D experts, conv weights; `split`).

    `beta2` (None: equal to `momentum`) is the EMA coefficient of V; `eps` is added to √V and to
    ‖Ô‖_F; `rms` is the RMS of every update before the learning rate (no `lr_scale`: the RMS rescale
    sets the size). `options` are Muon's (`ns_steps`, `coefficients`, `ns_dtype`, `orthogonalizer`,
    `nonfinite`, `split`, `ns_batch_mb`), with Muon's defaults; Newton-Schulz's own `eps` stays
    Muon's.
    """

    state_kinds: ClassVar[dict[str, StateKind]] = {**Muon.state_kinds, "update_moment": "matrix"}

    def __init__(
        self,
        params: Iterable[Any],
        lr: float = 0.02,
        momentum: float = 0.95,
        beta2: float | None = None,
        eps: float = 1e-8,
        weight_decay: float = 0.01,
        nesterov: bool = True,
        rms: float = 0.2,
        **options: Any,
    ) -> None:
        if beta2 is not None:
            check_unit_interval("beta2", beta2)
        check_positive("eps", eps)
        check_positive("rms", rms)
        super().__init__(
            params, lr=lr, momentum=momentum, nesterov=nesterov, weight_decay=weight_decay,
            lr_scale="none", **options,
        )  # fmt: skip
        self.add_defaults(beta2=beta2, moment_eps=eps, rms=rms)

    def prepare(self, grad: Tensor, state: dict[str, Any], group: dict[str, Any]) -> Tensor:
        """Muon's momentum, then the sign of the update (elementwise)."""
        return torch.sign(super().prepare(grad, state, group))

    def block_scale(self, group: dict[str, Any]) -> LRScale:
        return "none"

    def owns_updates(self, group: dict[str, Any]) -> bool:
        return True  # the sign is a fresh tensor, with Nesterov or without

    def matrix_state(self, oriented: Tensor) -> dict[str, Tensor]:
        """The second moment per entry of the orthogonalized update, zero."""
        return {"update_moment": torch.zeros_like(oriented)}

    def finish(
        self, ortho: Tensor, update: Tensor, state: dict[str, Any], group: dict[str, Any]
    ) -> Tensor:
        o = matrix_view(ortho)
        eps = group["moment_eps"]
        beta2 = group["beta2"] if group["beta2"] is not None else group["momentum"]
        if "update_moment" not in state:
            state.update(self.matrix_state(o))
        moment = state["update_moment"]
        moment.mul_(beta2).addcmul_(o, o, value=1.0 - beta2)
        denom = moment.sqrt() + eps
        normed = o.div_(denom) if self.owns_results() else o / denom
        size = group["rms"] * math.sqrt(o.shape[-2] * o.shape[-1])
        normed *= size / (torch.linalg.vector_norm(normed, dim=(-2, -1), keepdim=True) + eps)
        return normed.reshape(ortho.shape)
