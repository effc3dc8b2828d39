"""The per-token FP8 quantization of a matmul's input as one Triton kernel (CUDA), and which FP8 products take
our Triton product (models/triton_matmul.py) rather than torch._scaled_mm.

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

from gpu_worker.models.matmul_tiles import Tiles
from gpu_worker.models.triton_matmul import MeasuredTiles, measured_tiles


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
    GROUP: tl.constexpr,
):
    """One row's values and scale, or with GROUP > 0 (a power of two) a scale per GROUP inputs (the scales' row
    stride cdiv(K, GROUP)): fp8.quantize_blocks(x, (1, GROUP))'s bits."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, K_PAD)
    mask = cols < K
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    if GROUP:
        num_groups: tl.constexpr = K_PAD // GROUP
        groups = tl.reshape(tl.where(mask, tl.abs(x), 0.0), [num_groups, GROUP])
        scales = tl.maximum(tl.max(groups, 1) * inv_fp8_max, min_scale)
        each = tl.reshape(tl.broadcast_to(scales[:, None], [num_groups, GROUP]), [K_PAD])
        q = tl.minimum(tl.maximum(tl.math.div_rn(x, each), -fp8_max), fp8_max)
        tl.store(q_ptr + row * stride_q + cols, q.to(q_ptr.dtype.element_ty), mask=mask)
        group_ids = tl.arange(0, num_groups)
        tl.store(scale_ptr + row * tl.cdiv(K, GROUP) + group_ids, scales, mask=group_ids < tl.cdiv(K, GROUP))
    else:
        quantize_row(x, q_ptr, scale_ptr, row, stride_q, cols, mask, fp8_max, inv_fp8_max, min_scale)


def quantize_rows(
    x: torch.Tensor, fp8_max: float, min_scale: float, group: int = 0
) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] (a CUDA tensor) -> (float8_e4m3fn [M, K], float32 scales [M, 1]), or with `group` > 0 (a power of
    two) scales [M, ceil(K / group)], one per row and group of inputs."""
    if x.stride(1) != 1:
        x = x.contiguous()
    m, k = x.shape
    q, scale = empty_rows(m, k, x.device)
    k_pad = triton.next_power_of_2(max(k, group))
    if group:
        if group & (group - 1):
            raise ValueError(f"activations per {group} inputs: the Triton kernel takes a power of two")
        scale = torch.empty((m, -(-k // group)), dtype=torch.float32, device=x.device)
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
        GROUP=group,
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


# ------------------------------------------------------------------ which FP8 products take our kernel


# Our kernel against torch._scaled_mm (row-wise scales), one H100, the 8B shape's four products (QKV, output,
# gate-up, down; `python -m benchmarks.fp8_gemm`, docs/benchmarks.md), µs for all four: 16 rows 104 against 125,
# 64 rows 102 / 115, 2,048 rows 737 / 781, 8,192 2,963 / 3,147.
FEW_ROWS = Tiles(block_m=64, block_n=64, block_k=128, num_warps=4, num_stages=4, group_m=8)
MANY_ROWS = Tiles(block_m=128, block_n=256, block_k=128, num_warps=8, num_stages=3, group_m=8)
FEW_ROWS_MAX = 64
MANY_ROWS_MIN = 2048

# Between (a decode of 65-512 requests) no one launch shape beats _scaled_mm on every product, but for a given
# weight shape one often does: cuBLAS's 128-row tiles leave a narrow product's grid short of the SMs (the 8B's
# output projection at 256 rows: 64 programs on 132 SMs), where 64-row tiles fill them. Per weight shape (N, K),
# for up to each row count measured, the shape that beat _scaled_mm by more than 3 %, None where none did. One
# H200 (`python -m benchmarks.fp8_gemm --shape S --tokens 128,256,512`, docs/results/fp8_gemm_decode_h200/), µs
# of ours against _scaled_mm; shapes not measured (tensor-parallel ranks' halves, other models) take _scaled_mm.
# TMA-fed shapes (Tiles.feed) beat these in isolation on another H200 (docs/results/fp8_gemm_tma_h200/: the 8B's
# gate-up at 256 rows 57.8 against 63.6 µs, warp-specialized), but a table taking them where they won left W1
# unchanged (the 8B with both fp8: 21,180 -> 21,089 tok/s, step 7.90 -> 7.94 ms, alternated in one call), so
# the pointer-fed shapes stay.
_NARROW_128 = Tiles(block_m=64, block_n=64, block_k=256, num_warps=4, num_stages=3, group_m=8)
_NARROW_256 = Tiles(block_m=64, block_n=128, block_k=256, num_warps=4, num_stages=3, group_m=8)
_WIDE = MANY_ROWS
DECODE_ROWS: MeasuredTiles = {
    # Llama-3-8B: QKV 9.7 / 12.9 at 128 rows, 25.3 / 27.9 at 512; output 7.2 / 12.7, 10.4 / 13.0; gate-up
    # 63.9 / 67.7 at 256; down 30.9 / 36.8, 37.7 / 41.1
    (6144, 4096): ((128, _NARROW_256), (256, None), (512, _WIDE)),
    (4096, 4096): ((128, _NARROW_128), (256, _NARROW_256), (512, None)),
    (28672, 4096): ((128, None), (256, _WIDE), (512, None)),
    (4096, 14336): ((128, _NARROW_128), (256, _NARROW_256), (512, None)),
    # Llama-3.2-1B: QKV 4.6 / 8.1, 6.3 / 8.3; output 4.5 / 8.1, 4.8 / 8.2, 6.5 / 8.3; gate-up 17.0 / 19.4,
    # 35.8 / 38.7; down 10.6 / 21.7, 11.6 / 21.9, 17.7 / 22.2
    (3072, 2048): ((128, _NARROW_128), (256, _NARROW_256), (512, None)),
    (2048, 2048): ((128, _NARROW_128), (256, _NARROW_128), (512, _NARROW_256)),
    (16384, 2048): ((128, None), (256, _WIDE), (512, _WIDE)),
    (2048, 8192): ((128, _NARROW_128), (256, _NARROW_128), (512, _NARROW_256)),
}


def matmul_tiles(rows: int, n: int, k: int, grouped: bool = False) -> Tiles | None:
    """The launch shape scaled_matmul takes for a product of `rows` rows with an [n, k] weight, or None where
    _scaled_mm is faster. A weight with scales per group of inputs (grouped) takes ours at every size:
    _scaled_mm scales whole rows. (Its launch shapes are the row-wise ones, not measured apart.)"""
    if rows <= FEW_ROWS_MAX:
        return FEW_ROWS
    if rows >= MANY_ROWS_MIN or grouped:
        return MANY_ROWS
    return measured_tiles(DECODE_ROWS, rows, n, k)
