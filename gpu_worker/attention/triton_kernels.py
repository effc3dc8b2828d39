"""Triton kernels for attention over the paged KV store, and the functions that launch them.

    store_kv           grid (tokens,)                   one token's K and V, every KV head, into its slot
    prefill_attention  grid (query tiles, q heads,      BLOCK_M queries of one sequence against (a slice of)
                             splits)                     its context [+ merge: grid (tokens, q heads)]
    decode_attention   grid (seqs, kv heads, splits)    one query per q head of a KV head's group, against a
                       [+ merge: grid (seqs, q heads)]   slice of the context; the merge combines the slices

Every kernel reads context through the block table one token at a time (position // block_size picks
the block, position % block_size the slot in it), so a K/V tile may span several blocks and any block
size works. Softmax is online (running max and sum, rescaled per tile) in float32, in base 2: scores are
scaled by scale * log2(e) so exp2 can be used.

Head dims that are not a power of two (and group sizes, head counts) are padded to one with masked
loads; tl.dot wants every side at least 16, hence the floors of 16 below.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

LOG2_E = 1.4426950408889634
PREFILL_BLOCK_M = 64  # queries per prefill program; the host splits sequences into tiles of this size
PREFILL_BLOCK_N = 64
DECODE_BLOCK_N = 64
# Split-KV: decode runs one program per (sequence, KV head); with few sequences that leaves most SMs idle
# while each program walks a long context. Splitting the context gives every SM about this many
# programs, but never slices shorter than MIN_SPLIT_TOKENS (the merge costs a pass over the partials).
TARGET_PROGRAMS_PER_SM = 8
MIN_SPLIT_TOKENS = 256
MAX_SPLITS = 32
MAX_PREFILL_SPLITS = 8


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
    tl.store(k_cache_ptr + dst, k, mask=mask)
    tl.store(v_cache_ptr + dst, v, mask=mask)


def store_kv(
    k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """k, v: [T, Hkv, D] -> caches [num_blocks, block_size, Hkv, D] at the flat slots slot_mapping [T].

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
    )


# ------------------------------------------------------------------------------ shared tile helpers


