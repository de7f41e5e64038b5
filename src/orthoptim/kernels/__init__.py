"""Symmetric products for Newton-Schulz: X·Xᵀ (`gram`), A·A (`sym_square`) and b·A + c·A·A
(`sym_poly`) for symmetric A.

All three results are symmetric, so only one triangle needs computing (a SYRK): about half
the flops of the general product. These entry points are where the device/dtype dispatch
lives; every caller goes through them:

- CPU, float32/float64, at least `CPU_SYRK_MIN_ROWS` rows: a recursive blocked SYRK over
  torch matmuls (`orthoptim.kernels.syrk_cpu`); below that size plain matmul is faster.
- CUDA, float16/bfloat16/float32, when `triton` imports: per shape, whichever of a Triton
  kernel that computes only the tiles on one side of the diagonal
  (`orthoptim.kernels.triton_syrk`) and torch's general product was measured faster on this
  GPU model (`orthoptim.kernels.tuning`: a table of measurements, tuning on first sight, or
  the row threshold `tuning.FALLBACK_MIN_ROWS` measured in bf16).
- anything else (and whenever autograd needs to flow through): plain matmul.

`ORTHOPTIM_KERNELS=matmul` in the environment, or the `force_matmul()` context manager,
forces the matmul path everywhere (for benchmarks and for checking results).
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch
from torch import Tensor

from orthoptim.kernels import syrk_cpu, tuning

ENV_VAR = "ORTHOPTIM_KERNELS"
MODES = ("auto", "matmul")
# Below this many rows the blocked SYRK's extra launches cost more than the flops it saves
# (measured with `orthoptim bench ns`: 256×1024 was no faster, 512×2048 ≈ 1.1×).
CPU_SYRK_MIN_ROWS = 512
# Newton-Schulz iterates on the m×m Gram matrix when columns >= this many times rows.
GRAM_FORM_ASPECT = 2.0
# Below CPU_SYRK_MIN_ROWS (plain matmul everywhere) the Gram form still pays on CPU from this
# many rows and a wider aspect (measured at 1 thread: 128×512 1.2–1.5×, 256×640 1.25×,
# 128×256 0.87×, 96×192 0.75×).
GRAM_FORM_MIN_ROWS_CPU = 128
GRAM_FORM_ASPECT_SMALL = 2.5

_CPU_DTYPES = (torch.float32, torch.float64)
_CUDA_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_forced_matmul = 0

__all__ = [
    "CPU_SYRK_MIN_ROWS",
    "ENV_VAR",
    "GRAM_FORM_ASPECT",
    "GRAM_FORM_ASPECT_SMALL",
    "GRAM_FORM_MIN_ROWS_CPU",
    "MODES",
    "backend_for",
    "force_matmul",
    "gram",
    "gram_form_pays",
    "kernel_mode",
    "sym_matmul_for",
    "sym_poly",
    "sym_square",
    "syrk_for",
    "triton_available",
]


def kernel_mode() -> str:
    """The active mode: "matmul" inside `force_matmul()` or with ORTHOPTIM_KERNELS=matmul,
    else "auto" (dispatch on device, dtype and size)."""
    if _forced_matmul:
        return "matmul"
    mode = os.environ.get(ENV_VAR, "auto").strip().lower() or "auto"
    if mode not in MODES:
        raise ValueError(
            f"environment variable {ENV_VAR}={mode!r} is not a kernel mode; "
            f"set it to one of {', '.join(MODES)} or unset it"
        )
    return mode


@contextmanager
def force_matmul(enabled: bool = True) -> Iterator[None]:
    """Within the block every symmetric product uses plain matmul (nestable)."""
    global _forced_matmul
    step = 1 if enabled else 0
    _forced_matmul += step
    try:
        yield
    finally:
        _forced_matmul -= step


@functools.cache
def triton_available() -> bool:
    """True when the optional `triton` package imports (install with `.[triton]`)."""
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def backend_for(X: Tensor) -> str:
    """Which implementation a symmetric product of the rows of `X` ([..., m, n]) uses:
    "triton", "cpu_syrk" or "matmul". "triton" is the CUDA dispatch: per shape the Triton
    SYRK or torch's product, whichever `tuning.choose` says was measured faster."""
    if kernel_mode() == "matmul" or (X.requires_grad and torch.is_grad_enabled()):
        return "matmul"
    if X.device.type == "cuda" and X.dtype in _CUDA_DTYPES and triton_available():
        return "triton"
    if X.device.type == "cpu" and X.dtype in _CPU_DTYPES and X.shape[-2] >= CPU_SYRK_MIN_ROWS:
        return "cpu_syrk"
    return "matmul"


