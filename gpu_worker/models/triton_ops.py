"""Fused kernels for the decoder families' elementwise steps on CUDA, one launch each where torch needs many.

Fewer kernels make a forward cheaper to launch eagerly (--enforce-eager, steps with prompt logprobs) and its
CUDA graph shorter: RMSNorm written in torch ops is seven launches and the rotary embedding about fourteen, in
every layer. Here:

    add_rms_norm   grid (rows,)     residual + x, then RMSNorm of the sum   (or RMSNorm of x alone), in each
                                    family's style (models/norms.py)
    rotary         grid (tokens,)   rotates q and k in place, every head of both (the first rotary dims of each)
    act_and_mul    grid (tokens,)   act(gate) * up from the fused gate/up projection, act silu or tanh-GELU

The norm and act_and_mul also come as `_fp8` variants for an FP8 projection's input: the same row, rounded to
the model dtype, then quantized per token in the same program (models/fp8_triton.py: quantize_row) instead of
stored, which is what storing it and quantizing it in a second kernel gives, bit for bit.

Each rounds to the model dtype wherever the torch reference (models/norms.py, rotary.py, mlp.py) does, in the
same order, and contracts no multiply-add (enable_fp_fusion=False): float32 results are the reference's,
except for the last bit of a sum taken in another order (RMSNorm's mean square) or of an exponential.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from gpu_worker.models.fp8 import FP8_MAX, MIN_SCALE, QuantizedRows
from gpu_worker.models.fp8_triton import empty_rows, quantize_row, warps_for_row
from gpu_worker.triton_math import tanh


@triton.jit
def add_rms_norm_row(
    x,
    row,
    residual_ptr,
    out_ptr,
    scale_ptr,
    weight_ptr,
    eps,
    stride_r,
    stride_o,
    fp8_max,
    inv_fp8_max,
    min_scale,
    cols,
    mask,
    N: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr,
    OFFSET: tl.constexpr,
    SCALE_IN_FP32: tl.constexpr,
    QUANTIZE: tl.constexpr,
):
    """One row x (its lanes past N masked off): residual + x stored into the residual, then its RMSNorm stored
    (or quantized) into out. Also the tail of the all-reduce that ends in a norm (gpu_worker/all_reduce_kernels.py)."""
    if HAS_RESIDUAL:
        x = (x.to(tl.float32) + tl.load(residual_ptr + row * stride_r + cols, mask=mask, other=0.0).to(tl.float32)).to(
            x.dtype
        )
        tl.store(residual_ptr + row * stride_r + cols, x, mask=mask)
    h = x.to(tl.float32)
    h = h * tl.rsqrt(tl.sum(h * h, 0) / N + eps)
    w = tl.load(weight_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    if SCALE_IN_FP32:  # gemma, olmo: (OFFSET + w) * h in float32, one rounding
        out = (h * (OFFSET + w)).to(x.dtype)
    else:  # llama: h rounded first
        out = (w * h.to(x.dtype).to(tl.float32)).to(x.dtype)
    if QUANTIZE:  # out_ptr: float8 rows, scale_ptr: their scales
        quantize_row(out.to(tl.float32), out_ptr, scale_ptr, row, stride_o, cols, mask, fp8_max, inv_fp8_max, min_scale)
    else:
        tl.store(out_ptr + row * stride_o + cols, out, mask=mask)


@triton.jit
def _add_rms_norm_kernel(
    x_ptr,
    residual_ptr,
    out_ptr,
    scale_ptr,
    weight_ptr,
    eps,
    stride_x,
    stride_r,
    stride_o,
    fp8_max,
    inv_fp8_max,
    min_scale,
    N: tl.constexpr,
    N_PAD: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr,
    OFFSET: tl.constexpr,
    SCALE_IN_FP32: tl.constexpr,
    QUANTIZE: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, N_PAD)
    mask = cols < N
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    add_rms_norm_row(
        x,
        row,
        residual_ptr,
        out_ptr,
        scale_ptr,
        weight_ptr,
        eps,
        stride_r,
        stride_o,
        fp8_max,
        inv_fp8_max,
        min_scale,
        cols,
        mask,
        N,
        HAS_RESIDUAL,
        OFFSET,
        SCALE_IN_FP32,
        QUANTIZE,
    )


def add_rms_norm(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    residual: torch.Tensor | None = None,
    offset: float = 0.0,
    scale_in_float32: bool = False,
) -> torch.Tensor:
    """RMSNorm of x [T, N]; with a residual, of residual + x, which is also written into residual.
    offset, scale_in_float32: the family's style (models/norms.py)."""
    out = torch.empty_like(x)
    _launch_add_rms_norm(x, weight, eps, residual, offset, scale_in_float32, out, None)
    return out


