"""Triton SYRK for CUDA: beta·C + alpha·X·Xᵀ for X [B, m, n], computing one triangle.

The m×m result is cut into BLOCK_N×BLOCK_N super-tiles; only those on or below the diagonal
are computed (T(T+1)/2 of T² for T = ⌈m/BLOCK_N⌉). A program computes one BLOCK_M×BLOCK_N
tile (BLOCK_N is BLOCK_M or 2·BLOCK_M: the 128×256 tile keeps Hopper's tensor cores busier
than 128×128), stores it, and stores its transpose at the mirrored place when the super-tile
is off the diagonal. Diagonal super-tiles are computed whole and stored once, so no element
is written twice. Accumulation is in float32; the `b·A + c·A·A` epilogue of Newton-Schulz
(`C` given) is fused, reading only the tiles it writes.

Launch order (`SyrkConfig`): tiles are taken in bands of `group` super-tile rows, column by
column inside a band, so the programs running together share the blocks of X they read
(L2); `persistent` launches one program per SM that walks the tiles, the batch included.
Loads go through TMA tensor descriptors (`triton.tools.tensor_descriptor`, triton >= 3.4) on
Hopper and later when the strides allow (16-byte aligned), else through masked pointers.

Imported lazily by `orthoptim.kernels` (triton is an optional extra: `pip install .[triton]`).
Runs on CPU tensors under `TRITON_INTERPRET=1` (tests; float32 only, the interpreter's bf16
is unreliable).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence

import torch
import triton
import triton.language as tl
from torch import Tensor

from orthoptim.kernels import syrk_cpu, tuning
from orthoptim.kernels.tuning import SyrkConfig, default_config

try:
    from triton.tools.tensor_descriptor import TensorDescriptor
except ImportError:  # triton < 3.4: pointer loads only
    TensorDescriptor = None


@triton.jit
def _tri(t):
    """Row-major lower-triangle index t -> (i, j), j <= i: i = ⌊(√(8t+1) − 1)/2⌋, corrected
    by one either way for float rounding."""
    i = ((tl.sqrt(8.0 * t.to(tl.float32) + 1.0) - 1.0) * 0.5).to(tl.int32)
    i = tl.where((i + 1) * (i + 2) // 2 <= t, i + 1, i)
    i = tl.where(i * (i + 1) // 2 > t, i - 1, i)
    return i, t - i * (i + 1) // 2


@triton.jit
def _super_tile(t, T, GROUP: tl.constexpr):
    """The t-th lower-triangle super-tile (i, j) of a T×T grid, taken in bands of GROUP rows,
    column by column inside a band (GROUP = 1: plain row-major)."""
    if GROUP == 1:
        i, j = _tri(t)
    else:
        # Bands start where row-major rows do: the band is the row-major row's band.
        row, _ = _tri(t)
        r0 = (row // GROUP) * GROUP
        g = tl.minimum(T - r0, GROUP)
        local = t - r0 * (r0 + 1) // 2
        if local < r0 * g:  # the band's full columns left of its own triangle
            j = local // g
            i = r0 + local % g
        else:
            # Its g×g triangle column by column is the row-major order reversed and mirrored.
            u = g * (g + 1) // 2 - 1 - (local - r0 * g)
            a, b = _tri(u)
            i = r0 + g - 1 - b
            j = r0 + g - 1 - a
    return i, j


@triton.jit
def _place(tile, T, SPLIT: tl.constexpr, GROUP: tl.constexpr, BLOCK_M: tl.constexpr):
    """Tile index within one matrix -> (row start, column start, on the diagonal)."""
    i, j = _super_tile(tile // SPLIT, T, GROUP)
    row = (i * SPLIT + tile % SPLIT) * BLOCK_M
    return row, j * SPLIT * BLOCK_M, i == j


@triton.jit
def _syrk_kernel(
    X,
    C,
    OUT,
    xa_desc,
    xb_desc,
    c_desc,
    o_desc,
    ot_desc,
    B,
    M,
    K,
    stride_xb,
    stride_xm,
    stride_xk,
    stride_cb,
    stride_cm,
    stride_cn,
    stride_ob,
    stride_om,
    stride_on,
    alpha,
    beta,
    HAS_C: tl.constexpr,
    USE_TMA: tl.constexpr,
    PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP: tl.constexpr,
):
    """With USE_TMA the *_desc descriptors load and store (X, C, OUT unused), else masked
    pointers do (the descriptors are None)."""
    SPLIT: tl.constexpr = BLOCK_N // BLOCK_M
    T = tl.cdiv(M, BLOCK_N)
    per_matrix = T * (T + 1) // 2 * SPLIT
    for t in tl.range(tl.program_id(0), B * per_matrix, tl.num_programs(0)):
        batch = t // per_matrix
        row0, col0, diagonal = _place(t % per_matrix, T, SPLIT, GROUP, BLOCK_M)
        if row0 < M:
            rows = row0 + tl.arange(0, BLOCK_M)
            cols = col0 + tl.arange(0, BLOCK_N)
            x_base = X + batch * stride_xb
            acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            for k0 in range(0, K, BLOCK_K):
                if USE_TMA:
                    a = xa_desc.load([batch, row0, k0]).reshape(BLOCK_M, BLOCK_K)
                    b = xb_desc.load([batch, col0, k0]).reshape(BLOCK_N, BLOCK_K)
                else:
                    kk = k0 + tl.arange(0, BLOCK_K)
                    a = tl.load(
                        x_base + rows[:, None] * stride_xm + kk[None, :] * stride_xk,
                        mask=(rows[:, None] < M) & (kk[None, :] < K),
                        other=0.0,
                    )
                    b = tl.load(
                        x_base + cols[:, None] * stride_xm + kk[None, :] * stride_xk,
                        mask=(cols[:, None] < M) & (kk[None, :] < K),
                        other=0.0,
                    )
                acc = tl.dot(a, tl.trans(b), acc, input_precision=PRECISION)
            acc = acc * alpha
            mask = (rows[:, None] < M) & (cols[None, :] < M)
            if HAS_C:
                if USE_TMA:
                    c = c_desc.load([batch, row0, col0]).reshape(BLOCK_M, BLOCK_N)
                else:
                    c = tl.load(
                        C
                        + batch * stride_cb
                        + rows[:, None] * stride_cm
                        + cols[None, :] * stride_cn,
                        mask=mask,
                        other=0.0,
                    )
                acc = acc + beta * c.to(tl.float32)
            out = acc.to(OUT.dtype.element_ty)
            if USE_TMA:
                o_desc.store([batch, row0, col0], out.reshape(1, BLOCK_M, BLOCK_N))
                if not diagonal:
                    ot_desc.store([batch, col0, row0], tl.trans(out).reshape(1, BLOCK_N, BLOCK_M))
            else:
                o_base = OUT + batch * stride_ob
                tl.store(
                    o_base + rows[:, None] * stride_om + cols[None, :] * stride_on, out, mask=mask
                )
                if not diagonal:
                    tl.store(
                        o_base + cols[:, None] * stride_om + rows[None, :] * stride_on,
                        tl.trans(out),
                        mask=(cols[:, None] < M) & (rows[None, :] < M),
                    )


@functools.cache
def _sm_count(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def _hopper_or_later(device: torch.device) -> bool:
    return device.type == "cuda" and torch.cuda.get_device_capability(device)[0] >= 9


def tma_usable(X: Tensor, C: Tensor | None = None) -> bool:
    """Whether the TMA kernel can serve X (and C): triton with tensor descriptors, a Hopper or
    later GPU, contiguous operands with 16-byte aligned rows and bases."""
    if TensorDescriptor is None or not _hopper_or_later(X.device) or X.shape[-1] == 0:
        return False
    for T in (X, C):
        if T is None:
            continue
        if not T.is_contiguous() or (T.shape[-1] * T.element_size()) % 16 or T.data_ptr() % 16:
            return False
    return (X.shape[-2] * X.element_size()) % 16 == 0  # the result's rows


def _precision(X: Tensor) -> str:
    if X.dtype == torch.float32 and torch.get_float32_matmul_precision() != "highest":
        return "tf32"
    return "ieee"


def syrk(
    X: Tensor,
    C: Tensor | None = None,
    beta: float = 0.0,
    alpha: float = 1.0,
    config: SyrkConfig | None = None,
    tma: bool | None = None,
) -> Tensor:
    """beta·C + alpha·X·Xᵀ for X [..., m, n] and symmetric C [..., m, m] (or None).

    Only the tiles of C on or below the diagonal are read. `config` picks tiles and launch
    order (default `tuning.default_config`); `tma` forces the descriptor kernel on or off
    (default: wherever `tma_usable`).
    """
    if X.ndim < 2:
        raise ValueError(f"syrk needs X of shape [..., m, n], got {tuple(X.shape)}")
    m, n = X.shape[-2:]
    lead = X.shape[:-2]
    X3 = X.reshape(-1, m, n)
    out = torch.empty((X3.shape[0], m, m), dtype=X.dtype, device=X.device)
    if C is not None:
        if C.shape != (*lead, m, m):
            raise ValueError(f"C must have shape {(*lead, m, m)}, got {tuple(C.shape)}")
        C3 = C.reshape(-1, m, m)
    else:
        C3 = out  # never read: HAS_C is False
    if m == 0 or X3.shape[0] == 0:
        return out.reshape(*lead, m, m)
    cfg = config or default_config(X.dtype)
    if cfg.block_n not in (cfg.block_m, 2 * cfg.block_m):
        raise ValueError(f"block_n must be block_m or 2*block_m, got {cfg}")
    supers = triton.cdiv(m, cfg.block_n)
    tiles = X3.shape[0] * supers * (supers + 1) // 2 * (cfg.block_n // cfg.block_m)
    programs = tiles
    if cfg.persistent:  # off CUDA (the interpreter) as if on one SM, to exercise the walk
        sms = _sm_count(X.device.index or 0) if X.is_cuda else 1
        programs = min(tiles, sms * cfg.programs_per_sm)
    use_tma = tma_usable(X3, C3 if C is not None else None) if tma is None else tma
    descs: list[object] = [None] * 5
    if use_tma:
        if TensorDescriptor is None:
            raise RuntimeError(
                "the TMA kernel needs triton >= 3.4 (triton.tools.tensor_descriptor)"
            )
        bm, bn, bk = cfg.block_m, cfg.block_n, cfg.block_k
        descs = [
            TensorDescriptor(T, list(T.shape), list(T.stride()), block)
            for T, block in (
                (X3, [1, bm, bk]),
                (X3, [1, bn, bk]),
                (C3, [1, bm, bn]),
                (out, [1, bm, bn]),
                (out, [1, bn, bm]),
            )
        ]
    _syrk_kernel[(programs,)](
        X3,
        C3,
        out,
        *descs,
        X3.shape[0],
        m,
        n,
        *X3.stride(),
        *C3.stride(),
        *out.stride(),
        float(alpha),
        float(beta),
        HAS_C=C is not None,
        USE_TMA=use_tma,
        PRECISION=_precision(X),
        BLOCK_M=cfg.block_m,
        BLOCK_N=cfg.block_n,
        BLOCK_K=cfg.block_k,
        GROUP=cfg.group,
        num_warps=cfg.warps,
        num_stages=cfg.stages,
    )
    return out.reshape(*lead, m, m)


def tune(
    X: Tensor,
    C: Tensor | None,
    configs: Sequence[SyrkConfig] | None = None,
    timer: tuning.Timer | None = None,
) -> tuple[tuning.Choice, dict[str, float]]:
    """Time the plain product and every config on beta·C + alpha·X·Xᵀ; return the fastest and
    all timings (ms, by `SyrkConfig.name`, "matmul" for the plain product). A config that fails
    to compile or run is left out of the race, its error recorded as NaN."""
    timer = timer or (tuning.cuda_timer if X.is_cuda else tuning.wall_timer)
    configs = tuning.candidates(X.shape[-2], X.dtype) if configs is None else configs
    beta, alpha = (0.5, -1.5) if C is not None else (0.0, 1.0)
    timings = {tuning.MATMUL: timer(lambda: syrk_cpu.syrk_matmul(X, C, beta, alpha))}
    by_name: dict[str, tuning.Choice] = {tuning.MATMUL: tuning.MATMUL}
    for cfg in configs:
        try:
            timings[cfg.name] = timer(lambda cfg=cfg: syrk(X, C, beta, alpha, cfg))
            by_name[cfg.name] = cfg
        except Exception:  # a config this GPU or triton cannot build is not a candidate
            timings[cfg.name] = math.nan
    best = min(by_name, key=timings.__getitem__)
    return by_name[best], timings
