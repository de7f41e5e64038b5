"""AdamW with its moments stored in bfloat16: the elementwise part of the hybrid under
`build_optimizer(state_dtype=torch.bfloat16)`.

torch's AdamW keeps its moments in the parameter's dtype, so bfloat16 moments would mean
bfloat16 parameters and bfloat16 arithmetic. `LeanAdamW` is torch's single-tensor AdamW step
(decoupled weight decay, bias-corrected moments, no amsgrad) computed in float32 (float64 for
float64 parameters), with each moment read from and stored back to its `state_dtype` by
stochastic rounding (`orthoptim.optim.lean`); this step's update uses the unrounded moments.
With `state_dtype` None or torch.float32 it is torch's AdamW within float32 rounding
(`build_optimizer` then uses torch's own).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, ClassVar

import torch
from torch import Tensor

from orthoptim._validate import check_betas, check_nonnegative
from orthoptim.optim.base import (
    GuardedOptimizer,
    NonfinitePolicy,
    check_nonfinite_policy,
    check_params,
    compute_dtype,
    param_names,
)
from orthoptim.optim.contract import StateKind, step_scalar
from orthoptim.optim.lean import (
    STREAM_KEY,
    check_plain,
    check_rounding_seed,
    check_state_dtype,
    store_,
    stream_start,
    take_generator,
)


class LeanAdamW(GuardedOptimizer):
    """AdamW over any parameters with its moments in `state_dtype` (default bfloat16; None
    or torch.float32: float32), the step in float32; `rounding_seed` seeds the stochastic
    rounding of the moments (per parameter, from its name); `nonfinite` as Muon's."""

    state_kinds: ClassVar[dict[str, StateKind]] = {
        "exp_avg": "elementwise",
        "exp_avg_sq": "elementwise",
        "step": "scalar",
        STREAM_KEY: "scalar",
    }

    def __init__(
        self,
        params: Iterable[Any],
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 1e-2,
        state_dtype: torch.dtype | None = torch.bfloat16,
        rounding_seed: int = 0,
        nonfinite: NonfinitePolicy = "raise",
    ) -> None:
        check_nonnegative("lr", lr)
        check_betas("betas", betas)
        check_nonnegative("eps", eps)
        check_nonnegative("weight_decay", weight_decay)
        self.nonfinite = check_nonfinite_policy(nonfinite)
        defaults = dict(
            lr=lr,
            betas=tuple(betas),
            eps=eps,
            weight_decay=weight_decay,
            state_dtype=check_state_dtype(state_dtype),
            rounding_seed=check_rounding_seed(rounding_seed),
        )
        super().__init__(params, defaults)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """As torch's, but rejects empty and repeated parameters, naming them."""
        super().add_param_group(param_group)
        check_params("LeanAdamW", self.param_groups)

    def _state(self, p: Tensor, group: dict[str, Any], name: str) -> dict[str, Any]:
        """The state of `p` (named `name`), made on first sight: zero moments in the state
        dtype, step 0, and under bfloat16 the start of its rounding stream."""
        state = self.state[p]
        if not state:
            lean = group["state_dtype"]
            if lean is not None:
                check_plain("LeanAdamW", p)
                state[STREAM_KEY] = stream_start(group["rounding_seed"], name)
            dtype = lean or compute_dtype(p)
            state["step"] = 0
            state["exp_avg"] = torch.zeros_like(p, dtype=dtype)
            state["exp_avg_sq"] = torch.zeros_like(p, dtype=dtype)
        return state

    def init_compiled_state(self) -> None:
        """The state of every parameter with a gradient and none yet."""
        names = param_names(self)
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    self._state(p, group, names[id(p)])

    def _update(self) -> None:
        names = param_names(self)
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    self._step_one(p, self._state(p, group, names[id(p)]), group)

    def _step_one(self, p: Tensor, state: dict[str, Any], group: dict[str, Any]) -> None:
        """torch's single-tensor AdamW step of `p` in the compute dtype; the moments stored
        back by stochastic rounding where they are held lower."""
        lr, wd, eps = step_scalar(group["lr"]), group["weight_decay"], group["eps"]
        beta1, beta2 = group["betas"]
        dtype = compute_dtype(p)
        grad = p.grad.to(dtype)
        m, v = state["exp_avg"], state["exp_avg_sq"]
        lean = m.dtype != dtype
        step = state["step"] = state["step"] + 1
        w = p if p.dtype == dtype else p.to(dtype)
        w.mul_(1.0 - lr * wd)
        # in place on the state itself when it is held in the compute dtype
        m32 = m.to(dtype).lerp_(grad, 1.0 - beta1)
        v32 = v.to(dtype).mul_(beta2).addcmul_(grad, grad, value=1.0 - beta2)
        if lean:
            gen = take_generator(state, m.device)
            store_(m, m32, gen)
            store_(v, v32, gen)
        step_size = lr / (1.0 - beta1**step)
        bias_correction2_sqrt = (1.0 - beta2**step) ** 0.5
        # v32 is this step's own copy when the state is held lower: its root in place
        denom = (v32.sqrt_() if lean else v32.sqrt()).div_(bias_correction2_sqrt).add_(eps)
        w.addcdiv_(m32, denom, value=-step_size)
        if w is not p:
            p.copy_(w)
