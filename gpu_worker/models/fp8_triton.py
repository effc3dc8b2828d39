"""The per-token FP8 quantization of a matmul's input as one Triton kernel (CUDA).

In torch ops it is eight launches (to float32, abs, max, two divisions, two clamps, the cast) before every
FP8 matmul, four matmuls a layer: in a decode step those small kernels cost about what the matmuls save. One
program per token reads its row once, and computes what models/fp8.py's quantize_rows does, the same way
(times 1/448 in float32, an IEEE division, a round-to-nearest-even cast): the same bits. The fused norm and
act-and-mul kernels (models/triton_ops.py) end in the same `quantize_row` where they would store their row.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def quantize_row(values, q_ptr, scale_ptr, row, stride_q, cols, mask, fp8_max, inv_fp8_max, min_scale):
    """Store one row (float32, the lanes past the row masked off) as float8 and its scale."""
    scale = tl.maximum(tl.max(tl.where(mask, tl.abs(values), 0.0), 0) * inv_fp8_max, min_scale)
    q = tl.minimum(tl.maximum(tl.math.div_rn(values, scale), -fp8_max), fp8_max)
    tl.store(q_ptr + row * stride_q + cols, q.to(q_ptr.dtype.element_ty), mask=mask)
    tl.store(scale_ptr + row, scale)


@triton.jit
def _quantize_rows_kernel(
    x_ptr,
    q_ptr,
    scale_ptr,
    stride_x,
    stride_q,
    fp8_max,
    inv_fp8_max,
    min_scale,
    K: tl.constexpr,
    K_PAD: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, K_PAD)
    mask = cols < K
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    quantize_row(x, q_ptr, scale_ptr, row, stride_q, cols, mask, fp8_max, inv_fp8_max, min_scale)


def quantize_rows(x: torch.Tensor, fp8_max: float, min_scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] (a CUDA tensor) -> (float8_e4m3fn [M, K], float32 scales [M, 1])."""
    if x.stride(1) != 1:
        x = x.contiguous()
    m, k = x.shape
    q, scale = empty_rows(m, k, x.device)
    k_pad = triton.next_power_of_2(k)
    _quantize_rows_kernel[(m,)](
        x,
        q,
        scale,
        x.stride(0),
        q.stride(0),
        fp8_max,
        1.0 / fp8_max,
        min_scale,
        K=k,
        K_PAD=k_pad,
        num_warps=warps_for_row(k_pad),
    )
    return q, scale


def empty_rows(m: int, k: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Room for m quantized rows of k: (float8_e4m3fn [m, k], float32 scales [m, 1])."""
    return (
        torch.empty((m, k), dtype=torch.float8_e4m3fn, device=device),
        torch.empty((m, 1), dtype=torch.float32, device=device),
    )


def warps_for_row(k_pad: int) -> int:
    """A whole row in one program's registers (the scale needs all of it): 16 values a thread up to 16 warps."""
    return min(16, max(1, k_pad // 512))
