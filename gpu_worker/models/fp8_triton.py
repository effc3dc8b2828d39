"""The per-token FP8 quantization of a matmul's input as one Triton kernel (CUDA).

In torch ops it is eight launches (to float32, abs, max, two divisions, two clamps, the cast) before every
FP8 matmul, four matmuls a layer: in a decode step those small kernels cost about what the matmuls save. One
program per token reads its row once, and computes what models/fp8.py's quantize_rows does, the same way
(times 1/448 in float32, an IEEE division, a round-to-nearest-even cast): the same bits.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


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
    scale = tl.maximum(tl.max(tl.abs(x), 0) * inv_fp8_max, min_scale)
    q = tl.minimum(tl.maximum(tl.math.div_rn(x, scale), -fp8_max), fp8_max)
    tl.store(q_ptr + row * stride_q + cols, q.to(q_ptr.dtype.element_ty), mask=mask)
    tl.store(scale_ptr + row, scale)


def quantize_rows(x: torch.Tensor, fp8_max: float, min_scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] (a CUDA tensor) -> (float8_e4m3fn [M, K], float32 scales [M, 1])."""
    if x.stride(1) != 1:
        x = x.contiguous()
    m, k = x.shape
    q = torch.empty((m, k), dtype=torch.float8_e4m3fn, device=x.device)
    scale = torch.empty((m, 1), dtype=torch.float32, device=x.device)
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
        num_warps=min(16, max(1, k_pad // 512)),
    )
    return q, scale
