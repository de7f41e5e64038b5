"""Triton SYRK for CUDA: beta·C + alpha·X·Xᵀ launching only the tiles on or below the diagonal.

Each program computes one BLOCK×BLOCK tile (i, j) with j <= i of the m×m result and stores it
twice: at (i, j) and, transposed, at (j, i). For T = ⌈m/BLOCK⌉ tile rows that is T(T+1)/2
programs instead of T², about half the work of a general product. Accumulation is in float32;
float32 inputs use TF32 only when torch's float32 matmul precision allows it.

Imported lazily by `orthoptim.kernels` (triton is an optional extra: `pip install .[triton]`).
Runs on CPU tensors under `TRITON_INTERPRET=1` (tests; float32 only, the interpreter's bf16
is unreliable).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

# Tile sizes: 128×128×64 with 8 warps for 16-bit inputs on a GPU (tensor-core friendly),
# 64×64×32 otherwise (float32, and the interpreter). Untuned: set block/block_k to override.
BLOCK = 64
BLOCK_K = 32


@triton.jit
def _syrk_kernel(
    X,
    C,
    OUT,
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
    PRECISION: tl.constexpr,
    BLOCK: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    pid = tl.program_id(0)
    batch = tl.program_id(1)
    # Lower-triangular tile index pid -> (i, j), j <= i: i = floor((sqrt(8·pid+1) − 1)/2),
    # corrected by one either way for float rounding.
    i = ((tl.sqrt(8.0 * pid.to(tl.float32) + 1.0) - 1.0) * 0.5).to(tl.int32)
    i = tl.where((i + 1) * (i + 2) // 2 <= pid, i + 1, i)
    i = tl.where(i * (i + 1) // 2 > pid, i - 1, i)
    j = pid - i * (i + 1) // 2

    rows = i * BLOCK + tl.arange(0, BLOCK)
    cols = j * BLOCK + tl.arange(0, BLOCK)
    ks = tl.arange(0, BLOCK_K)
    x_base = X + batch * stride_xb
    acc = tl.zeros((BLOCK, BLOCK), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        kk = k0 + ks
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
    tile_mask = (rows[:, None] < M) & (cols[None, :] < M)
    if HAS_C:
        c = tl.load(
            C + batch * stride_cb + rows[:, None] * stride_cm + cols[None, :] * stride_cn,
            mask=tile_mask,
            other=0.0,
        )
        acc = acc + beta * c.to(tl.float32)
    out = acc.to(OUT.dtype.element_ty)
    o_base = OUT + batch * stride_ob
    tl.store(o_base + rows[:, None] * stride_om + cols[None, :] * stride_on, out, mask=tile_mask)
    if j != i:
        tl.store(
            o_base + cols[:, None] * stride_om + rows[None, :] * stride_on,
            tl.trans(out),
            mask=(cols[:, None] < M) & (rows[None, :] < M),
        )


def syrk(
    X: Tensor,
    C: Tensor | None = None,
    beta: float = 0.0,
    alpha: float = 1.0,
    block: int | None = None,
    block_k: int | None = None,
) -> Tensor:
    """beta·C + alpha·X·Xᵀ for X [..., m, n] and symmetric C [..., m, m] (or None).

    Only the tiles of C on or below the diagonal are read.
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
    wide = X.is_cuda and X.element_size() == 2
    block = block or (128 if wide else BLOCK)
    block_k = block_k or (64 if wide else BLOCK_K)
    tiles = triton.cdiv(m, block)
    precision = "ieee"
    if X.dtype == torch.float32 and torch.get_float32_matmul_precision() != "highest":
        precision = "tf32"
    grid = (tiles * (tiles + 1) // 2, X3.shape[0])
    _syrk_kernel[grid](
        X3,
        C3,
        out,
        m,
        n,
        *X3.stride(),
        *C3.stride(),
        *out.stride(),
        float(alpha),
        float(beta),
        HAS_C=C is not None,
        PRECISION=precision,
        BLOCK=block,
        BLOCK_K=block_k,
        num_warps=8 if block >= 128 else 4,
        num_stages=3,
    )
    return out.reshape(*lead, m, m)
