"""Triton kernels for attention over the paged KV store, and the functions that launch them.

    store_kv           grid (tokens,)                   one token's K and V, every KV head, into its slot
    prefill_attention  grid (query tiles, q heads,      BLOCK_M queries of one sequence against (a slice of)
                             splits)                     its context [+ merge: grid (tokens, q heads)]
    decode_attention   grid (slices, kv heads)          one query per q head of a KV head's group, against one
                                                         slice of its sequence's context (decode_slices: every
                                                         context cut into slices of one length, so a long one
                                                         is many programs); a context of one slice is written
                                                         whole, the last slice of a cut one to finish merges
                                                         them (no second launch: see _decode_kernel)

Every kernel reads context through the block table one token at a time (position // block_size picks
the block, position % block_size the slot in it), so a K/V tile may span several blocks and any block
size works. Softmax is online (running max and sum, rescaled per tile) in float32, in base 2: scores are
scaled by scale * log2(e) so exp2 can be used.

Per layer, two options (constexpr flags, so a layer without them compiles without their code):
a sliding window (each query sees itself and the window - 1 keys before it: keys before the window are
never loaded, so blocks every layer has slid past could be freed without harm) and tanh soft-capping of the
scores (Gemma 2: cap * tanh(score / cap), taken before the mask, as the reference does).

A float8 store (--kv-cache-dtype fp8, constexpr FP8) holds K and V in units of the layer's two scales
(gpu_worker/kv_cache.py): store_kv quantizes (times 1 / scale, clamped to +-448, rounded to nearest even). The
prefill kernel converts each tile as it loads it into q's dtype (exact: every e4m3 value is a bfloat16); the
decode kernel reads 16-bit pairs of entries and moves their bits into float16 (_e4m3_pairs_as_f16: 1/256 of each
value, exact too). Both apply the scales outside the tile loop: K's folded into the score scale, V's on the
output (with power-of-two scales, kv_scales.py, the same bits as scaling every element, at none of its
per-element work).

Head dims that are not a power of two (and group sizes, head counts) are padded to one with masked
loads; tl.dot wants every side at least 16, hence the floors of 16 below.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import numpy as np
import torch
import triton
import triton.language as tl

from gpu_worker.triton_math import tanh

LOG2_E = 1.4426950408889634
PREFILL_BLOCK_M = 64  # queries per prefill program; the host splits sequences into tiles of this size
PREFILL_BLOCK_N = 64
DECODE_BLOCK_N = 64
# Split-KV: one program walking a whole context leaves most SMs idle with few sequences, and holds a whole
# step back with one long context among short ones (a step takes as long as its longest walk). Contexts are
# cut into slices so that every SM gets about this many programs, but never slices shorter than
# MIN_SPLIT_TOKENS (the merge costs a pass over the partials) nor more than MAX_SPLITS of one context.
TARGET_PROGRAMS_PER_SM = 8
MIN_SPLIT_TOKENS = 256
MAX_SPLITS = 32
MAX_PREFILL_SPLITS = 8
# Triton decides at import whether its kernels run in the CPU interpreter (TRITON_INTERPRET=1); so does this module.
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
# A CUDA graph's decode launch covers this many slices beyond two per decode it may hold (decode_slice_capacity).
EXTRA_DECODE_SLICES = 256


def _pow2(n: int, floor: int = 16) -> int:
    return max(floor, triton.next_power_of_2(n))


# ---------------------------------------------------------------------------------------- storing K/V


@triton.jit
def _store_kv_kernel(
    k_ptr,
    v_ptr,
    k_cache_ptr,
    v_cache_ptr,
    slot_mapping_ptr,
    k_scale_inv,
    v_scale_inv,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_cb,
    stride_cs,
    stride_ch,
    NUM_HEADS: tl.constexpr,
    HEADS_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    FP8: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    heads = tl.arange(0, HEADS_PAD)
    dims = tl.arange(0, HEAD_DIM_PAD)
    mask = (heads < NUM_HEADS)[:, None] & (dims < HEAD_DIM)[None, :]
    slot_start = (slot // BLOCK_SIZE) * stride_cb + (slot % BLOCK_SIZE) * stride_cs
    dst = slot_start + heads[:, None] * stride_ch + dims[None, :]
    k = tl.load(k_ptr + token * stride_kt + heads[:, None] * stride_kh + dims[None, :], mask=mask)
    v = tl.load(v_ptr + token * stride_vt + heads[:, None] * stride_vh + dims[None, :], mask=mask)
    if FP8:
        k = _to_e4m3_grid(k.to(tl.float32) * k_scale_inv)
        v = _to_e4m3_grid(v.to(tl.float32) * v_scale_inv)
    tl.store(k_cache_ptr + dst, k.to(k_cache_ptr.dtype.element_ty), mask=mask)
    tl.store(v_cache_ptr + dst, v.to(v_cache_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _to_e4m3_grid(x):
    """x (float32) clamped to +-448 and rounded to the nearest float8 e4m3 value, ties to even, still in float32:
    the cast that follows is exact. Rounded here because Triton's CPU interpreter truncates when it casts to
    float8 (a GPU rounds to nearest even), so that both store what torch's cast stores (kv_cache.quantize).

    e4m3's spacing in x's binade [2^e, 2^(e+1)) is 2^(e-3), and 2^-9 below 2^-6 (subnormals). Adding
    1.5 x 2^23 spacings leaves float32 exactly that spacing (its own rounding does the work), subtracting it
    back is exact."""
    x = tl.minimum(tl.maximum(x, -448.0), 448.0)  # e4m3fn's largest finite value (kv_cache.FP8_MAX)
    biased_exponent = tl.maximum((x.to(tl.int32, bitcast=True) >> 23) & 0xFF, 127 - 6)
    spacing = ((biased_exponent - 3) << 23).to(tl.float32, bitcast=True)
    magic = spacing * 12582912.0
    return (x + magic) - magic


def store_kv(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    kv_scales: tuple[float, float] = (1.0, 1.0),
) -> None:
    """k, v: [T, Hkv, D] -> caches [num_blocks, block_size, Hkv, D] at the flat slots slot_mapping [T]; caches of
    float8 get them quantized in units of kv_scales (K's, V's).

    One launch for both K and V (two index_copy_ calls would be two), reading k and v through their
    strides, so the views the models hand over (slices of one qkv projection) need no copy."""
    num_tokens, num_heads, head_dim = k.shape
    if num_tokens == 0:
        return
    _store_kv_kernel[(num_tokens,)](
        k,
        v,
        k_cache,
        v_cache,
        slot_mapping,
        1.0 / kv_scales[0],
        1.0 / kv_scales[1],
        k.stride(0),
        k.stride(1),
        v.stride(0),
        v.stride(1),
        *k_cache.stride()[:3],
        NUM_HEADS=num_heads,
        HEADS_PAD=triton.next_power_of_2(num_heads),
        HEAD_DIM=head_dim,
        HEAD_DIM_PAD=triton.next_power_of_2(head_dim),
        BLOCK_SIZE=k_cache.shape[1],
        FP8=_is_fp8(k_cache),
    )


def _is_fp8(cache: torch.Tensor) -> bool:
    return cache.dtype == torch.float8_e4m3fn


# ------------------------------------------------------------------------------ shared tile helpers


@triton.jit
def _context_rows(table_ptr, kv_head, start, begin, end, stride_cb, stride_cs, stride_ch, BLOCK_SIZE, BLOCK_N):
    """Context positions start.. [BLOCK_N], which of them lie in [begin, end), and where each one's row of
    `kv_head` starts in the store (in entries), through the block table: the K/V loaders' common part."""
    pos = start + tl.arange(0, BLOCK_N)
    in_context = (pos >= begin) & (pos < end)
    block = tl.load(table_ptr + pos // BLOCK_SIZE, mask=in_context, other=0).to(tl.int64)
    return pos, in_context, block * stride_cb + (pos % BLOCK_SIZE) * stride_cs + kv_head * stride_ch


@triton.jit
def _load_kv_tile(
    k_cache_ptr,
    v_cache_ptr,
    table_ptr,
    kv_head,
    start,
    begin,
    end,
    stride_cb,
    stride_cs,
    stride_ch,
    q,
    BLOCK_SIZE: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    BLOCK_N: tl.constexpr,
    FP8: tl.constexpr,
):
    """K and V [BLOCK_N, HEAD_DIM_PAD] of context positions start.., zero outside [begin, end) (never read).
    FP8: converted to q's dtype, still in units of the layer's scales (the caller applies them)."""
    pos, in_context, rows = _context_rows(
        table_ptr, kv_head, start, begin, end, stride_cb, stride_cs, stride_ch, BLOCK_SIZE, BLOCK_N
    )
    dims = tl.arange(0, HEAD_DIM_PAD)
    offsets = rows[:, None] + dims[None, :]
    mask = in_context[:, None] & (dims < HEAD_DIM)[None, :]
    k = tl.load(k_cache_ptr + offsets, mask=mask, other=0.0)
    v = tl.load(v_cache_ptr + offsets, mask=mask, other=0.0)
    if FP8:
        k = k.to(q.dtype)
        v = v.to(q.dtype)
    return pos, k, v


# e4m3 bits placed into float16's (sign to sign, exponent and mantissa one bit further left) are the value over
# 2^(15 - 7), the exponent biases' difference; e4m3's subnormals land on float16's, so the placement is exact.
E4M3_IN_F16_UNIT = 256.0


@triton.jit
def _e4m3_pairs_as_f16(pairs, ASM: tl.constexpr):
    """int16 entries, each two e4m3 bytes (a head's dims 2j and 2j + 1, little-endian) -> (even, odd): float16
    holding each value / E4M3_IN_F16_UNIT, by moving bits, not by converting (a conversion instruction's
    throughput, and repacking bytes, bound a decode kernel reading a float8 store).

    Why pairs: a 16-bit entry is what the GPU's matrix loads move and transpose (ldmatrix), so V's tile reaches
    the products' layout (keys paired along the reduction) from shared memory as bfloat16's does; single bytes
    took a byte load and permutes each (one H200, W1: 1.39x faster, docs/benchmarks.md). ASM: two 16-bit
    entries per 32-bit register, four integer instructions for the odd bytes' pair and five for the even's
    (the odd bytes already sit in each half's high byte); CUDA only (the CPU interpreter runs no PTX): the
    same bits in plain Triton."""
    if ASM:
        # In each 16-bit half the high byte (the odd dim) keeps its sign bit at 15 and moves its 7 magnitude bits
        # one right, to 13..7; the low byte (the even dim) takes its sign from 8 bits up, its magnitude from 7.
        return tl.inline_asm_elementwise(
            asm="""
            {
            .reg .b32 t, u;
            shr.b32 t, $2, 1;
            and.b32 t, t, 0x3F803F80;
            and.b32 u, $2, 0x80008000;
            or.b32 $1, u, t;
            shl.b32 t, $2, 7;
            and.b32 t, t, 0x3F803F80;
            shl.b32 u, $2, 8;
            and.b32 u, u, 0x80008000;
            or.b32 $0, u, t;
            }
            """,
            constraints="=r,=r,r",
            args=[pairs],
            dtype=(tl.float16, tl.float16),
            is_pure=True,
            pack=2,
        )
    wide = pairs.to(tl.uint16, bitcast=True)
    low = wide & 0xFF
    high = wide >> 8
    even = (((low & 0x80) << 8) | ((low & 0x7F) << 7)).to(tl.float16, bitcast=True)
    odd = (((high & 0x80) << 8) | ((high & 0x7F) << 7)).to(tl.float16, bitcast=True)
    return even, odd


@triton.jit
def _load_kv_pairs(
    k_cache_ptr,
    v_cache_ptr,
    table_ptr,
    kv_head,
    start,
    begin,
    end,
    stride_cb,
    stride_cs,
    stride_ch,
    BLOCK_SIZE: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    BLOCK_N: tl.constexpr,
    ASM: tl.constexpr,
):
    """A float8 store's K and V tiles of positions start.., as _load_kv_tile reads them, but each split into its
    even and odd dims [BLOCK_N, HEAD_DIM_PAD // 2], float16 at 1/E4M3_IN_F16_UNIT of the entries
    (_e4m3_pairs_as_f16); an even HEAD_DIM, so that a row is whole 16-bit pairs."""
    pos, in_context, rows = _context_rows(
        table_ptr, kv_head, start, begin, end, stride_cb, stride_cs, stride_ch, BLOCK_SIZE, BLOCK_N
    )
    rows = rows // 2  # in pairs
    pairs = tl.arange(0, HEAD_DIM_PAD // 2)
    offsets = rows[:, None] + pairs[None, :]
    mask = in_context[:, None] & (pairs < HEAD_DIM // 2)[None, :]
    k = tl.load(k_cache_ptr.to(tl.pointer_type(tl.int16), bitcast=True) + offsets, mask=mask, other=0)
    v = tl.load(v_cache_ptr.to(tl.pointer_type(tl.int16), bitcast=True) + offsets, mask=mask, other=0)
    k_even, k_odd = _e4m3_pairs_as_f16(k, ASM)
    v_even, v_odd = _e4m3_pairs_as_f16(v, ASM)
    return pos, k_even, k_odd, v_even, v_odd


@triton.jit
def _decode_span(decode_span_ptr):
    """The decodes' place in the batch, read on the device so that a CUDA graph's replay sees each step's:
    (first decode sequence, its query's token row, number of decode sequences). A fourth entry holds the
    length of the decodes' context slices (decode_slices)."""
    return tl.load(decode_span_ptr), tl.load(decode_span_ptr + 1), tl.load(decode_span_ptr + 2)


@triton.jit
def _store_slice(part_out_ptr, part_lse_ptr, part, acc, m_i, l_i, dims, rows, HEAD_DIM_PAD: tl.constexpr):
    """One slice's partial outputs of `rows` (a mask) at their partial indices `part`: normalised, with their
    log2-sum-exp; a row that saw nothing in the slice gets output 0 and weight exp2(-inf) = 0."""
    seen = l_i > 0
    l_safe = tl.where(seen, l_i, 1.0)
    tl.store(part_out_ptr + part[:, None] * HEAD_DIM_PAD + dims[None, :], acc / l_safe[:, None], mask=rows[:, None])
    tl.store(part_lse_ptr + part, tl.where(seen, m_i + tl.log2(l_safe), float("-inf")), mask=rows)


@triton.jit
def _scores(q, k, qk_scale, softcap, SOFTCAP: tl.constexpr):
    """q [M, D] . k [N, D]^T in float32, in log2 units. ieee: float32 inputs must not drop to tf32."""
    return _scaled_scores(tl.dot(q, tl.trans(k), input_precision="ieee"), qk_scale, softcap, SOFTCAP)


@triton.jit
def _scaled_scores(s, qk_scale, softcap, SOFTCAP: tl.constexpr):
    """Products q . k in log2 units. SOFTCAP: softcap * tanh(s / softcap), softcap in log2 units too (cap *
    log2(e): the same capping)."""
    s = s * qk_scale
    if SOFTCAP:
        s = softcap * tanh(s / softcap)
    return s


@triton.jit
def _in_window(k_pos, q_pos, window):
    """[M, N]: whether each key is one of the `window` latest positions up to each query's own."""
    return k_pos[None, :] > q_pos[:, None] - window


@triton.jit
def _online_softmax_step(acc, m_i, l_i, s, v):
    """Folds one tile of scores s [M, N] (masked ones -inf) and values v [N, D] into the running state.

    A row that has seen no visible key yet (a slice of the context that starts past its position) keeps
    max -inf, sum 0 and acc 0: its exponents are taken against 0 rather than -inf (exp2(-inf - -inf) is NaN)."""
    p, alpha, m_new, l_i = _softmax_weights(m_i, l_i, s)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee")
    return acc, m_new, l_i


@triton.jit
def _softmax_weights(m_i, l_i, s):
    """_online_softmax_step's weights: (p = exp2(s - new max) [M, N], alpha: the old state's rescaling, the new
    max, the new sum)."""
    m_new = tl.maximum(m_i, tl.max(s, 1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m_i - m_safe)
    p = tl.exp2(s - m_safe[:, None])
    return p, alpha, m_new, l_i * alpha + tl.sum(p, 1)


# ------------------------------------------------------------------------------------------ prefill


# Arguments that change from step to step are not specialized on (Triton would otherwise compile a
# variant per divisibility class): one compiled kernel per model, warmed up before serving.
@triton.jit(do_not_specialize=["tiles_stride", "stride_bt"])
def _prefill_kernel(
    q_ptr,
    out_ptr,
    part_out_ptr,
    part_lse_ptr,
    k_cache_ptr,
    v_cache_ptr,
    block_tables_ptr,
    context_lens_ptr,
    query_starts_ptr,
    tiles_ptr,
    tiles_stride,
    qk_scale,
    window,
    softcap,
    v_scale,
    stride_qt,
    stride_qh,
    stride_ot,
    stride_oh,
    stride_cb,
    stride_cs,
    stride_ch,
    stride_bt,
    GROUP: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    SPLIT: tl.constexpr,
    SLIDING: tl.constexpr,
    SOFTCAP: tl.constexpr,
    FP8: tl.constexpr,
):
    tile = tl.program_id(0)
    head = tl.program_id(1)
    split = tl.program_id(2)
    seq = tl.load(tiles_ptr + tile)
    if seq < 0:
        return  # a padding tile (a graph launches a fixed number of them)
    first = tl.load(tiles_ptr + tiles_stride + tile)  # index of the tile's first query within its sequence
    q_start = tl.load(query_starts_ptr + seq)
    q_len = tl.load(query_starts_ptr + seq + 1) - q_start
    ctx = tl.load(context_lens_ptr + seq)
    kv_head = head // GROUP
    table_ptr = block_tables_ptr + seq.to(tl.int64) * stride_bt

    rows = first + tl.arange(0, BLOCK_M)
    dims = tl.arange(0, HEAD_DIM_PAD)
    io_mask = (rows < q_len)[:, None] & (dims < HEAD_DIM)[None, :]
    tokens = (q_start + rows).to(tl.int64)
    q = tl.load(q_ptr + tokens[:, None] * stride_qt + head * stride_qh + dims[None, :], mask=io_mask, other=0.0)

    # Query i sits at context position ctx - q_len + i and sees keys up to it (SLIDING: from window - 1 before it):
    #   keys [kv_begin, shared_end)  visible to every query of the tile: no causal mask
    #   keys [shared_end, kv_end)    the causal diagonal: masked per (query, key)
    # kv_begin: 0, or where the tile's first query's window starts (keys before it are never loaded), whose
    # BLOCK_N tile the walk starts from so that tiles stay aligned with shared_end.
    q_pos = ctx - q_len + rows
    first_pos = ctx - q_len + first
    kv_end = tl.minimum(first_pos + BLOCK_M, ctx)
    shared_end = (first_pos + 1) // BLOCK_N * BLOCK_N
    kv_begin = 0
    if SLIDING:
        kv_begin = tl.maximum(first_pos - window + 1, 0)
    walk_start = kv_begin // BLOCK_N * BLOCK_N

    # Split-KV: this program takes one slice of [walk_start, kv_end), whole BLOCK_N tiles; a later pass merges them.
    num_splits = tl.num_programs(2)
    slice_len = tl.cdiv(tl.cdiv(kv_end - walk_start, BLOCK_N), num_splits) * BLOCK_N
    lo = walk_start + split * slice_len
    hi = tl.minimum(lo + slice_len, kv_end)

    acc = tl.zeros([BLOCK_M, HEAD_DIM_PAD], dtype=tl.float32)
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    for start in range(lo, tl.minimum(hi, shared_end), BLOCK_N):
        k_pos, k, v = _load_kv_tile(
            k_cache_ptr,
            v_cache_ptr,
            table_ptr,
            kv_head,
            start,
            kv_begin,
            kv_end,
            stride_cb,
            stride_cs,
            stride_ch,
            q,
            BLOCK_SIZE,
            HEAD_DIM,
            HEAD_DIM_PAD,
            BLOCK_N,
            FP8,
        )
        s = _scores(q, k, qk_scale, softcap, SOFTCAP)
        if SLIDING:
            s = tl.where(_in_window(k_pos, q_pos, window), s, float("-inf"))
        acc, m_i, l_i = _online_softmax_step(acc, m_i, l_i, s, v)
    for start in range(tl.maximum(lo, shared_end), hi, BLOCK_N):
        k_pos, k, v = _load_kv_tile(
            k_cache_ptr,
            v_cache_ptr,
            table_ptr,
            kv_head,
            start,
            kv_begin,
            kv_end,
            stride_cb,
            stride_cs,
            stride_ch,
            q,
            BLOCK_SIZE,
            HEAD_DIM,
            HEAD_DIM_PAD,
            BLOCK_N,
            FP8,
        )
        visible = k_pos[None, :] <= q_pos[:, None]
        if SLIDING:
            visible = visible & _in_window(k_pos, q_pos, window)
        s = tl.where(visible, _scores(q, k, qk_scale, softcap, SOFTCAP), float("-inf"))
        acc, m_i, l_i = _online_softmax_step(acc, m_i, l_i, s, v)
    if FP8:
        acc = acc * v_scale  # V's scale, applied once (K's is in qk_scale)

    if SPLIT:  # partials [tokens, Hq, splits, HEAD_DIM_PAD]
        part = (tokens * tl.num_programs(1) + head) * num_splits + split
        _store_slice(part_out_ptr, part_lse_ptr, part, acc, m_i, l_i, dims, rows < q_len, HEAD_DIM_PAD)
    else:
        if SLIDING:  # padding rows (past q_len, never stored) may see no key in the window: no 0 / 0
            l_i = tl.where(l_i > 0, l_i, 1.0)
        out = acc / l_i[:, None]
        tl.store(
            out_ptr + tokens[:, None] * stride_ot + head * stride_oh + dims[None, :],
            out.to(out_ptr.dtype.element_ty),
            mask=io_mask,
        )


@triton.jit(do_not_specialize=["num_splits"])
def _merge_slices_kernel(
    part_out_ptr,
    part_lse_ptr,
    out_ptr,
    decode_span_ptr,
    num_splits,
    stride_ot,
    stride_oh,
    SPLITS_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
):
    """One prefill token's head, its num_splits slices' partials combined. The prefill tokens are those before
    the decode span's token row; rows past them (decodes, a graph's padding) return at once."""
    row = tl.program_id(0)
    head = tl.program_id(1)
    _, first_decode_token, _ = _decode_span(decode_span_ptr)
    if row >= first_decode_token:
        return
    splits = tl.arange(0, SPLITS_PAD)
    part = (row.to(tl.int64) * tl.num_programs(1) + head) * num_splits + splits  # [tokens, Hq, splits, ...]
    dims = tl.arange(0, HEAD_DIM_PAD)
    lse = tl.load(part_lse_ptr + part, mask=splits < num_splits, other=float("-inf"))
    # Finite max: the slice holding a query's own position saw a key (it is inside every window).
    weights = tl.exp2(lse - tl.max(lse, 0))
    parts = tl.load(
        part_out_ptr + part[:, None] * HEAD_DIM_PAD + dims[None, :], mask=(splits < num_splits)[:, None], other=0.0
    )
    out = tl.sum(weights[:, None] * parts, 0) / tl.sum(weights, 0)
    tl.store(
        out_ptr + row.to(tl.int64) * stride_ot + head * stride_oh + dims,
        out.to(out_ptr.dtype.element_ty),
        mask=dims < HEAD_DIM,
    )


def _slice_partials(
    out: torch.Tensor, num_rows: int, num_splits: int, head_dim_pad: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Split-KV partials [rows, Hq, splits, head_dim_pad] and their log-sum-exps [rows, Hq, splits]; without
    splits, `out` stands in for both (the kernels never touch them then)."""
    if num_splits == 1:
        return out, out
    shape = (num_rows, out.shape[1], num_splits)
    return (
        torch.empty(*shape, head_dim_pad, dtype=torch.float32, device=out.device),
        torch.empty(*shape, dtype=torch.float32, device=out.device),
    )


def _merge_slices(
    part_out: torch.Tensor, part_lse: torch.Tensor, out: torch.Tensor, decode_span: torch.Tensor, num_rows: int
) -> None:
    """Combine the prefill tokens' partials [tokens, Hq, splits, D] into `out`; num_rows: the tokens launched for."""
    _merge_slices_kernel[(num_rows, out.shape[1])](
        part_out,
        part_lse,
        out,
        decode_span,
        part_lse.shape[2],
        out.stride(0),
        out.stride(1),
        SPLITS_PAD=_pow2(MAX_PREFILL_SPLITS, floor=2),
        HEAD_DIM=out.shape[2],
        HEAD_DIM_PAD=part_out.shape[-1],
    )


def prefill_num_splits(num_tiles: int, num_heads: int, max_context: int, num_sms: int) -> int:
    """How many slices to cut each prefill tile's keys into: a chunk of a long prompt is a few tiles, each
    walking thousands of keys, on a GPU of a hundred SMs; slices give every SM about TARGET_PROGRAMS_PER_SM
    programs. Partials cost ~programs x BLOCK_M rows: bounded whatever the step's size."""
    programs = max(1, num_tiles * num_heads)
    wanted = triton.cdiv(TARGET_PROGRAMS_PER_SM * num_sms, programs)
    return max(1, min(wanted, max_context // MIN_SPLIT_TOKENS, MAX_PREFILL_SPLITS))


def prefill_attention(
    q: torch.Tensor,
    out: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    query_starts: torch.Tensor,
    tiles: torch.Tensor,
    scale: float,
    num_splits: int = 1,
    decode_span: torch.Tensor | None = None,
    sliding_window: int | None = None,
    softcap: float | None = None,
    kv_scales: tuple[float, float] = (1.0, 1.0),
) -> None:
    """Causal attention of the multi-token sequences, whose tokens come first in q, out [T, Hq, D].

    query_starts [P + 1]: token offsets of the sequences in q; tiles [2, num tiles]: (sequence, first
    query) of each PREFILL_BLOCK_M-query tile, a sequence of -1 for a tile that does nothing (a CUDA graph's
    padding); block_tables [>= P, W] and context_lens [>= P] by sequence. num_splits > 1 cuts each tile's
    keys into that many slices (prefill_num_splits), merged by a second pass over the prefill tokens, whose
    count the decode span holds (its second entry; None: every token of q). sliding_window, softcap: the
    layer's (None: none); kv_scales: a float8 store's (K's, V's)."""
    num_tokens, num_heads, head_dim = q.shape
    num_tiles = tiles.shape[1]
    head_dim_pad = _pow2(head_dim)
    split = num_splits > 1
    part_out, part_lse = _slice_partials(out, num_tokens, num_splits, head_dim_pad)
    _prefill_kernel[(num_tiles, num_heads, num_splits)](
        q,
        out,
        part_out,
        part_lse,
        k_cache,
        v_cache,
        block_tables,
        context_lens,
        query_starts,
        tiles,
        tiles.stride(0),
        scale * LOG2_E * kv_scales[0],  # K's scale folded into the scores'
        sliding_window or 0,
        (softcap or 0.0) * LOG2_E,
        kv_scales[1],
        q.stride(0),
        q.stride(1),
        out.stride(0),
        out.stride(1),
        *k_cache.stride()[:3],
        block_tables.stride(0),
        GROUP=num_heads // k_cache.shape[2],
        BLOCK_SIZE=k_cache.shape[1],
        HEAD_DIM=head_dim,
        HEAD_DIM_PAD=head_dim_pad,
        BLOCK_M=PREFILL_BLOCK_M,
        BLOCK_N=PREFILL_BLOCK_N,
        SPLIT=split,
        SLIDING=bool(sliding_window),
        SOFTCAP=bool(softcap),
        FP8=_is_fp8(k_cache),
        num_warps=4,
        num_stages=2,
    )
    if split:
        if decode_span is None:
            decode_span = torch.tensor([0, num_tokens, 0, 0], dtype=torch.int32, device=q.device)
        _merge_slices(part_out, part_lse, out, decode_span, num_tokens)


# ------------------------------------------------------------------------------------------- decode


@triton.jit(do_not_specialize=["stride_bt"])
def _decode_kernel(
    q_ptr,
    out_ptr,
    part_out_ptr,
    part_lse_ptr,
    k_cache_ptr,
    v_cache_ptr,
    block_tables_ptr,
    context_lens_ptr,
    decode_span_ptr,
    slice_seqs_ptr,
    slice_starts_ptr,
    merge_counts_ptr,
    qk_scale,
    window,
    softcap,
    v_scale,
    stride_qt,
    stride_qh,
    stride_ot,
    stride_oh,
    stride_cb,
    stride_cs,
    stride_ch,
    stride_bt,
    GROUP: tl.constexpr,
    GROUP_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    BLOCK_N: tl.constexpr,
    SLIDING: tl.constexpr,
    SOFTCAP: tl.constexpr,
    FP8: tl.constexpr,
    FP8_PAIRS: tl.constexpr,
    FP8_ASM: tl.constexpr,
    SEQ_MAJOR: tl.constexpr,
):
    if SEQ_MAJOR:  # grid (KV heads, slices): a slice's KV heads launch together
        kv_head = tl.program_id(0)
        item = tl.program_id(1)
        num_kv_heads = tl.num_programs(0)
    else:  # grid (slices, KV heads)
        item = tl.program_id(0)
        kv_head = tl.program_id(1)
        num_kv_heads = tl.num_programs(1)
    seq = tl.load(slice_seqs_ptr + item)
    if seq < 0:
        return  # a padding program (a graph launches for the most slices its steps may hold)
    first_seq, first_token, _ = _decode_span(decode_span_ptr)
    split_len = tl.load(decode_span_ptr + 3)
    first_slice = tl.load(slice_starts_ptr + seq)
    ctx = tl.load(context_lens_ptr + first_seq + seq)
    num_slices = tl.cdiv(ctx, split_len)  # as decode_slices counts them (its starts follow the launch order)
    lo = (item - first_slice) * split_len
    hi = tl.minimum(lo + split_len, ctx)
    if SLIDING:  # the query (position ctx - 1) sees the last `window` keys; a slice before them, nothing
        lo = tl.maximum(lo, ctx - window)
    table_ptr = block_tables_ptr + (first_seq + seq).to(tl.int64) * stride_bt
    token = (first_token + seq).to(tl.int64)  # its query's row in q and out

    # The KV head's whole query group is one [GROUP_PAD, D] operand: each K/V tile is loaded once for it.
    members = tl.arange(0, GROUP_PAD)
    heads = kv_head * GROUP + members
    dims = tl.arange(0, HEAD_DIM_PAD)
    io_mask = (members < GROUP)[:, None] & (dims < HEAD_DIM)[None, :]
    q_rows = q_ptr + token * stride_qt + heads[:, None] * stride_qh
    m_i = tl.full([GROUP_PAD], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([GROUP_PAD], dtype=tl.float32)
    if FP8_PAIRS:
        # The store's tiles split into even and odd dims (_load_kv_pairs), so the query and the output are too:
        # scores = q_even . k_even + q_odd . k_odd, and each half of the output its own accumulator, joined at
        # the end. bfloat16 queries take float16 products (the entries are float16 bits).
        pairs = tl.arange(0, HEAD_DIM_PAD // 2)
        pair_mask = (members < GROUP)[:, None] & (pairs < HEAD_DIM // 2)[None, :]
        q_even = tl.load(q_rows + 2 * pairs[None, :], mask=pair_mask, other=0.0)
        q_odd = tl.load(q_rows + 2 * pairs[None, :] + 1, mask=pair_mask, other=0.0)
        if q_even.dtype == tl.bfloat16:
            q_even = q_even.to(tl.float16)
            q_odd = q_odd.to(tl.float16)
        acc_even = tl.zeros([GROUP_PAD, HEAD_DIM_PAD // 2], dtype=tl.float32)
        acc_odd = tl.zeros([GROUP_PAD, HEAD_DIM_PAD // 2], dtype=tl.float32)
        for start in range(lo, hi, BLOCK_N):
            k_pos, k_even, k_odd, v_even, v_odd = _load_kv_pairs(
                k_cache_ptr,
                v_cache_ptr,
                table_ptr,
                kv_head,
                start,
                lo,
                hi,
                stride_cb,
                stride_cs,
                stride_ch,
                BLOCK_SIZE,
                HEAD_DIM,
                HEAD_DIM_PAD,
                BLOCK_N,
                FP8_ASM,
            )
            s = tl.dot(q_even, tl.trans(k_even.to(q_even.dtype)), input_precision="ieee")
            s = tl.dot(q_odd, tl.trans(k_odd.to(q_odd.dtype)), s, input_precision="ieee")
            s = tl.where(k_pos[None, :] < hi, _scaled_scores(s, qk_scale, softcap, SOFTCAP), float("-inf"))
            p, alpha, m_i, l_i = _softmax_weights(m_i, l_i, s)
            p = p.to(q_even.dtype)
            acc_even = acc_even * alpha[:, None] + tl.dot(p, v_even.to(p.dtype), input_precision="ieee")
            acc_odd = acc_odd * alpha[:, None] + tl.dot(p, v_odd.to(p.dtype), input_precision="ieee")
        acc = tl.reshape(tl.join(acc_even, acc_odd), [GROUP_PAD, HEAD_DIM_PAD])  # dims interleaved again
    else:
        q = tl.load(q_rows + dims[None, :], mask=io_mask, other=0.0)
        acc = tl.zeros([GROUP_PAD, HEAD_DIM_PAD], dtype=tl.float32)
        for start in range(lo, hi, BLOCK_N):
            k_pos, k, v = _load_kv_tile(
                k_cache_ptr,
                v_cache_ptr,
                table_ptr,
                kv_head,
                start,
                lo,
                hi,
                stride_cb,
                stride_cs,
                stride_ch,
                q,
                BLOCK_SIZE,
                HEAD_DIM,
                HEAD_DIM_PAD,
                BLOCK_N,
                FP8,
            )
            s = tl.where(k_pos[None, :] < hi, _scores(q, k, qk_scale, softcap, SOFTCAP), float("-inf"))
            acc, m_i, l_i = _online_softmax_step(acc, m_i, l_i, s, v)
    if FP8:
        acc = acc * v_scale  # V's scale, applied once (K's is in qk_scale)

    out_ptrs = out_ptr + token * stride_ot + heads[:, None] * stride_oh + dims[None, :]
    if num_slices == 1:
        tl.store(out_ptrs, (acc / l_i[:, None]).to(out_ptr.dtype.element_ty), mask=io_mask)
    else:
        # A cut context: each slice stores its partials [slices, Hq, HEAD_DIM_PAD] and counts itself done in
        # its (decode, KV head)'s counter; the last to count merges the group's slices. A merge launch would run
        # (decodes x q heads) programs every step, cut or not (~6 us a layer on the 8B shape with nothing cut).
        #   every thread's partial stored --barrier--> one acq_rel atomic_add (release: the stores before it;
        #   acquire, for the last: every other slice's) --> the last zeroes the counter (next layer's launch)
        # On sm_90 Triton emits st.global (partials), bar.sync, then thread 0 alone: atom.global.gpu.acq_rel.add,
        # its result through shared memory, bar.sync, and every thread's ld.global.cg of the partials after it:
        # the pattern of CUDA's grid sync (barrier, one thread's gpu-scope release/acquire, barrier).
        num_q_heads = num_kv_heads * GROUP
        part = item.to(tl.int64) * num_q_heads + heads
        _store_slice(part_out_ptr, part_lse_ptr, part, acc, m_i, l_i, dims, members < GROUP, HEAD_DIM_PAD)
        tl.debug_barrier()
        counter = merge_counts_ptr + seq * num_kv_heads + kv_head
        if tl.atomic_add(counter, 1, sem="acq_rel", scope="gpu") == num_slices - 1:
            tl.store(counter, 0)
            out = _merged_slices(
                part_out_ptr,
                part_lse_ptr,
                first_slice,
                num_slices,
                num_q_heads,
                heads,
                members < GROUP,
                GROUP_PAD,
                HEAD_DIM_PAD,
            )
            tl.store(out_ptrs, out.to(out_ptr.dtype.element_ty), mask=io_mask)


@triton.jit
def _merged_slices(
    part_out_ptr,
    part_lse_ptr,
    first_slice,
    num_slices,
    num_q_heads,
    heads,
    rows,
    ROWS_PAD: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
):
    """[rows, HEAD_DIM_PAD]: the partials of slices first_slice.. first_slice + num_slices - 1 of `heads`,
    weighted by their sums (exp2 of the log2-sum-exps against their max: finite, as the slice holding the
    query's own position saw a key). Loaded past the L1 cache (.cg): other SMs wrote them during this launch."""
    lse_max = tl.full([ROWS_PAD], float("-inf"), dtype=tl.float32)
    for j in range(num_slices):
        part = (first_slice + j).to(tl.int64) * num_q_heads + heads
        lse_max = tl.maximum(lse_max, tl.load(part_lse_ptr + part, mask=rows, other=0.0, cache_modifier=".cg"))
    dims = tl.arange(0, HEAD_DIM_PAD)
    acc = tl.zeros([ROWS_PAD, HEAD_DIM_PAD], dtype=tl.float32)
    weight_sum = tl.zeros([ROWS_PAD], dtype=tl.float32)
    for j in range(num_slices):
        part = (first_slice + j).to(tl.int64) * num_q_heads + heads
        weight = tl.exp2(tl.load(part_lse_ptr + part, mask=rows, other=0.0, cache_modifier=".cg") - lse_max)
        partial = tl.load(
            part_out_ptr + part[:, None] * HEAD_DIM_PAD + dims[None, :],
            mask=rows[:, None],
            other=0.0,
            cache_modifier=".cg",
        )
        acc += weight[:, None] * partial
        weight_sum += weight
    return acc / weight_sum[:, None]


@dataclass(frozen=True, slots=True)
class DecodeSlices:
    """The decodes' contexts cut into slices of one length, planned on the host: slice_len, the decode (index
    among the decodes) each slice belongs to [slices], in the order they launch, and each decode's first slice
    [decodes + 1; the last entry: how many in all]. A decode's slices are consecutive, ceil(context / slice_len)
    of them, slice j covering its keys [j * slice_len, (j + 1) * slice_len).

    Decodes launch longest first: programs start in launch order as earlier ones finish, so the long ones
    overlap the rest and the launch ends on short ones (W1's spread contexts, one H200: 3-8 % off a layer's
    decode, the more the fewer KV heads; docs/benchmarks.md)."""

    slice_len: int
    seqs: np.ndarray
    starts: np.ndarray

    @property
    def counts(self) -> np.ndarray:
        """How many slices each decode is cut into."""
        return np.bincount(self.seqs, minlength=len(self.starts) - 1)


def decode_slices(
    context_lens: np.ndarray, num_kv_heads: int, num_sms: int, capacity: int | None = None, slice_len: int = 0
) -> DecodeSlices:
    """One step's slices: programs for about TARGET_PROGRAMS_PER_SM per SM, no slice longer than about an SM's
    share of the step over that target (so the longest context sets no step's pace), none shorter than
    MIN_SPLIT_TOKENS, at most MAX_SPLITS of one context. capacity: the most slices the launch covers (a CUDA
    graph's decode_slice_capacity), at least two per decode. slice_len > 0 forces a length (tests, benchmarks)."""
    contexts = np.asarray(context_lens, dtype=np.int64)
    num_decodes = len(contexts)
    if not slice_len:
        # Slices enough for TARGET_PROGRAMS_PER_SM programs per SM, each about 1/TARGET of an SM's share of the
        # step, so no program sets the step's pace; many decodes fill the GPU unsplit: a context is cut only where
        # it is longer than that share (W1's 256 decodes of ~400 tokens on 8 KV heads: none, and no merge).
        target = triton.cdiv(TARGET_PROGRAMS_PER_SM * num_sms, num_kv_heads)
        if capacity is not None:  # slices <= total / slice_len + decodes <= target + decodes <= capacity
            target = min(target, capacity - num_decodes)
        longest = int(contexts.max(initial=1))
        slice_len = max(MIN_SPLIT_TOKENS, triton.cdiv(longest, MAX_SPLITS), triton.cdiv(int(contexts.sum()), target))
        slice_len = triton.cdiv(slice_len, DECODE_BLOCK_N) * DECODE_BLOCK_N
    counts = -(-contexts // slice_len)
    order = np.argsort(-contexts, kind="stable").astype(np.int32)  # longest first
    ends = np.cumsum(counts[order])
    starts = np.empty(num_decodes + 1, dtype=np.int32)
    starts[order] = ends - counts[order]
    starts[num_decodes] = ends[-1] if num_decodes else 0
    seqs = np.repeat(order, counts[order])
    if capacity is not None and len(seqs) > capacity:
        raise ValueError(f"{len(seqs)} decode slices of {slice_len} tokens exceed the launch's {capacity}")
    return DecodeSlices(slice_len, seqs, starts)


def decode_slice_capacity(decode_programs: int) -> int:
    """The most slices a CUDA graph's decode launch covers, for steps of up to decode_programs decodes: what
    decode_slices plans for them always fits."""
    return 2 * decode_programs + EXTRA_DECODE_SLICES


@dataclass(frozen=True, slots=True)
class DecodeTiles:
    """How a decode program walks its slice: keys per tile, warps, and software-pipeline stages (loads in flight)."""

    block_n: int = DECODE_BLOCK_N
    num_warps: int = 4
    num_stages: int = 2
    # How a float8 store's tiles meet the queries (FP8_PRODUCTS):
    #   "q"      each entry converted to q's dtype (e4m3 -> bfloat16: three conversion instructions an entry)
    #   "pairs"  the entries read as 16-bit pairs and their bits moved into float16 (_e4m3_pairs_as_f16), the
    #            even and odd dims products of their own; bfloat16 queries converted once to float16. Taken
    #            where the head dim is even and its padded width at least 32 (tl.dot's 16 a half); else "q".
    # ("pairs" takes queries within float16's range, |q| < 65504: a projection's output after a norm, as every
    # family here has, is orders of magnitude inside it; the entries, at most 448 / 256, always are.) One H200:
    # "pairs" 1.3-1.45x the bytes-at-a-time placing it replaced, 1.39x on W1's 8B batch (docs/benchmarks.md).
    fp8_products: str = "pairs"
    # Launch order: every KV head of one slice together (True), or each KV head's slices in turn (False). A
    # token's KV heads lie side by side in the store, so programs reading them at once read its rows whole: one
    # H200, longest first both ways, the 8B's heads 113.6 against 114.3 us (W1), 281 against 302 (128 x
    # 400-4,000), its TP=2 heads 62.1 against 63.7, the 1B's W1 decode step 2.32 against 2.39 ms; 256 x
    # 400-800 was 1 % slower (docs/benchmarks.md). The float8 store's was not measured.
    seq_major: bool = True


FP8_PRODUCTS = ("q", "pairs")


# Launch shapes measured faster than the default on Hopper for a (padded head dim, float8 store), W1's short
# contexts through 32k ones (`python -m benchmarks.decode_tiles`, docs/benchmarks.md).
DECODE_TILES: dict[tuple[int, bool], DecodeTiles] = {
    (128, False): DecodeTiles(64, 4, 4),  # H200, 8B shape: 1.02x the default
    (64, False): DecodeTiles(64, 2, 3),  # 1B shape: 1.12x (long contexts 1.2x)
    # Float8 stores, "pairs" (one H200, docs/results/fp8_kv_pairs_h200/): 128-wide heads (the 8B's 8
    # KV heads and the 70B's 4 of TP=2 alike) within 4 % of the best of 12 shapes in every case, the best at W1.
    # 64-wide (the 1B's): two warps and three stages 1.15x four warps and two (the geometric mean of the four
    # cases; W1's batch 41.4 against 50.2 us), the 1B's W1 with fp8 products 87,180 -> 90,944 tok/s, step 2.13
    # -> 1.97 ms (docs/results/decode_tiles_stages_h200/). Five to seven stages (two or three K/V tiles in
    # flight, not one) were slower for every head width and store there.
    (128, True): DecodeTiles(64, 4, 2, "pairs"),
    (64, True): DecodeTiles(64, 2, 3, "pairs"),
}


def decode_tiles(head_dim: int, fp8: bool) -> DecodeTiles:
    return DECODE_TILES.get((_pow2(head_dim), fp8), DecodeTiles())


def decode_merge_counts(max_decodes: int, num_kv_heads: int, device: torch.device) -> torch.Tensor:
    """The counters decode_attention's cut contexts count their finished slices in, one per (decode, KV head),
    for steps of up to max_decodes decodes: zero, and every launch leaves them zero, so one buffer serves
    every layer and step that runs after it on its stream (never two launches at once)."""
    return torch.zeros(max_decodes * num_kv_heads, dtype=torch.int32, device=device)


def decode_attention(
    q: torch.Tensor,
    out: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    decode_span: torch.Tensor,
    slice_seqs: torch.Tensor,
    slice_starts: torch.Tensor,
    merge_counts: torch.Tensor,
    sliding_window: int | None = None,
    softcap: float | None = None,
    kv_scales: tuple[float, float] = (1.0, 1.0),
    tiles: DecodeTiles | None = None,
) -> None:
    """One query per sequence, for the decode sequences of block_tables [S, W] and context_lens [S]:
    decode_span, int32 on the device, holds (first decode sequence, the token row of its query in q and
    out [T, Hq, D], number of decode sequences, slice length), the following ones' queries in the following
    rows. slice_seqs [slices launched] and slice_starts [>= decodes + 1], int32 on the device: a
    DecodeSlices' seqs (-1 past the step's own: programs that return at once) and starts. merge_counts:
    decode_merge_counts for at least slice_starts' decodes. sliding_window, softcap: the layer's (None: none);
    a slice that lies wholly before the window sees nothing and weighs nothing in the merge. kv_scales: a
    float8 store's. tiles: the launch shape (None: decode_tiles' for the head dim and store).

    One launch, merge included, whatever is cut: a CUDA graph launches it for its largest step, and the
    step's own slices (which contexts are cut) are read on the device. Offsets on the device rather than
    sliced tensors: Triton compiles a variant per pointer alignment, a slice's start moves with the prefill
    sequences and tokens in front of it, and a graph's replay can change only what the device reads."""
    num_heads, head_dim = q.shape[1], q.shape[2]
    num_kv_heads = k_cache.shape[2]
    group = num_heads // num_kv_heads
    head_dim_pad = _pow2(head_dim)
    num_slices = slice_seqs.shape[0]
    if num_slices == 0:
        return
    if merge_counts.numel() < (slice_starts.shape[0] - 1) * num_kv_heads:
        raise ValueError(
            f"{merge_counts.numel()} merge counters for {slice_starts.shape[0] - 1} decodes' {num_kv_heads} KV heads"
        )
    fp8 = _is_fp8(k_cache)
    tiles = tiles or decode_tiles(head_dim, fp8)
    fp8_pairs = fp8 and tiles.fp8_products == "pairs" and head_dim % 2 == 0 and head_dim_pad >= 32
    unit = E4M3_IN_F16_UNIT if fp8_pairs else 1.0  # entries placed as float16 bits hold 1/unit of their value
    part_out = torch.empty(num_slices, num_heads, head_dim_pad, dtype=torch.float32, device=q.device)
    part_lse = torch.empty(num_slices, num_heads, dtype=torch.float32, device=q.device)
    seq_major = tiles.seq_major and num_slices < 65536  # a grid's second axis holds at most 65,535
    _decode_kernel[(num_kv_heads, num_slices) if seq_major else (num_slices, num_kv_heads)](
        q,
        out,
        part_out,
        part_lse,
        k_cache,
        v_cache,
        block_tables,
        context_lens,
        decode_span,
        slice_seqs,
        slice_starts,
        merge_counts,
        scale * LOG2_E * kv_scales[0] * unit,  # K's scale folded into the scores'
        sliding_window or 0,
        (softcap or 0.0) * LOG2_E,
        kv_scales[1] * unit,
        q.stride(0),
        q.stride(1),
        out.stride(0),
        out.stride(1),
        *k_cache.stride()[:3],
        block_tables.stride(0),
        GROUP=group,
        GROUP_PAD=_pow2(group),
        BLOCK_SIZE=k_cache.shape[1],
        HEAD_DIM=head_dim,
        HEAD_DIM_PAD=head_dim_pad,
        BLOCK_N=tiles.block_n,
        SLIDING=bool(sliding_window),
        SOFTCAP=bool(softcap),
        FP8=fp8,
        FP8_PAIRS=fp8_pairs,
        FP8_ASM=q.is_cuda and not INTERPRETED,
        SEQ_MAJOR=seq_major,
        num_warps=tiles.num_warps,
        num_stages=tiles.num_stages,
    )
