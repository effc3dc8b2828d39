"""Attention in Triton kernels (gpu_worker/attention/triton_kernels.py): the CUDA backend.

build_metadata packs everything the kernels read into one int32 array (each field 16-byte aligned) and
moves it to the device in a single copy (the runner's staging ring); every field is a view into it:

    | slots [T] | context lens [S] | query starts [P+1] | tiles [2, num tiles] | decode span [4] |
    | decode slices' sequences [slices] | decode slices' starts [D+1] | block tables [S, W] |

forward then costs a fixed handful of launches per layer, whatever the batch: store K/V, prefill (the
first P sequences) and decode (the rest, one program per slice of their contexts; the last slice of a context
cut in several to finish merges them, counting in the backend's merge counters, one launch whether or not
anything was cut).

Steps are captured in CUDA graphs (gpu_worker/cuda_graphs.py) through static_metadata: the caller's
static buffers stand in for the packed array, and every launch shape (the prefill split count included)
follows only the graph's size and the longest context the server allows. A graph is launched for the most
its steps can hold: padding tiles (sequence -1), decode slices (sequence -1) and prefill merge rows past the
decode span's token row return at once, and the padding tokens' outputs are zero. The decode slices are
planned per step on the host (fill_decode_slices), which the graphs' fillers call too.
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
    # [4]: first decode sequence, its query's token row, number of decodes, their contexts' slice length
    decode_span: torch.Tensor
    decode_slice_seqs: torch.Tensor  # [slices launched]: the decode each slice belongs to, -1 for padding
    decode_slice_starts: torch.Tensor  # [>= decodes + 1]: each decode's first slice
    decode_merge_counts: torch.Tensor  # kernels.decode_merge_counts, for decode_slice_starts' decodes
    block_tables: torch.Tensor  # [S, W], W a power of two, rows padded with block 0 (never read)
    decode_programs: int  # the most decode sequences a step holds (0: no decode launch)
    max_prefill_context: int
    num_sms: int
    zero_padding: bool = False  # whether tokens outside every sequence (a graph's padding) get zeros

    @property
    def prefill_programs(self) -> int:
        return self.prefill_tiles.shape[1]


class TritonAttention(AttentionBackend):
    supports_cuda_graphs = True

    def __init__(self, block_size: int, num_kv_heads: int = 1, device: torch.device | None = None):
        """num_kv_heads (the model's, on this rank) and the device's SMs size the decodes' slices: how many
        programs keep the GPU busy."""
        super().__init__(block_size)
        self.num_kv_heads = num_kv_heads
        self.num_sms = _num_sms(device or torch.device("cpu"))
        self._merge_counts: torch.Tensor | None = None

    def merge_counts(self, max_decodes: int, device: torch.device) -> torch.Tensor:
        """The decode kernel's merge counters (kernels.decode_merge_counts) for steps of up to max_decodes
        decodes: one buffer for every step and graph, as the worker runs them on one stream; a larger one when
        a step needs it (the graphs captured before keep theirs: their metadata holds it)."""
        need = max_decodes * self.num_kv_heads
        counts = self._merge_counts
        if counts is None or counts.numel() < need or counts.device != device:
            counts = self._merge_counts = kernels.decode_merge_counts(max_decodes, self.num_kv_heads, device)
        return counts

    def decode_slice_capacity(self, decode_programs: int) -> int:
        return kernels.decode_slice_capacity(decode_programs)

    def decode_slices(self, context_lens: np.ndarray, capacity: int | None = None) -> kernels.DecodeSlices:
        """The decodes' slices for one step (kernels.decode_slices); capacity: a CUDA graph's launch size."""
        return kernels.decode_slices(context_lens, self.num_kv_heads, self.num_sms, capacity)

    def static_metadata(self, buffers: StaticAttentionBuffers, max_context: int) -> TritonAttentionMetadata:
        return TritonAttentionMetadata(
            slot_mapping=buffers.slot_mapping,
            context_lens=buffers.context_lens,
            query_starts=buffers.query_starts,
            prefill_tiles=buffers.prefill_tiles,
            decode_span=buffers.decode_span,
            decode_slice_seqs=buffers.decode_slice_seqs,
            decode_slice_starts=buffers.decode_slice_starts,
            decode_merge_counts=self.merge_counts(buffers.decode_programs, buffers.decode_span.device),
            block_tables=buffers.block_tables,
            decode_programs=buffers.decode_programs,
            max_prefill_context=max_context,
            num_sms=self.num_sms,
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
        slices = self.decode_slices(context_lens[num_pre:])
        decode_span = np.array([num_pre, query_starts[-1], num_decode, slices.slice_len], dtype=np.int32)
        parts = [
            slot_mapping.astype(np.int32),
            context_lens,
            query_starts,
            tiles,
            decode_span,
            slices.seqs,
            slices.starts,
            layout.block_table,
        ]
        # One copy for all fields; each starts 16-byte aligned, as Triton specializes on pointer alignment.
        sizes = [-(-p.size // 4) * 4 for p in parts]
        packed = np.zeros(sum(sizes), dtype=np.int32)
        offsets = np.concatenate([[0], np.cumsum(sizes)[:-1]])
        for part, offset in zip(parts, offsets):
            packed[offset : offset + part.size] = part.ravel()
        flat = upload(packed, torch.int32)
        slots, ctx, starts, tile_t, span_t, slice_seqs, slice_starts, table_t = (
            flat[o : o + p.size].view(p.shape) for p, o in zip(parts, offsets)
        )
        return TritonAttentionMetadata(
            slot_mapping=slots,
            context_lens=ctx,
            query_starts=starts,
            prefill_tiles=tile_t,
            decode_span=span_t,
            decode_slice_seqs=slice_seqs,
            decode_slice_starts=slice_starts,
            decode_merge_counts=self.merge_counts(num_decode, flat.device),
            block_tables=table_t,
            decode_programs=num_decode,
            max_prefill_context=int(context_lens[:num_pre].max(initial=0)),
            num_sms=self.num_sms,
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
        *,
        sliding_window: int | None = None,
        softcap: float | None = None,
        kv_scales: tuple[float, float] = (1.0, 1.0),
    ) -> torch.Tensor:
        kernels.store_kv(k, v, k_cache, v_cache, metadata.slot_mapping, kv_scales)
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
                sliding_window,
                softcap,
                kv_scales,
            )
        if metadata.decode_programs:
            kernels.decode_attention(
                q,
                out,
                k_cache,
                v_cache,
                metadata.block_tables,
                metadata.context_lens,
                scale,
                metadata.decode_span,
                metadata.decode_slice_seqs,
                metadata.decode_slice_starts,
                metadata.decode_merge_counts,
                sliding_window,
                softcap,
                kv_scales,
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
