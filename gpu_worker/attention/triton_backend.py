"""Attention in Triton kernels (gpu_worker/attention/triton_kernels.py): the CUDA backend.

build_metadata packs everything the kernels read into one int32 array (each field 16-byte aligned) and
moves it to the device in a single copy (the runner's staging ring); every field is a view into it:

    | slots [T] | context lens [S] | query starts [P+1] | tiles [2, num tiles] | decode span [3] | block tables [S, W] |

forward then costs a fixed handful of launches per layer, whatever the batch: store K/V, prefill (the
first P sequences) and decode (the rest, plus a merge when the context is split).

Steps are captured in CUDA graphs (gpu_worker/cuda_graphs.py) through static_metadata: the caller's
static buffers stand in for the packed array, and every launch shape (the split count included) follows
only the graph's size and the longest context the server allows. A graph is launched for the most its
steps can hold: padding tiles (sequence -1) and decode programs past the decode span's count return at
once, and the padding tokens' outputs are zero.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np
import torch

from gpu_worker.attention import triton_kernels as kernels
from gpu_worker.attention.base import AttentionBackend, BatchLayout, StaticAttentionBuffers, Upload

# The Triton interpreter (CPU, tests) has no SMs; pretending to be an H100 makes it take the same
# split-KV decisions the GPU would.
INTERPRETER_SMS = 132


@dataclass(slots=True)
class TritonAttentionMetadata:
    slot_mapping: torch.Tensor  # [T] flat KV-store slot of each new token
    context_lens: torch.Tensor  # [S]
    query_starts: torch.Tensor  # [P + 1] token offset of each prefill sequence, then the total
    prefill_tiles: torch.Tensor  # [2, tiles launched]: (sequence, first query) per PREFILL_BLOCK_M queries
    decode_span: torch.Tensor  # [3]: first decode sequence, its query's token row, number of decodes
    block_tables: torch.Tensor  # [S, W], W a power of two, rows padded with block 0 (never read)
    decode_programs: int  # decode sequences the decode launch covers (0: no launch)
    max_prefill_context: int
    max_decode_context: int
    num_sms: int
    zero_padding: bool = False  # whether tokens outside every sequence (a graph's padding) get zeros

    @property
    def prefill_programs(self) -> int:
        return self.prefill_tiles.shape[1]


class TritonAttention(AttentionBackend):
    supports_cuda_graphs = True

    def static_metadata(self, buffers: StaticAttentionBuffers, max_context: int) -> TritonAttentionMetadata:
        device = buffers.slot_mapping.device
        return TritonAttentionMetadata(
            slot_mapping=buffers.slot_mapping,
            context_lens=buffers.context_lens,
            query_starts=buffers.query_starts,
            prefill_tiles=buffers.prefill_tiles,
            decode_span=buffers.decode_span,
            block_tables=buffers.block_tables,
            decode_programs=buffers.decode_programs,
            max_prefill_context=max_context,
            max_decode_context=max_context,
            num_sms=_num_sms(device),
            zero_padding=buffers.padding_outside_sequences,
        )

    def build_metadata(self, layout: BatchLayout, slot_mapping: np.ndarray, upload: Upload) -> TritonAttentionMetadata:
        num_pre = layout.num_prefill_seqs
        query_lens = np.asarray(layout.query_lens, dtype=np.int32)
        context_lens = np.asarray(layout.context_lens, dtype=np.int32)
        query_starts = np.zeros(num_pre + 1, dtype=np.int32)
        np.cumsum(query_lens[:num_pre], out=query_starts[1:])
        tiles = prefill_tiles(query_lens[:num_pre])
        num_decode = len(context_lens) - num_pre
        decode_span = np.array([num_pre, query_starts[-1], num_decode], dtype=np.int32)
        parts = [slot_mapping.astype(np.int32), context_lens, query_starts, tiles, decode_span, layout.block_table]
        # One copy for all fields; each starts 16-byte aligned, as Triton specializes on pointer alignment.
        sizes = [-(-p.size // 4) * 4 for p in parts]
        packed = np.zeros(sum(sizes), dtype=np.int32)
        offsets = np.concatenate([[0], np.cumsum(sizes)[:-1]])
        for part, offset in zip(parts, offsets):
            packed[offset : offset + part.size] = part.ravel()
        flat = upload(packed, torch.int32)
        slots, ctx, starts, tile_t, span_t, table_t = (
            flat[o : o + p.size].view(p.shape) for p, o in zip(parts, offsets)
        )
        return TritonAttentionMetadata(
            slot_mapping=slots,
            context_lens=ctx,
            query_starts=starts,
            prefill_tiles=tile_t,
            decode_span=span_t,
            block_tables=table_t,
            decode_programs=num_decode,
            max_prefill_context=int(context_lens[:num_pre].max(initial=0)),
            max_decode_context=int(context_lens[num_pre:].max(initial=0)),
            num_sms=_num_sms(flat.device),
        )

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        metadata: TritonAttentionMetadata,
        scale: float,
    ) -> torch.Tensor:
        kernels.store_kv(k, v, k_cache, v_cache, metadata.slot_mapping)
        new = torch.zeros if metadata.zero_padding else torch.empty
        out = new(q.shape, dtype=q.dtype, device=q.device)
        if metadata.prefill_programs:
            # A graph launches for its largest step's tiles; its token count says how many real ones to expect.
            tiles = min(metadata.prefill_programs, -(-q.shape[0] // kernels.PREFILL_BLOCK_M))
            prefill_splits = kernels.prefill_num_splits(
                tiles, q.shape[1], metadata.max_prefill_context, metadata.num_sms
            )
            kernels.prefill_attention(
                q,
                out,
                k_cache,
                v_cache,
                metadata.block_tables,
                metadata.context_lens,
                metadata.query_starts,
                metadata.prefill_tiles,
                scale,
                prefill_splits,
                metadata.decode_span,
            )
        if metadata.decode_programs:
            num_splits = kernels.decode_num_splits(
                metadata.decode_programs, k_cache.shape[2], metadata.max_decode_context, metadata.num_sms
            )
            kernels.decode_attention(
                q,
                out,
                k_cache,
                v_cache,
                metadata.block_tables,
                metadata.context_lens,
                scale,
                metadata.max_decode_context,
                num_splits,
                metadata.decode_span,
                metadata.decode_programs,
            )
        return out


def prefill_tiles(query_lens: np.ndarray) -> np.ndarray:
    """[2, num tiles]: for every PREFILL_BLOCK_M queries of each sequence, (sequence, first query)."""
    per_seq = -(-query_lens // kernels.PREFILL_BLOCK_M)
    seqs = np.repeat(np.arange(len(query_lens), dtype=np.int32), per_seq)
    first_tile = np.repeat(np.cumsum(per_seq) - per_seq, per_seq)
    firsts = (np.arange(len(seqs)) - first_tile) * kernels.PREFILL_BLOCK_M
    return np.stack([seqs, firsts.astype(np.int32)])


@functools.cache
def _num_sms(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return INTERPRETER_SMS