def add_rms_norm_fp8(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    residual: torch.Tensor | None = None,
    offset: float = 0.0,
    scale_in_float32: bool = False,
) -> QuantizedRows:
    """add_rms_norm's rows quantized per token for an FP8 projection."""
    values, scales = empty_rows(x.shape[0], x.shape[1], x.device)
    _launch_add_rms_norm(x, weight, eps, residual, offset, scale_in_float32, values, scales)
    return QuantizedRows(values, scales, x.dtype)


def _launch_add_rms_norm(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    residual: torch.Tensor | None,
    offset: float,
    scale_in_float32: bool,
    out: torch.Tensor,
    scales: torch.Tensor | None,
) -> None:
    n = x.shape[-1]
    _add_rms_norm_kernel[(x.shape[0],)](
        x,
        residual if residual is not None else x,
        out,
        scales,
        weight,
        eps,
        x.stride(0),
        residual.stride(0) if residual is not None else 0,
        out.stride(0),
        FP8_MAX,
        1.0 / FP8_MAX,
        MIN_SCALE,
        N=n,
        N_PAD=triton.next_power_of_2(n),
        HAS_RESIDUAL=residual is not None,
        OFFSET=offset,
        SCALE_IN_FP32=scale_in_float32,
        QUANTIZE=scales is not None,
        enable_fp_fusion=False,
    )


@triton.jit
def _rotate_heads(
    ptr,
    token,
    stride_t,
    stride_h,
    cos1,
    cos2,
    sin1,
    sin2,
    NUM_HEADS: tl.constexpr,
    HEADS_PAD: tl.constexpr,
    HALF: tl.constexpr,
    HALF_PAD: tl.constexpr,
):
    heads = tl.arange(0, HEADS_PAD)
    dims = tl.arange(0, HALF_PAD)
    mask = (heads < NUM_HEADS)[:, None] & (dims < HALF)[None, :]
    dtype = ptr.dtype.element_ty
    first = ptr + token * stride_t + heads[:, None] * stride_h + dims[None, :]
    x1 = tl.load(first, mask=mask).to(tl.float32)
    x2 = tl.load(first + HALF, mask=mask).to(tl.float32)
    # x * cos + rotate_half(x) * sin, rotate_half(x) = (-x2, x1): each product rounded, then the sum.
    out1 = (x1 * cos1[None, :]).to(dtype).to(tl.float32) + (-x2 * sin1[None, :]).to(dtype).to(tl.float32)
    out2 = (x2 * cos2[None, :]).to(dtype).to(tl.float32) + (x1 * sin2[None, :]).to(dtype).to(tl.float32)
    tl.store(first, out1.to(dtype), mask=mask)
    tl.store(first + HALF, out2.to(dtype), mask=mask)