@triton.jit
def _load_kv_tile(
    k_cache_ptr,
    v_cache_ptr,
    table_ptr,
    kv_head,
    start,
    end,
    stride_cb,
    stride_cs,
    stride_ch,
    BLOCK_SIZE: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    """K and V [BLOCK_N, HEAD_DIM_PAD] of context positions start.., zero at positions >= end."""
    pos = start + tl.arange(0, BLOCK_N)
    in_context = pos < end
    block = tl.load(table_ptr + pos // BLOCK_SIZE, mask=in_context, other=0).to(tl.int64)
    rows = block * stride_cb + (pos % BLOCK_SIZE) * stride_cs + kv_head * stride_ch
    dims = tl.arange(0, HEAD_DIM_PAD)
    offsets = rows[:, None] + dims[None, :]
    mask = in_context[:, None] & (dims < HEAD_DIM)[None, :]
    k = tl.load(k_cache_ptr + offsets, mask=mask, other=0.0)
    v = tl.load(v_cache_ptr + offsets, mask=mask, other=0.0)
    return pos, k, v


@triton.jit
def _decode_span(decode_span_ptr):
    """The decodes' place in the batch, read on the device so that a CUDA graph's replay sees each step's:
    (first decode sequence, its query's token row, number of decode sequences)."""
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
def _scores(q, k, qk_scale):
    """q [M, D] . k [N, D]^T in float32, in log2 units. ieee: float32 inputs must not drop to tf32."""
    return tl.dot(q, tl.trans(k), input_precision="ieee") * qk_scale


@triton.jit
def _online_softmax_step(acc, m_i, l_i, s, v):
    """Folds one tile of scores s [M, N] (masked ones -inf) and values v [N, D] into the running state.

    A row that has seen no visible key yet (a slice of the context that starts past its position) keeps
    max -inf, sum 0 and acc 0: its exponents are taken against 0 rather than -inf (exp2(-inf - -inf) is NaN)."""
    m_new = tl.maximum(m_i, tl.max(s, 1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m_i - m_safe)
    p = tl.exp2(s - m_safe[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee")
    return acc, m_new, l_i


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

    # Query i sits at context position ctx - q_len + i and sees keys up to it:
    #   keys [0, shared_end)         visible to every query of the tile: no mask
    #   keys [shared_end, kv_end)    the causal diagonal: masked per (query, key)
    q_pos = ctx - q_len + rows
    first_pos = ctx - q_len + first
    kv_end = tl.minimum(first_pos + BLOCK_M, ctx)
    shared_end = (first_pos + 1) // BLOCK_N * BLOCK_N

    # Split-KV: this program takes one slice of [0, kv_end), whole BLOCK_N tiles; a later pass merges them.
    num_splits = tl.num_programs(2)
    slice_len = tl.cdiv(tl.cdiv(kv_end, BLOCK_N), num_splits) * BLOCK_N
    lo = split * slice_len
    hi = tl.minimum(lo + slice_len, kv_end)

    acc = tl.zeros([BLOCK_M, HEAD_DIM_PAD], dtype=tl.float32)
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    for start in range(lo, tl.minimum(hi, shared_end), BLOCK_N):
        _, k, v = _load_kv_tile(
            k_cache_ptr,
            v_cache_ptr,
            table_ptr,
            kv_head,
            start,
            kv_end,
            stride_cb,
            stride_cs,
            stride_ch,
            BLOCK_SIZE,
            HEAD_DIM,
            HEAD_DIM_PAD,
            BLOCK_N,
        )
        acc, m_i, l_i = _online_softmax_step(acc, m_i, l_i, _scores(q, k, qk_scale), v)
    for start in range(tl.maximum(lo, shared_end), hi, BLOCK_N):
        k_pos, k, v = _load_kv_tile(
            k_cache_ptr,
            v_cache_ptr,
            table_ptr,
            kv_head,
            start,
            kv_end,
            stride_cb,
            stride_cs,
            stride_ch,
            BLOCK_SIZE,
            HEAD_DIM,
            HEAD_DIM_PAD,
            BLOCK_N,
        )
        s = tl.where(k_pos[None, :] <= q_pos[:, None], _scores(q, k, qk_scale), float("-inf"))
        acc, m_i, l_i = _online_softmax_step(acc, m_i, l_i, s, v)

    if SPLIT:  # partials [tokens, Hq, splits, HEAD_DIM_PAD]
        part = (tokens * tl.num_programs(1) + head) * num_splits + split
        _store_slice(part_out_ptr, part_lse_ptr, part, acc, m_i, l_i, dims, rows < q_len, HEAD_DIM_PAD)
    else:
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
    DECODES: tl.constexpr,
    SPLITS_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
):
    """One row's head, its slices' partials combined. DECODES: rows are the decode sequences, whose queries
    start at the decode span's token row; else rows are the prefill tokens, the ones before it. Rows past
    them (a graph's padding) return at once."""
    row = tl.program_id(0)
    head = tl.program_id(1)
    _, first_decode_token, num_decodes = _decode_span(decode_span_ptr)
    if DECODES:
        num_rows = num_decodes
        token = first_decode_token + row
    else:
        num_rows = first_decode_token
        token = row
    if row >= num_rows:
        return
    splits = tl.arange(0, SPLITS_PAD)
    dims = tl.arange(0, HEAD_DIM_PAD)
    part = (row.to(tl.int64) * tl.num_programs(1) + head) * num_splits + splits
    lse = tl.load(part_lse_ptr + part, mask=splits < num_splits, other=float("-inf"))
    # Finite max: the slice holding a query's own position (a decode's first slice) saw a key.
    weights = tl.exp2(lse - tl.max(lse, 0))
    parts = tl.load(
        part_out_ptr + part[:, None] * HEAD_DIM_PAD + dims[None, :], mask=(splits < num_splits)[:, None], other=0.0
    )
    out = tl.sum(weights[:, None] * parts, 0) / tl.sum(weights, 0)
    tl.store(
        out_ptr + token.to(tl.int64) * stride_ot + head * stride_oh + dims,
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
    part_out: torch.Tensor,
    part_lse: torch.Tensor,
    out: torch.Tensor,
    decode_span: torch.Tensor,
    num_rows: int,
    decodes: bool,
) -> None:
    """Combine the partials of num_rows rows (the decodes, or the prefill tokens) into `out`."""
    num_splits = part_lse.shape[2]
    _merge_slices_kernel[(num_rows, out.shape[1])](
        part_out,
        part_lse,
        out,
        decode_span,
        num_splits,
        out.stride(0),
        out.stride(1),
        DECODES=decodes,
        SPLITS_PAD=_pow2(MAX_SPLITS if decodes else MAX_PREFILL_SPLITS, floor=2),
        HEAD_DIM=out.shape[2],
        HEAD_DIM_PAD=part_out.shape[3],
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
) -> None:
    """Causal attention of the multi-token sequences, whose tokens come first in q, out [T, Hq, D].

    query_starts [P + 1]: token offsets of the sequences in q; tiles [2, num tiles]: (sequence, first
    query) of each PREFILL_BLOCK_M-query tile, a sequence of -1 for a tile that does nothing (a CUDA graph's
    padding); block_tables [>= P, W] and context_lens [>= P] by sequence. num_splits > 1 cuts each tile's
    keys into that many slices (prefill_num_splits), merged by a second pass over the prefill tokens, whose
    count the decode span holds (its second entry; None: every token of q)."""
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
        scale * LOG2_E,
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
        num_warps=4,
        num_stages=2,
    )
    if split:
        if decode_span is None:
            decode_span = torch.tensor([0, num_tokens, 0], dtype=torch.int32, device=q.device)
        _merge_slices(part_out, part_lse, out, decode_span, num_tokens, decodes=False)


# ------------------------------------------------------------------------------------------- decode


@triton.jit(do_not_specialize=["split_len", "stride_bt"])
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
    qk_scale,
    split_len,
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
    SPLIT: tl.constexpr,
):
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    first_seq, first_token, num_seqs = _decode_span(decode_span_ptr)
    if seq >= num_seqs:
        return  # a padding program (a graph launches for the most decodes its step may hold)
    ctx = tl.load(context_lens_ptr + first_seq + seq)
    lo = split * split_len
    hi = tl.minimum(lo + split_len, ctx)
    table_ptr = block_tables_ptr + (first_seq + seq).to(tl.int64) * stride_bt
    token = (first_token + seq).to(tl.int64)  # its query's row in q and out

    # The KV head's whole query group is one [GROUP_PAD, D] operand: each K/V tile is loaded once for it.
    members = tl.arange(0, GROUP_PAD)
    heads = kv_head * GROUP + members
    dims = tl.arange(0, HEAD_DIM_PAD)
    io_mask = (members < GROUP)[:, None] & (dims < HEAD_DIM)[None, :]
    q = tl.load(q_ptr + token * stride_qt + heads[:, None] * stride_qh + dims[None, :], mask=io_mask, other=0.0)

    acc = tl.zeros([GROUP_PAD, HEAD_DIM_PAD], dtype=tl.float32)
    m_i = tl.full([GROUP_PAD], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([GROUP_PAD], dtype=tl.float32)
    for start in range(lo, hi, BLOCK_N):
        k_pos, k, v = _load_kv_tile(
            k_cache_ptr,
            v_cache_ptr,
            table_ptr,
            kv_head,
            start,
            hi,
            stride_cb,
            stride_cs,
            stride_ch,
            BLOCK_SIZE,
            HEAD_DIM,
            HEAD_DIM_PAD,
            BLOCK_N,
        )
        s = tl.where(k_pos[None, :] < hi, _scores(q, k, qk_scale), float("-inf"))
        acc, m_i, l_i = _online_softmax_step(acc, m_i, l_i, s, v)

    if SPLIT:  # partials [seqs, Hq, splits, HEAD_DIM_PAD]
        part = (seq * tl.num_programs(1) * GROUP + heads) * tl.num_programs(2) + split
        _store_slice(part_out_ptr, part_lse_ptr, part, acc, m_i, l_i, dims, members < GROUP, HEAD_DIM_PAD)
    else:
        tl.store(
            out_ptr + token * stride_ot + heads[:, None] * stride_oh + dims[None, :],
            (acc / l_i[:, None]).to(out_ptr.dtype.element_ty),
            mask=io_mask,
        )


def decode_num_splits(num_seqs: int, num_kv_heads: int, max_context: int, num_sms: int) -> int:
    """How many slices to cut each decode context into: enough programs to occupy the GPU."""
    programs = num_seqs * num_kv_heads
    wanted = triton.cdiv(TARGET_PROGRAMS_PER_SM * num_sms, programs)
    return max(1, min(wanted, max_context // MIN_SPLIT_TOKENS, MAX_SPLITS))


def decode_attention(
    q: torch.Tensor,
    out: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    max_context: int,
    num_splits: int,
    decode_span: torch.Tensor | None = None,
    num_programs: int | None = None,
) -> None:
    """One query per sequence, for the decode sequences of block_tables [S, W] and context_lens [S]:
    decode_span, int32 on the device, holds (first decode sequence, the token row of its query in q and
    out [T, Hq, D], number of decode sequences), the following ones' queries in the following rows; None:
    every sequence decodes, from row 0. num_programs: how many sequences the launch covers (at least the
    number of decodes; programs past it return at once): a CUDA graph's launch is sized for its largest step.

    Offsets on the device rather than sliced tensors: Triton compiles a variant per pointer alignment, a
    slice's start moves with the prefill sequences and tokens in front of it, and a graph's replay can change
    only what the device reads."""
    if decode_span is None:
        decode_span = torch.tensor([0, 0, context_lens.shape[0]], dtype=torch.int32, device=q.device)
    num_seqs = context_lens.shape[0] if num_programs is None else num_programs
    num_heads, head_dim = q.shape[1], q.shape[2]
    num_kv_heads = k_cache.shape[2]
    group = num_heads // num_kv_heads
    head_dim_pad = _pow2(head_dim)
    # Slices are whole tiles; rounding up may leave fewer slices than asked for.
    split_len = triton.cdiv(triton.cdiv(max_context, num_splits), DECODE_BLOCK_N) * DECODE_BLOCK_N
    num_splits = triton.cdiv(max_context, split_len)
    split = num_splits > 1
    part_out, part_lse = _slice_partials(out, num_seqs, num_splits, head_dim_pad)
    _decode_kernel[(num_seqs, num_kv_heads, num_splits)](
        q,
        out,
        part_out,
        part_lse,
        k_cache,
        v_cache,
        block_tables,
        context_lens,
        decode_span,
        scale * LOG2_E,
        split_len,
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
        BLOCK_N=DECODE_BLOCK_N,
        SPLIT=split,
        num_warps=4,
        num_stages=2,
    )
    if split:
        _merge_slices(part_out, part_lse, out, decode_span, num_seqs, decodes=True)
