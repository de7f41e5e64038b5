"""Newton-Schulz orthogonalization: the approximate polar factor Muon applies to its momentum.

One step on X (rows <= columns, normalised by its Frobenius norm first)::

    A = X Xᵀ            (symmetric: a Gram product)
    B = b·A + c·A·A     (symmetric: A·A is a symmetric square)
    X ← a·X + B·X

`polar_factor` is the exact U·Vᵀ from a float64 SVD: the reference the tests compare against.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Iterable, Sequence
from typing import Literal

import torch
from torch import Tensor

from orthoptim import host, kernels
from orthoptim._validate import check_dtype_or_auto, check_int, check_positive
from orthoptim.kernels import syrk_cpu
from orthoptim.ns_cost import GRAM_FORM_RESTART, NS_STEPS

Coefficients = tuple[float, float, float]
#: the names of `COEFFICIENT_SETS` (below; tested equal)
CoefficientSetName = Literal["simple", "quintic", "polar_express", "cubic"]
CoefficientsLike = CoefficientSetName | Sequence[Sequence[float]]

# The tuned Polar Express schedule (Amsel, Persson, Musco, Gower 2025, arXiv:2505.16932,
# Algorithm 1, degree 5). The paper divides every tuple but the last by a safety factor
# (a/1.01, b/1.01³, c/1.01⁵) so that rounding cannot push a singular value past the
# interval the polynomials were optimised on.
_POLAR_EXPRESS_RAW: tuple[Coefficients, ...] = (
    (8.28721201814563, -23.595886519098837, 17.300387312530933),
    (4.107059111542203, -2.9478499167379106, 0.5448431082926601),
    (3.9486908534822946, -2.908902115962949, 0.5518191394370137),
    (3.3184196573706015, -2.488488024314874, 0.51004894012372),
    (2.300652019954817, -1.6689039845747493, 0.4188073119525673),
    (1.891301407787398, -1.2679958271945868, 0.37680408948524835),
    (1.8750014808534479, -1.2500016453999487, 0.3750001645474248),
    (1.875, -1.25, 0.375),
)

COEFFICIENT_SETS: dict[str, tuple[Coefficients, ...]] = {
    # Keller Jordan's Muon (kellerjordan.github.io/posts/muon): one quintic repeated, chosen to
    # maximise the slope at zero; singular values end up in roughly [0.7, 1.2].
    "simple": ((3.4445, -4.7750, 2.0315),),
    # The 5-step per-step schedule tuned by You Jiacheng (used by the modded-nanogpt speedrun,
    # microsoft/dion and NVIDIA Emerging-Optimizers as "quintic"). Past 5 steps the last tuple
    # repeats; Emerging-Optimizers cycles through the five instead, so ns_steps > 5 differs.
    "quintic": (
        (4.0848, -6.8946, 2.9270),
        (3.9505, -6.3029, 2.6377),
        (3.7418, -5.5913, 2.3037),
        (2.8769, -3.1427, 1.2046),
        (2.8366, -3.0525, 1.2012),
    ),
    # Input normalised by ‖X‖_F alone, as every set here: the paper's code divides by
    # 1.01·‖X‖_F, so there every singular value starts 1% lower than here.
    "polar_express": (
        *((a / 1.01, b / 1.01**3, c / 1.01**5) for a, b, c in _POLAR_EXPRESS_RAW[:-1]),
        _POLAR_EXPRESS_RAW[-1],
    ),
    # The classical Newton-Schulz cubic X ← 1.5·X − 0.5·X·Xᵀ·X: converges to exactly U·Vᵀ,
    # but slowly for small singular values.
    "cubic": ((1.5, -0.5, 0.0),),
}

# Documented output band per set, measured against the float64 SVD (tests/test_newton_schulz.py):
# with 5 steps (cubic: 30) every singular value σ ≥ 0.01·σ_max of the input (cond up to 1e3,
# tall, wide or square, min(m, n) <= 128) maps into [low, high], and none maps above `high`.
# Smaller ones are raised monotonically towards the band but may stay below it; so may a
# larger matrix's σ ≥ 0.01·σ_max, which the Frobenius normalisation puts lower (512×512, cond
# 100: quintic and simple reach 0.62).
SINGULAR_VALUE_BANDS: dict[str, tuple[float, float]] = {
    "simple": (0.67, 1.21),
    "quintic": (0.96, 1.16),
    "polar_express": (0.86, 1.13),
    "cubic": (0.999, 1.001),
}

# The same bands for a bfloat16 iteration (ns_dtype="auto" on CUDA): each float32 band widened
# by BF16_BAND_MARGIN on both sides. Measured on CPU (64×64 to 128×512, 5 seeds, and 512×512,
# 256×1024; cond 10, 100, 1e3), the band edges of the bf16 output's singular values lie within
# 0.004 of the float32 ones (its projections on the input's singular vectors, which the
# float32 band is read from, within 0.008); rounding the result to bf16 (unit roundoff
# u = 2⁻⁸) alone moves a singular value by up to about 2u ≈ 0.008, so 0.01.
BF16_BAND_MARGIN = 0.01
SINGULAR_VALUE_BANDS_BF16: dict[str, tuple[float, float]] = {
    name: (round(low - BF16_BAND_MARGIN, 3), round(high + BF16_BAND_MARGIN, 3))
    for name, (low, high) in SINGULAR_VALUE_BANDS.items()
}


def coefficient_schedule(
    coefficients: CoefficientsLike, steps: int, name: str = "steps"
) -> list[Coefficients]:
    """Resolve a named set or a user sequence of (a, b, c) into exactly `steps` tuples.

    A schedule shorter than `steps` repeats its last tuple (Emerging-Optimizers cycles
    through it instead). `name` is what the caller calls
    the step count (Muon: `ns_steps`), for the error message.
    """
    check_int(name, steps, 1)
    if isinstance(coefficients, str):
        if coefficients not in COEFFICIENT_SETS:
            known = ", ".join(sorted(COEFFICIENT_SETS))
            raise ValueError(
                f"coefficients: unknown coefficient set {coefficients!r}; choose one of {known} "
                "or pass a sequence of (a, b, c) tuples"
            )
        table: Sequence[Sequence[float]] = COEFFICIENT_SETS[coefficients]
    else:
        if not isinstance(coefficients, Sequence):
            raise TypeError(
                "coefficients must be a set name or a sequence of (a, b, c) tuples, "
                f"got {coefficients!r}"
            )
        table = list(coefficients)
        if not table:
            raise ValueError("coefficients must contain at least one (a, b, c) tuple")
    resolved: list[Coefficients] = []
    for i, entry in enumerate(table):
        values = tuple(float(v) for v in entry)
        if len(values) != 3:
            raise ValueError(f"coefficients[{i}] must be an (a, b, c) triple, got {entry!r}")
        resolved.append(values)  # type: ignore[arg-type]
    return [resolved[min(i, len(resolved) - 1)] for i in range(steps)]


NSDtype = torch.dtype | Literal["auto"] | None  # a floating torch dtype, "auto" or None


def resolve_ns_dtype(
    requested: NSDtype,
    device: torch.device | str,
    input_dtype: torch.dtype,
    name: str = "ns_dtype",
) -> torch.dtype:
    """The dtype Newton-Schulz runs in for a matrix of `input_dtype` on `device`.

    - a torch dtype: that dtype, whatever the device and input (torch.float32 forces float32,
      also for float64 input);
    - "auto" (the optimizers' default): torch.bfloat16 on CUDA, float32 on any other device
      (on CPUs without bf16 units bf16 products are ~50-100× slower than float32). float64
      input stays float64 on every device: asking for float64 parameters asks for float64;
    - None (`newton_schulz`'s default, and what it meant before "auto"): float32 on every
      device, float64 input stays float64.

    A bad `requested` raises ValueError (TypeError for the wrong type) naming `name`.
    """
    check_dtype_or_auto(name, requested)
    if isinstance(requested, torch.dtype):
        return requested
    if input_dtype == torch.float64:
        return torch.float64
    if requested == "auto" and torch.device(device).type == "cuda":
        return torch.bfloat16
    return torch.float32


def newton_schulz(
    X: Tensor,
    steps: int = NS_STEPS,
    coefficients: CoefficientsLike = "quintic",
    eps: float = 1e-7,
    dtype: NSDtype = None,
    check_finite: bool = True,
) -> Tensor:
    """Approximate the polar factor U·Vᵀ of each matrix in `X` (shape [..., m, n]).

    Each matrix is transposed so rows <= columns and divided by its Frobenius norm (clamped
    below by `eps`, so a zero matrix maps to zero). The iteration runs in `dtype`
    (`resolve_ns_dtype`): default None is float32 on every device (float64 input stays
    float64), so the engine's result does not depend on where it runs; "auto" is the
    optimizers' default, bfloat16 on CUDA; a torch dtype forces it. The result comes back in
    the input's shape and dtype. Non-finite input raises ValueError (one host read);
    `check_finite=False` skips that read for callers whose input is checked already (the
    optimizers check the gradients), and a NaN or Inf then comes out as NaN.
    """
    if X.ndim < 2:
        raise ValueError(
            f"newton_schulz needs a matrix or a batch of matrices, got shape {tuple(X.shape)}"
        )
    schedule = _schedule(coefficients, steps)
    check_positive("eps", eps)
    compute = resolve_ns_dtype(dtype, X.device, X.dtype, name="dtype")
    transposed = X.shape[-2] > X.shape[-1]
    Y = X.mT if transposed else X
    norm = _frobenius_norms(
        Y, torch.float64 if compute == torch.float64 else torch.float32, check_finite
    )
    norm = norm.clamp_min(eps)
    out = torch.empty_like(X, memory_format=torch.contiguous_format)
    m, n = Y.shape[-2:]
    k = math.prod(Y.shape[:-2])  # not reshape(-1, m, n): ambiguous for an empty matrix
    Ys, norms = Y.reshape(k, m, n), norm.reshape(k, 1, 1)
    outs = (out.mT if transposed else out).reshape(k, m, n)
    if Ys.shape[0] > 1 and stacking_pays(X.device):
        pieces: Iterable[tuple[Tensor, Tensor, Tensor]] = [(Ys, norms, outs)]
    else:
        pieces = zip(Ys.unbind(), norms.unbind(), outs.unbind())
    for Yp, normp, target in pieces:
        if compute == torch.promote_types(Yp.dtype, normp.dtype):
            Z = Yp / normp
        else:  # divide in float32 and round once, in one pass, into a contiguous buffer
            Z = torch.div(Yp, normp, out=torch.empty(Yp.shape, dtype=compute, device=Yp.device))
        into = target if target.dtype == compute else None  # else written with a cast below
        syrk = kernels.syrk_for(Z)
        if kernels.gram_form_pays(Z):
            Z = newton_schulz_gram_form(Z, schedule, syrk, out=into)
        else:
            for a, b, c in schedule[:-1]:
                Z = newton_schulz_step(Z, a, b, c, syrk)
            Z = newton_schulz_step(Z, *schedule[-1], syrk, out=into)
        if into is None:
            target.copy_(Z)
    return out


def _schedule(coefficients: CoefficientsLike, steps: int) -> Sequence[Coefficients]:
    """`coefficient_schedule`, resolved once per (set name, steps): Muon asks every call
    (a compiled step resolves it once, while tracing, without the cache)."""
    if isinstance(coefficients, str) and not torch.compiler.is_compiling():
        return _named_schedule(coefficients, steps)
    return coefficient_schedule(coefficients, steps)


@functools.cache
def _named_schedule(name: str, steps: int) -> tuple[Coefficients, ...]:
    return tuple(coefficient_schedule(name, steps))


def stacking_pays(device: torch.device) -> bool:
    """Whether a batch of matrices on `device` should go through Newton-Schulz stacked.

    On CPU no: batched products were no faster than a loop of 2-D ones, and a whole batch
    streams through memory at every product (at 1 thread, one at a time vs the whole batch:
    48×768² 9.1 s vs 10.3 s, 24×768×3072 9.8 s vs 11.2 s, 8×128×512 19 ms vs 23 ms), so
    neither stacking the blocks (`Muon`) nor running them together (`newton_schulz`) pays.
    On GPUs yes, for occupancy.
    """
    return device.type != "cpu"


# The default of Muon's `ns_batch_mb`: the most float32 MiB of matrices one stacked
# Newton-Schulz call takes (`batch_limit`). Measured on CPU, estimated for GPUs:
# - CPU (fp32, one thread, the batched path forced, process CPU time, best of 5 interleaved
#   rounds): 64 × 512² as one stack 2.16 s, in chunks of 16 MiB 1.85 s, of 1 MiB (one
#   matrix) 1.60 s; 16 × 768×3072 as one stack (144 MiB) 2.78 s, chunks of 36 MiB 2.41 s, of
#   9 MiB (one) 2.23 s. Chunks are never slower here (a smaller one stays in cache), so on
#   CPU any cap costs nothing (and the optimizers do not stack there: `stacking_pays`).
# - GPU (H200, bf16 iteration, ≈780 TFLOP/s): a product of a 1 GiB chunk is ≈1 TFLOP for
#   the 18 2048×7168 matrices it holds (kimi-k2's experts), ≈1.4 ms, against a few µs to
#   launch each of its ~20 kernels, so splitting a stack costs < 1 %; one such matrix
#   already fills the GPU (256 output tiles of 128² for 132 SMs), and 1 GiB of smaller
#   ones is many (1024 of 512²). The chunk's own memory: its fp32 stack and output, 2 GiB,
#   and the bf16 iteration's, about 1 GiB.
NS_BATCH_MB = 1024.0


def batch_limit(rows: int, cols: int, ns_batch_mb: float | None) -> int | None:
    """The most rows×cols matrices one stacked Newton-Schulz call takes under the cap
    `ns_batch_mb` (MiB of float32 matrices, whatever dtype the iteration runs in): at least
    one; None (no cap) for None."""
    if ns_batch_mb is None:
        return None
    return max(1, math.floor(ns_batch_mb * 2**20 / (rows * cols * 4)))


Span = tuple[int, int, int]  # (block, its first matrix in the chunk, how many)


def batch_chunks(sizes: Sequence[int], limit: int | None) -> list[list[Span]]:
    """Blocks of `sizes` matrices, one after the other, in consecutive chunks of at most
    `limit` matrices (None: one chunk): per chunk its spans (block index, first matrix of the
    block in it, count). A block is cut only where a chunk is full; an empty one rides along
    in the chunk at hand."""
    if limit is None:
        return [[(e, 0, k) for e, k in enumerate(sizes)]]
    chunks: list[list[Span]] = [[]]
    room = limit
    for e, k in enumerate(sizes):
        if k == 0:
            chunks[-1].append((e, 0, 0))
        first = 0
        while first < k:
            if room == 0:
                chunks.append([])
                room = limit
            take = min(room, k - first)
            chunks[-1].append((e, first, take))
            first += take
            room -= take
    return chunks


def _matmul_into(
    P: Tensor, Q: Tensor, C: Tensor | None = None, beta: float = 1.0, out: Tensor | None = None
) -> Tensor:
    """beta·C + P·Q for 2-D or 3-D operands (C None: P·Q), into `out` when given.

    An `out` that is the transpose of a contiguous buffer (a tall matrix's result) gets the
    transposed product Qᵀ·Pᵀ written straight into that buffer, instead of a temporary and
    a copy.
    """
    if out is not None and not out.is_contiguous() and out.mT.is_contiguous():
        _matmul_into(Q.mT, P.mT, None if C is None else C.mT, beta, out.mT)
        return out
    return syrk_cpu.product(P, Q.mT, C, beta, 1.0, out=out)


def squared_frobenius(Y: Tensor, dtype: torch.dtype) -> Tensor:
    """The sum of squares of each matrix of Y ([..., m, n] → [..., 1, 1]), summed in `dtype`
    (the iteration's norm dtype: float32, float64 for a float64 iteration).

    Not `torch.linalg.matrix_norm`: on CPU its float32 reduction loses digits on large
    matrices. Measured (torch 2.13 CPU, 1 thread, 2048×2048 float32, against float64):
    matrix_norm and vector_norm 8.8e-5 relative off in 0.5 ms; `square().sum()` 4.5e-8 off in
    1.4 ms; vector_norm(dtype=float64) exact but 18 ms; vecdot 3.1e-5 (einsum 8.8e-5). So the
    sum of squares, in float32 on every device: no float64 on a GPU's bf16 hot path (whose
    reductions are tree-shaped anyway), at the cost of one temporary the size of Y.
    """
    Z = Y.to(dtype)
    sq = Z.square_() if Z is not Y else Z.square()  # a fresh cast is squared in place
    return sq.sum(dim=(-2, -1), keepdim=True)


def _frobenius_norms(Y: Tensor, dtype: torch.dtype, check_finite: bool = True) -> Tensor:
    """Frobenius norm of each matrix of Y ([..., m, n] → [..., 1, 1]) in `dtype`, the square
    root of `squared_frobenius`; a finite matrix whose sum of squares overflows gets the norm
    of a copy rescaled by its largest entry.

    `check_finite`: raise ValueError on NaN or Inf entries, at one host read (a scalar riding
    on the norm; only a non-finite norm costs a second look). Without it nothing is read:
    the rescaled norm is computed for every matrix and chosen on the device. Under
    `torch.compile` nothing is read either: the sum of squares is accumulated in float64 (no
    float32 or narrower matrix overflows it) and non-finite entries give a non-finite norm
    (the optimizers' compiled step has already flagged a non-finite gradient, the only way
    to get one, and discards that step).
    """
    if torch.compiler.is_compiling():
        return torch.linalg.matrix_norm(Y.to(torch.float64), keepdim=True).to(dtype)
    norm = squared_frobenius(Y, dtype).sqrt_()
    if 0 in Y.shape[-2:]:  # empty matrices (a tensor-parallel rank's empty shard): norm 0
        return norm
    if check_finite:
        if math.isfinite(float(host.read(norm.sum(), "newton_schulz input check"))):
            return norm
        if not bool(host.read(torch.isfinite(Y).all(), "newton_schulz input check")):
            raise ValueError("newton_schulz got a matrix with NaN or Inf entries")
    peak = Y.abs().amax(dim=(-2, -1), keepdim=True).to(dtype).clamp_min(torch.finfo(dtype).tiny)
    rescued = peak * squared_frobenius(Y.to(dtype) / peak, dtype).sqrt_()
    return rescued if check_finite else torch.where(torch.isfinite(norm), norm, rescued)


def newton_schulz_step(
    X: Tensor,
    a: float,
    b: float,
    c: float,
    syrk: kernels.Syrk | None = None,
    out: Tensor | None = None,
) -> Tensor:
    """One step X ← a·X + (b·A + c·A·A)·X with A = X·Xᵀ, on [..., m, n] with m <= n.

    `syrk` is the symmetric-product implementation (default: `kernels.syrk_for(X)`); `out`
    (2-D or 3-D X only) receives the result.
    """
    syrk = syrk or kernels.syrk_for(X)
    A = syrk(X, None, 0.0, 1.0)
    B = syrk(A, A, b, c)
    if X.ndim <= 3:
        return _matmul_into(B, X, X, a, out)
    lead = X.shape[:-2]
    Xf = X.flatten(0, -3)
    step = torch.baddbmm(Xf, B.flatten(0, -3), Xf, beta=a)
    return step.reshape(*lead, *X.shape[-2:])


def newton_schulz_gram_form(
    X: Tensor,
    schedule: Sequence[Coefficients],
    syrk: kernels.Syrk | None = None,
    out: Tensor | None = None,
) -> Tensor:
    """The same iteration run on the m×m Gram matrix, for wide X ([..., m, n], n >= 2m).

    Every step multiplies X by Q_k = a·I + b·A_k + c·A_k², a polynomial in A_k = X_k·X_kᵀ, so
    over a run of steps X ← R·X with R = ···Q_1·Q_0 and A_{k+1} = (A_k·Q_k)·Q_k. These are
    all polynomials in one Gram matrix: they commute, so every m×m product is symmetric and
    computes one triangle (`kernels.sym_matmul_for`). Only the Gram and R·X touch n: per run
    of GRAM_FORM_RESTART steps ≈ 3m²n + 4·steps·m³ flops instead of steps·(3m²n + m³).
    `syrk` and `out` as in `newton_schulz_step`.
    """
    syrk = syrk or kernels.syrk_for(X)
    sym_matmul = kernels.sym_matmul_for(X)
    for start in range(0, len(schedule), GRAM_FORM_RESTART):
        last = start + GRAM_FORM_RESTART >= len(schedule)
        run = schedule[start : start + GRAM_FORM_RESTART]
        X = gram_form_run(X, run, syrk, sym_matmul, out=out if last else None)
    return X


def gram_form_run(
    X: Tensor,
    run: Sequence[Coefficients],
    syrk: kernels.Syrk,
    sym_matmul: kernels.SymMatmul,
    A: Tensor | None = None,
    out: Tensor | None = None,
) -> Tensor:
    """One run of L steps of the Gram form on X ([..., m, n]): R·X with R = Q_{L−1}···Q_0,
    Q_k = a·I + b·A_k + c·A_k² and A_{k+1} = (A_k·Q_k)·Q_k from A_0 = A (default X·Xᵀ; the
    tensor-parallel gram mode passes the Gram summed over its ranks). `out` as in
    `newton_schulz_step`. The single-device Gram form and the tensor-parallel gram mode both
    run it."""
    if A is None:
        A = syrk(X, None, 0.0, 1.0)
    R: Tensor | None = None
    for k, (a, b, c) in enumerate(run):
        Q = syrk(A, A, b, c)
        Q.diagonal(dim1=-2, dim2=-1).add_(a)
        R = Q if R is None else sym_matmul(Q, R)
        if k < len(run) - 1:
            A = sym_matmul(sym_matmul(A, Q), Q)
    assert R is not None
    return _matmul_into(R, X, out=out)


def polar_factor(X: Tensor) -> Tensor:
    """Exact polar factor U·Vᵀ of each matrix in `X` via a float64 SVD (returns float64).

    The reference for tests. A zero matrix maps to zero; rank-deficient matrices get the
    partial isometry over their numerical range (singular values below 1e-12·σ_max dropped).
    """
    X64 = X.detach().to(torch.float64)
    U, S, Vh = torch.linalg.svd(X64, full_matrices=False)
    keep = (1e-12 * S.amax(dim=-1, keepdim=True).clamp_min(1e-300) < S).to(torch.float64)
    return (U * keep.unsqueeze(-2)) @ Vh
