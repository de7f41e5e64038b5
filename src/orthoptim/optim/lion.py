"""Lion: the sign of an interpolated momentum (Chen et al. 2023, "Symbolic Discovery of
Optimization Algorithms", arXiv:2302.06675; the official code google/automl
`lion/lion_pytorch.py`), an elementwise optimizer for the non-matrix part (embeddings, heads,
vectors) in place of AdamW: `build_optimizer(..., elementwise="lion")`.

Per parameter W (any shape) with gradient G, one step::

    W ← (1 − lr·wd)·W
    W ← W − lr·sign(β₁·m + (1−β₁)·G)
    m ← β₂·m + (1−β₂)·G

Defaults are the official code's: lr 1e-4, betas (0.9, 0.99), weight decay 0. Its paper
advises an LR 3–10× smaller than AdamW's and a decay as many times larger. One state entry,
`exp_avg`, the size of W; everything is elementwise, so a layer-wise run shards it like AdamW
(each rank steps a run of the elements) and FSDP steps the local shards.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

from orthoptim._validate import check_betas, check_nonnegative
from orthoptim.optim.base import (
    GuardedOptimizer,
    NonfinitePolicy,
    check_nonfinite_policy,
    check_params,
    state_dtype,
)
from orthoptim.optim.contract import step_scalar


class Lion(GuardedOptimizer):
    """Lion over any parameters (elementwise); `nonfinite` as Muon's ("raise" or "skip")."""

    def __init__(
        self,
        params: Iterable[Any],
        lr: float = 1e-4,
        betas: tuple[float, float] = (0.9, 0.99),
        weight_decay: float = 0.0,
        nonfinite: NonfinitePolicy = "raise",
    ) -> None:
        check_nonnegative("lr", lr)
        check_betas("betas", betas)
        check_nonnegative("weight_decay", weight_decay)
        self.nonfinite = check_nonfinite_policy(nonfinite)
        super().__init__(params, dict(lr=lr, betas=tuple(betas), weight_decay=weight_decay))

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """As torch's, but rejects empty and repeated parameters, naming them."""
        super().add_param_group(param_group)
        check_params("Lion", self.param_groups)

    def _momentum(self, p: torch.Tensor) -> torch.Tensor:
        """The momentum of `p`, made (zero, in the state dtype) on first sight."""
        state = self.state[p]
        if "exp_avg" not in state:
            state["exp_avg"] = torch.zeros_like(p, dtype=state_dtype(p))
        return state["exp_avg"]

    def init_compiled_state(self) -> None:
        """The momentum of every parameter with a gradient and none yet."""
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    self._momentum(p)

    def _update(self) -> None:
        for group in self.param_groups:
            lr, wd = step_scalar(group["lr"]), group["weight_decay"]
            beta1, beta2 = group["betas"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                m = self._momentum(p)
                grad = p.grad.to(m.dtype)
                w = p if p.dtype == m.dtype else p.to(m.dtype)
                if wd != 0.0:
                    w.mul_(1.0 - lr * wd)
                w.add_(torch.sign(m.lerp(grad, 1.0 - beta1)), alpha=-lr)
                m.lerp_(grad, 1.0 - beta2)
                if w is not p:
                    p.copy_(w)