def gram_form_pays(X: Tensor) -> bool:
    """Whether Newton-Schulz on `X` ([..., m, n], m <= n) should iterate on its m×m Gram
    matrix (`newton_schulz_gram_form`): float32/float64 and n >= GRAM_FORM_ASPECT·m; on CPU
    either m >= CPU_SYRK_MIN_ROWS or m >= GRAM_FORM_MIN_ROWS_CPU with
    n >= GRAM_FORM_ASPECT_SMALL·m (smaller products run too far below the BLAS peak for the
    saved flops to show). Half precision is left alone (the Gram form squares the condition
    number)."""
    m, n = X.shape[-2], X.shape[-1]
    if kernel_mode() == "matmul" or X.dtype not in _CPU_DTYPES or n < GRAM_FORM_ASPECT * m:
        return False
    if X.requires_grad and torch.is_grad_enabled():
        return False
    if X.device.type != "cpu" or m >= CPU_SYRK_MIN_ROWS:
        return True
    return m >= GRAM_FORM_MIN_ROWS_CPU and n >= GRAM_FORM_ASPECT_SMALL * m


def _check(name: str, T: Tensor, square: bool) -> None:
    if T.ndim < 2:
        raise ValueError(
            f"{name} needs a matrix or a batch [..., m, n], got shape {tuple(T.shape)}"
        )
    if square and T.shape[-1] != T.shape[-2]:
        raise ValueError(f"{name} needs square symmetric matrices, got shape {tuple(T.shape)}")


Syrk = Callable[[Tensor, Tensor | None, float, float], Tensor]


def syrk_for(X: Tensor) -> Syrk:
    """The implementation of beta·C + alpha·X·Xᵀ (C symmetric or None) that `backend_for(X)`
    picks, to call directly: a loop of small products (Newton-Schulz) chooses once instead of
    dispatching per product. It also serves X's Gram matrix (same rows, device and dtype)."""
    backend = backend_for(X)
    if backend == "cpu_syrk":
        return syrk_cpu.syrk
    if backend == "triton":
        return _cuda_syrk
    return syrk_cpu.syrk_matmul


def _cuda_syrk(X: Tensor, C: Tensor | None, beta: float, alpha: float) -> Tensor:
    """beta·C + alpha·X·Xᵀ on CUDA through the implementation measured fastest for the shape."""
    from orthoptim.kernels import triton_syrk

    choice = tuning.choose(X, C is not None, tuner=triton_syrk.tune)
    if choice != tuning.MATMUL:
        try:
            return triton_syrk.syrk(X, C, beta, alpha, config=choice)
        except torch.OutOfMemoryError:
            raise
        except Exception as exc:  # e.g. a config this triton or GPU cannot compile
            tuning.refuse(X, C is not None, choice, exc)
    return syrk_cpu.syrk_matmul(X, C, beta, alpha)


SymMatmul = Callable[[Tensor, Tensor], Tensor]


def sym_matmul_for(X: Tensor) -> SymMatmul:
    """The implementation of P·S for products known to be symmetric (two commuting symmetric
    matrices, e.g. polynomials in one Gram matrix) that the backend of `X` offers: one
    triangle on the CPU SYRK backend, else plain matmul."""
    return syrk_cpu.sym_matmul if backend_for(X) == "cpu_syrk" else torch.matmul


def _syrk(X: Tensor, C: Tensor | None, beta: float, alpha: float) -> Tensor:
    """beta·C + alpha·X·Xᵀ with C symmetric (or absent), through the chosen backend."""
    return syrk_for(X)(X, C, beta, alpha)


def gram(X: Tensor) -> Tensor:
    """X·Xᵀ for a matrix or a batch [..., m, n] (result [..., m, m], symmetric)."""
    _check("gram", X, square=False)
    return _syrk(X, None, 0.0, 1.0)


def sym_square(A: Tensor) -> Tensor:
    """A·A for a symmetric A (or a batch of them): equal to A·Aᵀ, so a SYRK."""
    _check("sym_square", A, square=True)
    return _syrk(A, None, 0.0, 1.0)


def sym_poly(A: Tensor, b: float, c: float) -> Tensor:
    """b·A + c·A·A for a symmetric A (or a batch of them), fused into one SYRK pass."""
    _check("sym_poly", A, square=True)
    return _syrk(A, A, float(b), float(c))
