"""What orthogonalizing one matrix costs: its Newton-Schulz path, flops and transient bytes.

The one home of these rules, below everything that runs or prices Newton-Schulz: the
iteration itself (`newton_schulz`), the kernel dispatch (`kernels`, which feeds the path rule
its measured CPU path), the owner balancing (`parallel.assignment.MatrixCost`), the
tensor-parallel modes, the planner and the benchmarks. Pure functions of shapes and dtypes;
nothing here touches a tensor.

A *path* is (form, backend): form "step" (the plain iteration) or "gram" (the iteration on
the m×m Gram matrix, `newton_schulz_gram_form`, for wide float32/float64 matrices); backend
"matmul", "cpu_syrk" (the blocked SYRK) or "triton" (the CUDA dispatch between a Triton SYRK
and torch's product).
"""

from __future__ import annotations

import functools
import sys
from typing import Literal

import torch

#: the default number of Newton-Schulz steps (Muon's `ns_steps`, `newton_schulz`'s `steps`,
#: the tensor-parallel orthogonalizer's, the planner's and the benchmarks')
NS_STEPS = 5
# Steps the Gram form takes before recomputing X and its Gram (rounding in A_k compounds:
# without a restart the singular vectors of a 5-step float32 run drift ~100x further).
GRAM_FORM_RESTART = 3

# The CPU paths (`kernels.calibration` races them): "matmul" and "cpu_syrk" the plain
# iteration with general products or the blocked SYRK, "gram_form" and "gram_form_syrk" the
# Gram form with either.
PathName = Literal["matmul", "cpu_syrk", "gram_form", "gram_form_syrk"]
PATHS: tuple[PathName, ...] = ("matmul", "cpu_syrk", "gram_form", "gram_form_syrk")
SYRK_PATHS = ("cpu_syrk", "gram_form_syrk")
GRAM_PATHS = ("gram_form", "gram_form_syrk")
# The Gram form is a candidate for float32/float64 from this aspect (columns / rows) on: below
# it the step form needs fewer flops.
GRAM_FORM_ASPECT = 2.0
# The shape-only CPU rules without a measurement (`cpu_default_path`): the blocked SYRK and
# the Gram form serve no shape until measured faster on this machine, so both thresholds are
# "never". On the AVX2 EPYC machines they were 512 rows for the SYRK and 128 rows (aspect 2.5)
# for the Gram form; on an AVX-512 Xeon the same rules made a Muon step 0.3x the plain
# product's speed, hence `kernels.calibration`.
CPU_SYRK_MIN_ROWS = sys.maxsize
GRAM_FORM_MIN_ROWS_CPU = sys.maxsize
GRAM_FORM_ASPECT_SMALL = 2.5

NSForm = Literal["step", "gram"]
NSBackend = Literal["matmul", "cpu_syrk", "triton"]
NSPath = tuple[NSForm, NSBackend]
PLAIN: NSPath = ("step", "matmul")

_CPU_DTYPES = (torch.float32, torch.float64)  # the CPU SYRK's and the Gram form's
_CUDA_DTYPES = (torch.float16, torch.bfloat16, torch.float32)  # the Triton SYRK's
DTYPE_NAMES: dict[str, torch.dtype] = {
    "bf16": torch.bfloat16,
    "bfloat16": torch.bfloat16,
    "fp16": torch.float16,
    "float16": torch.float16,
    "fp32": torch.float32,
    "float32": torch.float32,
    "fp64": torch.float64,
    "float64": torch.float64,
}


def gram_runs(steps: int) -> list[int]:
    """The lengths of the runs of steps between the restarts of the Gram form
    (GRAM_FORM_RESTART steps each, the last what is left)."""
    return [min(GRAM_FORM_RESTART, steps - s) for s in range(0, steps, GRAM_FORM_RESTART)]


def cpu_default_path(rows: int, cols: int) -> PathName:
    """The CPU path of a float32/float64 rows×cols matrix from its shape alone, where nothing
    was measured (`kernels.calibration` decides otherwise): the thresholds above."""
    m, n = sorted((int(rows), int(cols)))
    if m >= CPU_SYRK_MIN_ROWS:
        return "gram_form_syrk"
    if m >= GRAM_FORM_MIN_ROWS_CPU and n >= GRAM_FORM_ASPECT_SMALL * m:
        return "gram_form"
    return "matmul"


