"""Symmetric products for Newton-Schulz: X·Xᵀ (`gram`), A·A (`sym_square`) and b·A + c·A·A
(`sym_poly`) for symmetric A.

All three results are symmetric, so only one triangle needs computing (a SYRK): about half
the flops of the general product. These entry points are where the device/dtype dispatch
lives; every caller goes through them:

- CPU, float32/float64: the path of the shape (`path_for`): the plain product unless
  another was measured faster on this machine (`orthoptim.kernels.calibration`: raced on
  first sight of a shape class, cached in `$XDG_CACHE_HOME/orthoptim/kernels-cpu.json`): the
  recursive blocked SYRK over torch matmuls (`orthoptim.kernels.syrk_cpu`) and, for wide
  matrices, the Gram form of Newton-Schulz (`gram_form_pays`).
- CUDA, float16/bfloat16/float32, when `triton` imports: per shape, whichever of a Triton
  kernel that computes only the tiles on one side of the diagonal
  (`orthoptim.kernels.triton_syrk`) and torch's general product was measured faster on this
  GPU model (`orthoptim.kernels.tuning`: a table of measurements, tuning on first sight;
  without either, torch's product).
- anything else (and whenever autograd needs to flow through, or under `torch.compile`):
  plain matmul.

`ORTHOPTIM_KERNELS=matmul` in the environment, or the `force_matmul()` context manager,
forces the matmul path everywhere (for benchmarks and for checking results); `force_path`
forces one CPU path where it applies (for tests and benchmarks of each path).
"""

from __future__ import annotations

import functools
import math
import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch
from torch import Tensor

from orthoptim import ns_cost
from orthoptim.kernels import calibration, syrk_cpu, tuning
from orthoptim.kernels.calibration import Decision
from orthoptim.ns_cost import PathName

ENV_VAR = "ORTHOPTIM_KERNELS"
MODES = ("auto", "matmul")
_CPU_DTYPES = (torch.float32, torch.float64)
_forced_matmul = 0
_forced_paths: list[PathName] = []

