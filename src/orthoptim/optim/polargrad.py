"""PolarGrad: the polar factor of the momentum scaled by its nuclear norm (Lau, Long, Su
2025, arXiv:2505.21799; the official code timlautk/polargrad `polar_grad.py`).

Per matrix parameter W with gradient G, one step::

    M ← β·M + (1−β)·G;   X = (1−β)·G + β·M if nesterov else M
    U = orthogonalize(X)                              (the polar factor, by Newton-Schulz)
    W ← (1 − lr·wd)·W − lr·⟨X, U⟩·U                   (⟨X, U⟩ = ‖X‖_* , the nuclear norm)

Defaults are the official code's (`PolarGrad.__init__`): lr 0.02, momentum 0.95, weight decay
0, no Nesterov; the official code computes the polar factor by QDWH, Emerging-Optimizers (and
this one) by Newton-Schulz, whose approximate polar factor makes ⟨X, U⟩ an approximation of
the nuclear norm too. The nuclear norm is taken per matrix (3-D experts: per expert; a split
fused matrix: over its blocks together). Its `polar_first` variant is not offered.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, ClassVar

from torch import Tensor

from orthoptim.optim.contract import StateKind
from orthoptim.optim.muon import LRScale, Muon, lr_scale_factor
from orthoptim.optim.shapes import matrix_view


class PolarGrad(Muon):
    """PolarGrad for matrix parameters (as Muon: 2-D, 3-D experts, conv weights; `split`).

    `lr_scale` (default "none") multiplies the scaled polar factor. `options` are Muon's
    (`ns_steps`, `coefficients`, `ns_dtype`, `orthogonalizer`, `nonfinite`, `eps`, `split`,
    `ns_batch_mb`), with Muon's defaults.
    """

    state_kinds: ClassVar[dict[str, StateKind]] = Muon.state_kinds

    def __init__(
        self,
        params: Iterable[Any],
        lr: float = 0.02,
        momentum: float = 0.95,
        nesterov: bool = False,
        weight_decay: float = 0.0,
        lr_scale: LRScale = "none",
        **options: Any,
    ) -> None:
        super().__init__(
            params, lr=lr, momentum=momentum, nesterov=nesterov, weight_decay=weight_decay,
            lr_scale=lr_scale, **options,
        )  # fmt: skip

    def block_scale(self, group: dict[str, Any]) -> LRScale:
        return "none"  # the LR scale multiplies the scaled polar factor, not U

    def owns_updates(self, group: dict[str, Any]) -> bool:
        return False  # `finish` reads the update X again for ⟨X, U⟩

    def finish(
        self, ortho: Tensor, update: Tensor, state: dict[str, Any], group: dict[str, Any]
    ) -> Tensor:
        o, x = matrix_view(ortho), matrix_view(update.to(ortho.dtype))
        nuclear = (x * o).sum(dim=(-2, -1), keepdim=True)
        nuclear *= lr_scale_factor(group["lr_scale"], o.shape[-2], o.shape[-1])
        return (o * nuclear).reshape(ortho.shape)