def ns_path(
    rows: int,
    cols: int,
    device: str = "cuda",
    dtype: torch.dtype | str = "auto",
    triton: bool = True,
    kernel_mode: Literal["auto", "matmul"] = "auto",
    cpu_path: PathName | None = None,
) -> NSPath:
    """(form, backend) that `newton_schulz` takes for one rows×cols matrix (either way round).

    The one rule `kernels.backend_for` / `kernels.gram_form_pays` apply to a tensor. `dtype`
    is the iteration's ("auto": bf16 on CUDA, fp32 elsewhere, Muon's default; a name such as
    "bf16" or a torch dtype); `triton`: whether Triton is installed on a CUDA device;
    `kernel_mode` "matmul" is `ORTHOPTIM_KERNELS=matmul` (plain matmul everywhere); `cpu_path`
    the CPU path decided for the shape class (None: `cpu_default_path`, unmeasured). On CPU
    a SYRK path takes the blocked SYRK and a Gram path the Gram form where it applies
    (n >= GRAM_FORM_ASPECT·m); elsewhere the Gram form serves every wide float32/float64
    matrix. Half precision keeps the step form (the Gram form squares the condition number).
    Not cached: the kernels apply it to every product, under `torch.compile` too.
    """
    m, n = sorted((int(rows), int(cols)))
    dev = torch.device(device).type
    if dtype == "auto":
        dt = torch.bfloat16 if dev == "cuda" else torch.float32
    else:
        dt = DTYPE_NAMES[dtype] if isinstance(dtype, str) else dtype
    if kernel_mode == "matmul":
        return PLAIN
    wide = dt in _CPU_DTYPES and n >= GRAM_FORM_ASPECT * m
    if dev == "cpu":
        if dt not in _CPU_DTYPES:
            return PLAIN
        path = cpu_default_path(m, n) if cpu_path is None else cpu_path
        backend: NSBackend = "cpu_syrk" if path in SYRK_PATHS else "matmul"
        return ("gram" if wide and path in GRAM_PATHS else "step"), backend
    backend = "triton" if dev == "cuda" and triton and dt in _CUDA_DTYPES else "matmul"
    return ("gram" if wide else "step"), backend


@functools.lru_cache(maxsize=4096)
def ns_flops(rows: int, cols: int, steps: int = NS_STEPS, path: NSPath = PLAIN) -> float:
    """Flops of `steps` Newton-Schulz iterations on one rows×cols matrix along `path`
    (`ns_path`; default the plain matmul iteration), with m ≤ n its short and long side:

    - plain matmul: steps·(4m²n + 2m³);
    - SYRK backends compute one triangle of X·Xᵀ and of b·A + c·A·A: steps·(3m²n + m³);
    - Gram form, per run of r ≤ GRAM_FORM_RESTART steps: the Gram of X, r polynomials
      Q = b·A + c·A·A (+a·I), 3(r−1) products of m×m polynomials in A, and X ← R·X. The
      Gram and Q are half on a SYRK backend, the m×m products half on "cpu_syrk" only (on
      CUDA they are plain matmuls): 5 CPU steps ≈ 6m²n + 14m³.
    """
    form, backend = path
    m, n = sorted((int(rows), int(cols)))
    half = 1 if backend != "matmul" else 2
    gram, poly = half * m * m * n, half * m**3
    if form == "step":
        return float(steps * (gram + poly + 2 * m * m * n))
    product = (1 if backend == "cpu_syrk" else 2) * m**3
    total = 0
    for r in gram_runs(steps):
        total += gram + 2 * m * m * n + r * poly + 3 * (r - 1) * product
    return float(total)


def iterate_bytes(form: NSForm, x: int, square: int, steps: int, into_out: bool) -> int:
    """Peak bytes of the iteration on a batch whose X takes `x` bytes and each of its m×m
    matrices `square`, on `form`; the last step writes into the output when the dtypes agree
    (`into_out`).

    - "step": X, A = X·Xᵀ, B = b·A + c·A·A and the next X.
    - "gram" (runs of GRAM_FORM_RESTART steps): the input X (kept by the caller) and, after
      the first run, the X it made; the m×m matrices of a run (A, Q, R and the two products
      A·Q·Q in flight: 5 from its second step on when a third follows, 4 in a run of two, 2
      in a run of one; 4 when a run starts while the last one's A, Q, R are alive); and R·X
      made afresh except in the last run when it writes into the output. `gram_form_run`
      releases a run's matrices when it returns, so that "4 when a run starts" is an upper
      bound; it can only count in a run of one step after another run (4, 7, ... steps),
      never at the default 5.
    """
    if form == "step":
        return (x if steps == 1 and into_out else 2 * x) + 2 * square
    runs = gram_runs(steps)
    peak = 0
    for j, r in enumerate(runs):
        held = x if j == 0 else 2 * x
        squares = 5 if r >= 3 else (4 if r == 2 else 2)
        if j:
            squares = max(squares, 4 if runs[j - 1] >= 2 else 3)
        peak = max(peak, held + squares * square)
        if j < len(runs) - 1 or not into_out:
            peak = max(peak, held + x + 3 * square)
    return peak
