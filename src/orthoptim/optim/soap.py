"""SOAP: Adam run in the eigenbasis of Shampoo's preconditioner (Vyas et al. 2024,
arXiv:2409.11321).

Per matrix parameter W (m×n) with gradient G, after the first step::

    G' ← Q_Lᵀ·G·Q_R                                   (rotate into the eigenbasis)
    M ← β₁·M + (1−β₁)·G'        V ← β₂·V + (1−β₂)·G'⊙G'   (Adam moments, rotated basis)
    N ← Q_L·[(M/c₁) / (√(V/c₂) + eps)]·Q_Rᵀ           (c = bias corrections, rotate back)
    W ← W − lr·wd·W − lr·N                            (decoupled weight decay)
    L ← β·L + (1−β)·G·Gᵀ        R ← β·R + (1−β)·Gᵀ·G      (Kronecker factors, β = shampoo_beta)
    every `precondition_frequency` steps: refresh Q_L, Q_R from L, R and re-express M in them

As in the reference implementation, the first step of a rotated parameter only initialises
L, R and their eigenbases (full `eigh`) and leaves the parameter where it is, so a projection
never uses the gradient it projects. Later refreshes take one step of orthogonal (power)
iteration with QR from the previous basis: the columns are re-sorted by their estimated
eigenvalues qᵢᵀ·L·qᵢ (descending) and V is permuted the same way so that it stays aligned.
The first moment M is stored in the rotated basis and rotated into the new basis at each
refresh, which is the paper's "project M each step" at a fraction of the matmuls.

A side larger than `max_precond_dim` keeps the identity basis (no factor); a parameter with
no rotated side — and every 1-D parameter — is plain AdamW, from the first step. A 3-D
parameter [E, out, in] is E independent matrices (one L, R pair each); ≥4-D (conv) weights
are one (out, rest) matrix. All state belongs to its own parameter, in float32 for bf16/fp16
parameters.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from typing import Any, ClassVar, Literal, get_args

import torch
from torch import Tensor

from orthoptim import host
from orthoptim._validate import (
    check_betas,
    check_choice,
    check_int,
    check_nonnegative,
    check_positive,
    check_unit_interval,
)
from orthoptim.optim.base import (
    NonfinitePolicy,
    check_nonfinite_policy,
    check_params,
    state_dtype,
)
from orthoptim.optim.contract import (
    Directions,
    Group,
    MatrixOptimizer,
    Prepared,
    StateKind,
    descend,
    step_scalar,
)
from orthoptim.optim.shapes import matrix_view, stack_shape

RefreshMethod = Literal["qr", "eigh"]
REFRESH_METHODS: tuple[RefreshMethod, ...] = get_args(RefreshMethod)


def eigenbasis(factor: Tensor) -> Tensor:
    """Eigenvectors of a (batch of) symmetric matrix, columns by descending eigenvalue.

    Runs in the factor's dtype and retries in float64 when that eigensolver fails to
    converge (which happens for ill-conditioned float32 factors).
    """
    try:
        _, vecs = torch.linalg.eigh(factor)
    except torch.linalg.LinAlgError:
        _, vecs = torch.linalg.eigh(factor.to(torch.float64))
        vecs = vecs.to(factor.dtype)
    return vecs.flip(-1)


def refine_eigenbasis(factor: Tensor, basis: Tensor) -> tuple[Tensor, Tensor]:
    """One step of orthogonal iteration from `basis`: QR(L·Q) with Q's columns re-sorted.

    Returns the new basis and the column order applied (indices into the old basis, sorted
    by the estimated eigenvalues qᵢᵀ·L·qᵢ, descending), so that per-column state can follow.
    """
    lq = factor @ basis
    estimate = (basis * lq).sum(dim=-2)
    order = estimate.argsort(dim=-1, descending=True)
    lq = lq.gather(-1, order.unsqueeze(-2).expand_as(lq))
    q, _ = torch.linalg.qr(lq)
    return q, order


def rotate(x: Tensor, q_left: Tensor | None, q_right: Tensor | None) -> Tensor:
    """Q_Lᵀ·X·Q_R, with None standing for the identity."""
    if q_left is not None:
        x = q_left.mT @ x
    if q_right is not None:
        x = x @ q_right
    return x


def rotate_back(x: Tensor, q_left: Tensor | None, q_right: Tensor | None) -> Tensor:
    """Q_L·X·Q_Rᵀ, the inverse of `rotate`."""
    if q_left is not None:
        x = q_left @ x
    if q_right is not None:
        x = x @ q_right.mT
    return x


class SOAP(MatrixOptimizer):
    """SOAP for matrix parameters; Adam(W) for vectors and for sides above `max_precond_dim`.

    Args:
        lr: learning rate.
        betas: Adam's (β₁, β₂) in the rotated basis.
        shampoo_beta: EMA coefficient of the Kronecker factors L, R; None → betas[1].
        eps: added to the bias-corrected √V (torch.optim.AdamW's placement).
        weight_decay: decoupled and applied before the update, W ← (1 − lr·wd)·W − lr·N
            (torch.optim.AdamW's order); the original soap.py decays after it,
            W ← (1 − lr·wd)·(W − lr·N).
        precondition_frequency: refresh the eigenbases every this many steps.
        max_precond_dim: a side longer than this keeps the identity basis.
        correct_bias: Adam's bias correction of M and V.
        refresh_method: "qr" (eigh once, then one power-iteration step with QR per refresh,
            as in the paper) or "eigh" (a full eigendecomposition at every refresh).
        nonfinite: "raise" (default) or "skip" for NaN/Inf gradients, as in Muon.
    """

    def __init__(
        self,
        params: Iterable[Any],
        lr: float = 3e-3,
        betas: tuple[float, float] = (0.95, 0.95),
        shampoo_beta: float | None = None,
        eps: float = 1e-8,
        weight_decay: float = 0.01,
        precondition_frequency: int = 10,
        max_precond_dim: int = 10000,
        correct_bias: bool = True,
        refresh_method: RefreshMethod = "qr",
        nonfinite: NonfinitePolicy = "raise",
    ) -> None:
        check_nonnegative("lr", lr)
        check_betas("betas", betas)
        if shampoo_beta is not None:
            check_unit_interval("shampoo_beta", shampoo_beta)
        check_positive("eps", eps)
        check_nonnegative("weight_decay", weight_decay)
        check_int("precondition_frequency", precondition_frequency, 1)
        check_int("max_precond_dim", max_precond_dim, 0)
        if not isinstance(correct_bias, bool):
            raise ValueError(f"correct_bias must be a bool, got {correct_bias!r}")
        check_choice("refresh_method", refresh_method, REFRESH_METHODS)
        self.nonfinite = check_nonfinite_policy(nonfinite)
        defaults = dict(
            lr=lr,
            betas=tuple(betas),
            shampoo_beta=shampoo_beta,
            eps=eps,
            weight_decay=weight_decay,
            precondition_frequency=precondition_frequency,
            max_precond_dim=max_precond_dim,
            correct_bias=correct_bias,
            refresh_method=refresh_method,
        )
        super().__init__(params, defaults)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """As torch's, but rejects complex, empty and repeated parameters, naming them."""
        super().add_param_group(param_group)
        check_params("SOAP", self.param_groups)
        group = self.param_groups[-1]
        names = group.get("param_names")
        for i, p in enumerate(group["params"]):
            if p.is_complex():
                name = names[i] if names is not None else f"parameter {i} of the new group"
                raise ValueError(f"SOAP does not support complex parameters ({name})")

    state_kinds: ClassVar[dict[str, StateKind]] = {
        "step": "scalar",
        **dict.fromkeys(("exp_avg", "exp_avg_sq"), "matrix"),
        **dict.fromkeys(("factor_left", "factor_right", "basis_left", "basis_right"), "matrix"),
    }

    work = "eigenbasis"

    @classmethod
    def state_numel(cls, shape: Sequence[int]) -> int:
        """Two moments plus, per matrix, a Kronecker factor and an eigenbasis of each side."""
        numel = math.prod(shape)
        if len(shape) < 2:
            return 2 * numel
        k, m, n = stack_shape(shape)
        return 2 * numel + 2 * k * (m * m + n * n)

    def prepare(self, grad: Tensor, state: dict[str, Any], group: dict[str, Any]) -> Tensor:
        """The raw gradient, in the state dtype: all of SOAP's state is per matrix."""
        return grad.to(state_dtype(grad))

    def moves(self, state: dict[str, Any], shape: torch.Size, group: dict[str, Any]) -> bool:
        """Every step but a rotated matrix's first, which only builds its eigenbases."""
        return "step" in state or not _rotated(shape, group["max_precond_dim"])

    def apply(
        self, param: Tensor, direction: Tensor | None, state: dict[str, Any], group: dict[str, Any]
    ) -> None:
        """Count the step (every rank holding part of the parameter); W ← (1 − lr·wd)·W −
        (lr / c₁)·N, with c₁ Adam's first bias correction at this step."""
        if direction is None:
            state.setdefault("step", 0)
            return
        step = state["step"] = state.get("step", 0) + 1
        beta1 = group["betas"][0]
        correction = 1.0 - beta1**step if group["correct_bias"] else 1.0
        lr = step_scalar(group["lr"])
        descend(param, direction, lr, group["weight_decay"], lr / correction)

    def directions(self, items: Prepared, group: Group, names: Sequence[str]) -> Directions:
        """Adam's step in the rotated basis, rotated back, per matrix (None on a rotated
        matrix's first step); folds the gradient into the factors and refreshes the bases."""
        due: list[tuple[str, dict[str, Any]]] = []  # bases built or refreshed this step
        out = [self._direction(g, st, group, n, due) for (g, st), n in zip(items, names)]
        _check_factors(due)
        for _, state in due:
            if "basis_left" in state or "basis_right" in state:
                self._refresh(state, group["refresh_method"])
            else:
                for side, factor in _factors(state):
                    state[f"basis_{side}"] = eigenbasis(factor)
        return out

    def _direction(
        self,
        grad: Tensor,
        state: dict[str, Any],
        group: dict[str, Any],
        name: str,
        due: list[tuple[str, dict[str, Any]]],
    ) -> Tensor | None:
        """The direction of one matrix; (name, state) joins `due` when its factors are to be
        (re)decomposed this step."""
        shape = grad.shape
        if grad.ndim >= 2:
            grad = matrix_view(grad)
        beta1, beta2 = group["betas"]
        shampoo_beta = group["shampoo_beta"] if group["shampoo_beta"] is not None else beta2

        if "step" not in state:
            state["step"] = 0
            state["exp_avg"] = torch.zeros_like(grad, memory_format=torch.contiguous_format)
            state["exp_avg_sq"] = torch.zeros_like(grad, memory_format=torch.contiguous_format)
            if grad.ndim >= 2:
                for side, size in (("left", grad.shape[-2]), ("right", grad.shape[-1])):
                    if size <= group["max_precond_dim"]:
                        state[f"factor_{side}"] = grad.new_zeros(grad.shape[0], size, size)
            if _factors(state):
                # First step: initialise the factors and their eigenbases, do not move.
                _fold_gradient(state, grad, shampoo_beta)
                due.append((name, state))
                return None

        q_left, q_right = state.get("basis_left"), state.get("basis_right")
        exp_avg, exp_avg_sq = state["exp_avg"], state["exp_avg_sq"]
        step = state["step"] + 1
        g = rotate(grad, q_left, q_right)
        exp_avg.lerp_(g, 1.0 - beta1)
        exp_avg_sq.mul_(beta2).addcmul_(g, g, value=1.0 - beta2)
        bias_correction2_sqrt = (1.0 - beta2**step) ** 0.5 if group["correct_bias"] else 1.0
        denom = (exp_avg_sq.sqrt() / bias_correction2_sqrt).add_(group["eps"])
        direction = rotate_back(exp_avg / denom, q_left, q_right)

        if _factors(state):
            _fold_gradient(state, grad, shampoo_beta)
            if step % group["precondition_frequency"] == 0:
                due.append((name, state))
        return direction.view(shape)

    def _refresh(self, state: dict[str, Any], method: str) -> None:
        """New eigenbases from the factors; M re-expressed in them, V permuted along."""
        old = (state.get("basis_left"), state.get("basis_right"))
        exp_avg = rotate_back(state["exp_avg"], *old)
        exp_avg_sq = state["exp_avg_sq"]
        for side, factor in _factors(state):
            if method == "eigh":
                state[f"basis_{side}"] = eigenbasis(factor)
                continue
            basis, order = refine_eigenbasis(factor, state[f"basis_{side}"])
            state[f"basis_{side}"] = basis
            if side == "left":
                exp_avg_sq = exp_avg_sq.gather(-2, order.unsqueeze(-1).expand_as(exp_avg_sq))
            else:
                exp_avg_sq = exp_avg_sq.gather(-1, order.unsqueeze(-2).expand_as(exp_avg_sq))
        state["exp_avg_sq"] = exp_avg_sq
        state["exp_avg"] = rotate(exp_avg, state.get("basis_left"), state.get("basis_right"))


def _factors(state: dict[str, Any]) -> list[tuple[str, Tensor]]:
    return [(s, state[f"factor_{s}"]) for s in ("left", "right") if f"factor_{s}" in state]


def _fold_gradient(state: dict[str, Any], grad: Tensor, shampoo_beta: float) -> None:
    """L ← β·L + (1−β)·G·Gᵀ and R ← β·R + (1−β)·Gᵀ·G for the sides that have a factor."""
    for side, factor in _factors(state):
        outer = grad @ grad.mT if side == "left" else grad.mT @ grad
        factor.lerp_(outer, 1.0 - shampoo_beta)


def _check_factors(due: list[tuple[str, dict[str, Any]]]) -> None:
    """Raise FloatingPointError naming the first non-finite Kronecker factor of `due`, before
    any of their eigenbases change: one host read for all of them."""
    factors = [(name, side, f) for name, state in due for side, f in _factors(state)]
    if not factors:
        return
    flags = torch.stack([~torch.isfinite(f).all() for _, _, f in factors])
    counts = host.read(flags, "SOAP factor check")
    for (name, side, _), bad in zip(factors, counts.tolist()):
        if bad:
            raise FloatingPointError(
                f"SOAP: the {side} Kronecker factor of {name} is not finite (the gradient's "
                "outer product overflowed); its eigenbasis is left as it was. Clip or rescale "
                "the gradients, or reset this parameter's optimizer state."
            )


def _rotated(shape: torch.Size, max_precond_dim: int) -> bool:
    """Whether a parameter of `shape` has a side rotated into an eigenbasis (a factor)."""
    return len(shape) >= 2 and min(stack_shape(shape)[1:]) <= max_precond_dim
