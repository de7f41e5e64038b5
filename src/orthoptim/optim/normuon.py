"""NorMuon: Muon with neuron-wise normalisation (Li et al. 2025, arXiv:2510.05491; the
official code zichongli5/NorMuon `normuon.py`, which modded-nanogpt's records build on).

Per matrix parameter W (m×n, m = rows = output neurons) with gradient G, one step::

    M ← β·M + (1−β)·G;   U = (1−β)·G + β·M if nesterov else M     (Muon's momentum)
    O = orthogonalize(U)                                            (Newton-Schulz)
    v ← β₂·v + (1−β₂)·mean_cols(O⊙O)                                (per neuron: v is m×1)
    Ô = O / (√v + ε);   Ô ← Ô·‖O‖_F / (‖Ô‖_F + ε)                   (normalise, keep ‖O‖_F)
    W ← (1 − lr·wd)·W − lr·scale(m, n)·Ô                           (scale: `lr_scale`)

Defaults are the official code's (`NorMuon.__init__`): lr 0.02, momentum 0.95, β₂ 0.95,
ε 1e-10, weight decay 0, Nesterov on, and its shape scale max(1, m/n)^½, which is the
"keller" LR scale. modded-nanogpt's speedrun variant (Polar Express, statistics along the
longer side) is not this one. The per-neuron moment v is whole-matrix state held by the
matrix's owner; the momentum is elementwise, so under FSDP it stays sharded.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from typing import Any, ClassVar

import torch
from torch import Tensor

from orthoptim._validate import check_positive, check_unit_interval
from orthoptim.optim.contract import StateKind
from orthoptim.optim.muon import LRScale, Muon, lr_scale_factor
from orthoptim.optim.shapes import matrix_view, stack_shape


class NorMuon(Muon):
    """NorMuon for matrix parameters (as Muon: 2-D, 3-D experts, conv weights; `split`).

    `beta2`: EMA coefficient of the per-neuron second moment; `eps`: added to its root (and to the
    norm ratio). `lr_scale` is applied after the normalisation (default "keller", the official
    code's max(1, m/n)^½). `options` are Muon's (`ns_steps`, `coefficients`, `ns_dtype`,
    `orthogonalizer`, `nonfinite`, `split`, `ns_batch_mb`), with Muon's defaults; Newton-Schulz's
    own `eps` stays Muon's.
    """

    state_kinds: ClassVar[dict[str, StateKind]] = {**Muon.state_kinds, "neuron_moment": "matrix"}

    def __init__(
        self,
        params: Iterable[Any],
        lr: float = 0.02,
        momentum: float = 0.95,
        beta2: float = 0.95,
        eps: float = 1e-10,
        nesterov: bool = True,
        weight_decay: float = 0.0,
        lr_scale: LRScale = "keller",
        **options: Any,
    ) -> None:
        check_unit_interval("beta2", beta2)
        check_positive("eps", eps)
        super().__init__(
            params, lr=lr, momentum=momentum, nesterov=nesterov, weight_decay=weight_decay,
            lr_scale=lr_scale, **options,
        )  # fmt: skip
        self.add_defaults(beta2=beta2, moment_eps=eps)

    @classmethod
    def state_numel(cls, shape: Sequence[int]) -> int:
        """The momentum (one per element) and one moment per neuron (row)."""
        count, rows, _ = stack_shape(shape)
        return math.prod(shape) + count * rows

    def block_scale(self, group: dict[str, Any]) -> LRScale:
        return "none"  # the LR scale comes after the normalisation

    def matrix_state(self, oriented: Tensor) -> dict[str, Tensor]:
        """The second moment per neuron (row), zero: [k, rows, 1]."""
        return {"neuron_moment": oriented.new_zeros(*oriented.shape[:-1], 1)}

    def finish(
        self, ortho: Tensor, update: Tensor, state: dict[str, Any], group: dict[str, Any]
    ) -> Tensor:
        o = matrix_view(ortho)
        eps = group["moment_eps"]
        if "neuron_moment" not in state:
            state.update(self.matrix_state(o))
        moment = state["neuron_moment"]
        moment.lerp_((o * o).mean(dim=-1, keepdim=True), 1.0 - group["beta2"])
        frob = torch.linalg.vector_norm(o, dim=(-2, -1), keepdim=True)
        denom = moment.sqrt() + eps
        normed = o.div_(denom) if self.owns_results() else o / denom
        normed *= frob / (torch.linalg.vector_norm(normed, dim=(-2, -1), keepdim=True) + eps)
        normed *= lr_scale_factor(group["lr_scale"], o.shape[-2], o.shape[-1])
        return normed.reshape(ortho.shape)