__all__ = [
    "ENV_VAR",
    "MODES",
    "Decision",
    "backend_for",
    "decisions",
    "force_matmul",
    "force_path",
    "forget",
    "gram",
    "gram_form_pays",
    "kernel_mode",
    "ns_path_of",
    "path_for",
    "sym_matmul_for",
    "sym_poly",
    "sym_square",
    "syrk_for",
    "triton_available",
    "unraced",
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


@contextmanager
def force_path(path: PathName) -> Iterator[None]:
    """Within the block CPU Newton-Schulz takes `path` ("matmul", "cpu_syrk", "gram_form",
    "gram_form_syrk") wherever it applies (the Gram form to float32/float64 matrices with
    n >= GRAM_FORM_ASPECT·m, `ns_cost`'s, else its step-form counterpart), unmeasured. Nestable, the
    innermost wins; `force_matmul` still overrides it."""
    if path not in ns_cost.PATHS:
        raise ValueError(f"force_path: path {path!r} is not one of {', '.join(ns_cost.PATHS)}")
    _forced_paths.append(path)
    try:
        yield
    finally:
        _forced_paths.pop()


@contextmanager
def unraced(device: torch.device, enabled: bool = True) -> Iterator[None]:
    """Within the block (when `enabled`) Newton-Schulz's path is a function of the matrix's
    shape, dtype and device alone, never of a timing race (which each process runs on its
    own, so two processes may pick two paths and round differently): on CPU the Gram form
    with SYRK where it applies, SYRK elsewhere (`force_path("gram_form_syrk")`, measured
    here 1.2-2.0x faster than plain products from 384x1536 up and within 0.3 ms below);
    on other devices plain products (the Triton SYRK is chosen per shape by timing)."""
    if not enabled:
        yield
        return
    with force_matmul(device.type != "cpu"), force_path("gram_form_syrk"):
        yield


@functools.cache
def triton_available() -> bool:
    """True when the optional `triton` package imports (install with `.[triton]`)."""
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def path_for(X: Tensor) -> Decision:
    """The Newton-Schulz path of X ([..., m, n], m <= n, the iterand) on CPU and why (see
    `calibration.Decision`): forced ("matmul" under `force_matmul` or when autograd flows,
    `force_path`), else the shape class's decision, raced on first sight where measuring is
    enabled. Off the CPU, and for dtypes other than float32/float64, "matmul" (the CUDA
    dispatch is per product: `backend_for`)."""
    dtype = str(X.dtype).removeprefix("torch.")
    shape = (math.prod(X.shape[:-2]), X.shape[-2], X.shape[-1])
    if kernel_mode() == "matmul" or (X.requires_grad and torch.is_grad_enabled()):
        return Decision("matmul", "forced", shape=shape, dtype=dtype)
    if X.device.type != "cpu" or X.dtype not in _CPU_DTYPES:
        return Decision("matmul", "not raced", shape=shape, dtype=dtype)
    if _forced_paths:
        path = _forced_paths[-1]
        if path in ns_cost.GRAM_PATHS and X.shape[-1] < ns_cost.GRAM_FORM_ASPECT * X.shape[-2]:
            path = "cpu_syrk" if path == "gram_form_syrk" else "matmul"
        return Decision(path, "forced", shape=shape, dtype=dtype)
    if torch.compiler.is_compiling():
        return Decision("matmul", "default", shape=shape, dtype=dtype)
    return calibration.CALIBRATOR.decide(X)


def decisions() -> list[Decision]:
    """The CPU shape classes decided in this process (first met first), with why."""
    return calibration.CALIBRATOR.decisions()


def forget() -> None:
    """Drop every decision (CPU paths and CUDA choices): they are made again on demand."""
    calibration.CALIBRATOR.forget()
    tuning.forget()


def ns_path_of(X: Tensor) -> ns_cost.NSPath:
    """(form, backend) of Newton-Schulz on X ([..., m, n]) by the one rule (`ns_cost.ns_path`),
    fed this process's facts: the matmul path forced (`kernel_mode`, or autograd flowing),
    Triton installed on a CUDA device, and on CPU the path decided for X's shape class
    (`path_for`)."""
    plain = kernel_mode() == "matmul" or (X.requires_grad and torch.is_grad_enabled())
    cpu = X.device.type == "cpu"
    return ns_cost.ns_path(
        X.shape[-2],
        X.shape[-1],
        X.device.type,
        X.dtype,
        triton=X.device.type == "cuda" and triton_available(),
        kernel_mode="matmul" if plain else "auto",
        cpu_path=path_for(X).path if cpu and not plain else None,
    )


def backend_for(X: Tensor) -> str:
    """Which implementation a symmetric product of the rows of `X` ([..., m, n]) uses:
    "triton", "cpu_syrk" or "matmul" (`ns_path_of`). "triton" is the CUDA dispatch: per shape
    the Triton SYRK or torch's product, whichever `tuning.choose` says was measured faster;
    "cpu_syrk" where `path_for(X)` is a SYRK path."""
    return ns_path_of(X)[1]


def gram_form_pays(X: Tensor) -> bool:
    """Whether Newton-Schulz on `X` ([..., m, n], m <= n) should iterate on its m×m Gram
    matrix (`newton_schulz_gram_form`, `ns_path_of`): float32/float64 with
    n >= GRAM_FORM_ASPECT·m, and on CPU only where `path_for(X)` is a Gram-form path
    (measured faster, cached or forced). Half precision is left alone (the Gram form squares
    the condition number)."""
    return X.shape[-2] <= X.shape[-1] and ns_path_of(X)[0] == "gram"


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
    """beta·C + alpha·X·Xᵀ on CUDA through the implementation measured fastest for the shape
    (an empty X, e.g. a tensor-parallel rank's empty shard, by torch's product: nothing to
    tune)."""
    if X.numel() == 0:
        return syrk_cpu.syrk_matmul(X, C, beta, alpha)
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
