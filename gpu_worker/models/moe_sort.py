"""A batch's (token, expert) pairs sorted by expert into blocks of rows, each block one expert's, for the grouped
matmuls of models/fused_moe.py: a counting sort in three launches (torch's sort, searches and scatters took
about twenty), with no host reads and sizes fixed by the pair count, so CUDA graphs capture it.

    count    grid (chunks,)  each chunk's pairs per expert -> counts [chunks, E]; a share of rows set to the
                             sentinel (the pair count: no pair)
    offsets  grid (1,)       each expert's padded start (experts in order, each one's pairs rounded up to whole
                             blocks) and each chunk's first place in it -> offsets [chunks, E], padded_ends [E]
    place    grid (chunks,)  each pair to its place: its chunk's offset for its expert + the pairs of that
                             expert before it in the chunk; a share of the blocks' experts from padded_ends

Within an expert the pairs keep their order (chunk, then place in the chunk): the same rows every run. The
arguments that change with the token count are not specialized on: no compile after the warm-up.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit(do_not_specialize=["num_pairs", "num_rows", "rows_per_program"])
def _count_kernel(
    ids_ptr, counts_ptr, rows_ptr, num_pairs, num_rows, rows_per_program, E_PAD: tl.constexpr, CHUNK: tl.constexpr
):
    chunk = tl.program_id(0)
    pairs = chunk * CHUNK + tl.arange(0, CHUNK)
    experts = tl.arange(0, E_PAD)
    ids = tl.load(ids_ptr + pairs, mask=pairs < num_pairs, other=-1)
    hits = (ids[:, None] == experts[None, :]).to(tl.int32)
    tl.store(counts_ptr + chunk * E_PAD + experts, tl.sum(hits, 0))
    first = chunk * rows_per_program
    for start in range(first, first + rows_per_program, CHUNK):
        slots = start + tl.arange(0, CHUNK)
        sentinel = tl.zeros([CHUNK], dtype=tl.int32) + num_pairs
        tl.store(rows_ptr + slots, sentinel, mask=(slots < num_rows) & (slots < first + rows_per_program))


@triton.jit(do_not_specialize=["num_chunks"])
def _offsets_kernel(
    counts_ptr,
    offsets_ptr,
    padded_ends_ptr,
    num_chunks,
    E_PAD: tl.constexpr,
    BLOCK_M: tl.constexpr,
    CHUNKS_TILE: tl.constexpr,
):
    experts = tl.arange(0, E_PAD)
    totals = tl.zeros([E_PAD], dtype=tl.int32)
    for start in range(0, num_chunks, CHUNKS_TILE):
        chunks = start + tl.arange(0, CHUNKS_TILE)
        at = chunks[:, None] * E_PAD + experts[None, :]
        totals += tl.sum(tl.load(counts_ptr + at, mask=(chunks < num_chunks)[:, None], other=0), 0)
    padded = (totals + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    ends = tl.cumsum(padded, 0)
    tl.store(padded_ends_ptr + experts, ends)
    running = ends - padded  # the next free place of each expert
    for start in range(0, num_chunks, CHUNKS_TILE):
        chunks = start + tl.arange(0, CHUNKS_TILE)
        at = chunks[:, None] * E_PAD + experts[None, :]
        mask = (chunks < num_chunks)[:, None]
        tile = tl.load(counts_ptr + at, mask=mask, other=0)
        tl.store(offsets_ptr + at, running[None, :] + tl.cumsum(tile, 0) - tile, mask=mask)
        running += tl.sum(tile, 0)


@triton.jit(do_not_specialize=["num_pairs", "num_blocks", "blocks_per_program"])
def _place_kernel(
    ids_ptr,
    offsets_ptr,
    padded_ends_ptr,
    rows_ptr,
    block_experts_ptr,
    num_pairs,
    num_blocks,
    blocks_per_program,
    NUM_EXPERTS: tl.constexpr,
    E_PAD: tl.constexpr,
    CHUNK: tl.constexpr,
    BLOCK_M: tl.constexpr,
):
    chunk = tl.program_id(0)
    pairs = chunk * CHUNK + tl.arange(0, CHUNK)
    experts = tl.arange(0, E_PAD)
    ids = tl.load(ids_ptr + pairs, mask=pairs < num_pairs, other=-1)
    hits = (ids[:, None] == experts[None, :]).to(tl.int32)
    earlier = tl.sum((tl.cumsum(hits, 0) - hits) * hits, 1)  # this chunk's pairs of the same expert before it
    offsets = tl.load(offsets_ptr + chunk * E_PAD + experts)
    tl.store(rows_ptr + tl.sum(hits * offsets[None, :], 1) + earlier, pairs, mask=pairs < num_pairs)
    # A block's expert: how many experts' padded ranges end at or before its first row (NUM_EXPERTS: unused).
    ends = tl.load(padded_ends_ptr + experts)
    first = chunk * blocks_per_program
    for start in range(first, first + blocks_per_program, CHUNK):
        blocks = start + tl.arange(0, CHUNK)
        ended = (ends[None, :] <= (blocks * BLOCK_M)[:, None]) & (experts < NUM_EXPERTS)[None, :]
        mask = (blocks < num_blocks) & (blocks < first + blocks_per_program)
        tl.store(block_experts_ptr + blocks, tl.sum(ended.to(tl.int32), 1), mask=mask)


def sort_by_expert(ids: torch.Tensor, num_experts: int, block_m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """ids [T, k] (pair p = t * k + j: token t's j-th expert) -> int32
    rows [blocks * block_m]: expert 0's pairs, padded with the sentinel T * k to a multiple of block_m, then
                             expert 1's, ...; as many blocks as any routing of T tokens can need,
                             T * k + min(E, T * k) * (block_m - 1) rows rounded up to block_m
    block_experts [blocks]:  each block's expert; E for the unused blocks past the last expert's."""
    flat = ids.flatten()
    num_pairs, device = flat.numel(), flat.device
    num_blocks = triton.cdiv(num_pairs + min(num_experts, num_pairs) * (block_m - 1), block_m)
    e_pad = triton.next_power_of_2(max(num_experts, 16))
    chunk = max(16, min(1024, 8192 // e_pad))  # a program's [chunk, E] one-hot stays in registers
    num_chunks = triton.cdiv(num_pairs, chunk)
    counts = torch.empty(num_chunks, e_pad, dtype=torch.int32, device=device)
    offsets = torch.empty_like(counts)
    padded_ends = torch.empty(e_pad, dtype=torch.int32, device=device)
    rows = torch.empty(num_blocks * block_m, dtype=torch.int32, device=device)
    block_experts = torch.empty(num_blocks, dtype=torch.int32, device=device)
    _count_kernel[(num_chunks,)](
        flat, counts, rows, num_pairs, rows.numel(), triton.cdiv(rows.numel(), num_chunks), E_PAD=e_pad, CHUNK=chunk
    )
    _offsets_kernel[(1,)](
        counts, offsets, padded_ends, num_chunks, E_PAD=e_pad, BLOCK_M=block_m, CHUNKS_TILE=max(1, 4096 // e_pad)
    )
    _place_kernel[(num_chunks,)](
        flat,
        offsets,
        padded_ends,
        rows,
        block_experts,
        num_pairs,
        num_blocks,
        triton.cdiv(num_blocks, num_chunks),
        NUM_EXPERTS=num_experts,
        E_PAD=e_pad,
        CHUNK=chunk,
        BLOCK_M=block_m,
    )
    return rows, block_experts