@triton.jit
def _rotary_kernel(
    q_ptr,
    k_ptr,
    positions_ptr,
    cos_ptr,
    sin_ptr,
    stride_qt,
    stride_qh,
    stride_kt,
    stride_kh,
    stride_cos,
    Q_HEADS: tl.constexpr,
    K_HEADS: tl.constexpr,
    HEADS_PAD: tl.constexpr,
    HALF: tl.constexpr,
    HALF_PAD: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    pos = tl.load(positions_ptr + token).to(tl.int64)
    dims = tl.arange(0, HALF_PAD)
    dim_mask = dims < HALF
    dtype = q_ptr.dtype.element_ty
    # The reference casts cos and sin to the model dtype before multiplying.
    row = pos * stride_cos
    cos1 = tl.load(cos_ptr + row + dims, mask=dim_mask).to(dtype).to(tl.float32)
    cos2 = tl.load(cos_ptr + row + HALF + dims, mask=dim_mask).to(dtype).to(tl.float32)
    sin1 = tl.load(sin_ptr + row + dims, mask=dim_mask).to(dtype).to(tl.float32)
    sin2 = tl.load(sin_ptr + row + HALF + dims, mask=dim_mask).to(dtype).to(tl.float32)
    _rotate_heads(q_ptr, token, stride_qt, stride_qh, cos1, cos2, sin1, sin2, Q_HEADS, HEADS_PAD, HALF, HALF_PAD)
    _rotate_heads(k_ptr, token, stride_kt, stride_kh, cos1, cos2, sin1, sin2, K_HEADS, HEADS_PAD, HALF, HALF_PAD)


def rotary(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
    """Rotate q [T, Hq, D] and k [T, Hk, D] (strided views are fine) in place; cos, sin [positions, R]: the first
    R dims of each head turn (R < D: partial rotary), the rest stay."""
    half = cos.shape[-1] // 2
    _rotary_kernel[(q.shape[0],)](
        q,
        k,
        positions,
        cos,
        sin,
        q.stride(0),
        q.stride(1),
        k.stride(0),
        k.stride(1),
        cos.stride(0),
        Q_HEADS=q.shape[1],
        K_HEADS=k.shape[1],
        HEADS_PAD=triton.next_power_of_2(max(q.shape[1], k.shape[1])),
        HALF=half,
        HALF_PAD=triton.next_power_of_2(half),
        enable_fp_fusion=False,
    )


@triton.jit
def _act_and_mul_kernel(
    x_ptr,
    out_ptr,
    scale_ptr,
    stride_x,
    stride_o,
    fp8_max,
    inv_fp8_max,
    min_scale,
    N: tl.constexpr,
    BLOCK: tl.constexpr,
    GELU: tl.constexpr,
    QUANTIZE: tl.constexpr,
):
    # Program (row, b) computes columns [b * BLOCK, (b + 1) * BLOCK) of the row: when quantizing, BLOCK is the whole
    # row (the scale needs all of it), else a row is many programs, so that a decode step's few hundred rows of
    # 14,336 still spread over every SM rather than walking each row in one program.
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < N
    gate = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    up = tl.load(x_ptr + row * stride_x + N + cols, mask=mask, other=0.0).to(tl.float32)
    g = gate.to(tl.float32)
    if GELU:  # torch's tanh approximation: 0.5 x (1 + tanh(sqrt(2 / pi) (x + 0.044715 x^3)))
        inner = 0.7978845608028654 * (g + 0.044715 * (g * g * g))
        act = 0.5 * g * (1.0 + tanh(inner))
    else:
        act = g / (1.0 + tl.exp(-g))
    out = (act.to(gate.dtype).to(tl.float32) * up).to(gate.dtype)
    if QUANTIZE:  # out_ptr: float8 rows, scale_ptr: their scales
        quantize_row(out.to(tl.float32), out_ptr, scale_ptr, row, stride_o, cols, mask, fp8_max, inv_fp8_max, min_scale)
    else:
        tl.store(out_ptr + row * stride_o + cols, out, mask=mask)


def act_and_mul(gate_up: torch.Tensor, activation: str = "silu") -> torch.Tensor:
    """[T, 2I] (gate then up) -> act(gate) * up [T, I]; activation "silu" or "gelu_tanh"."""
    n = gate_up.shape[-1] // 2
    out = torch.empty(gate_up.shape[0], n, dtype=gate_up.dtype, device=gate_up.device)
    _launch_act_and_mul(gate_up, activation, out, None)
    return out


def act_and_mul_fp8(gate_up: torch.Tensor, activation: str = "silu") -> QuantizedRows:
    """act_and_mul's rows quantized per token for an FP8 projection."""
    values, scales = empty_rows(gate_up.shape[0], gate_up.shape[-1] // 2, gate_up.device)
    _launch_act_and_mul(gate_up, activation, values, scales)
    return QuantizedRows(values, scales, gate_up.dtype)


def _launch_act_and_mul(gate_up: torch.Tensor, activation: str, out: torch.Tensor, scales: torch.Tensor | None):
    n = gate_up.shape[-1] // 2
    quantize = scales is not None
    row_pad = triton.next_power_of_2(n)
    block = row_pad if quantize else min(1024, row_pad)
    _act_and_mul_kernel[(gate_up.shape[0], triton.cdiv(n, block))](
        gate_up,
        out,
        scales,
        gate_up.stride(0),
        out.stride(0),
        FP8_MAX,
        1.0 / FP8_MAX,
        MIN_SCALE,
        N=n,
        BLOCK=block,
        GELU=activation == "gelu_tanh",
        QUANTIZE=quantize,
        num_warps=warps_for_row(row_pad) if quantize else 4,
        enable_fp_fusion=False,
    )
