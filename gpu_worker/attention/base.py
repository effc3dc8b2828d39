"""The attention backend interface.

A forward computes many sequences at once, their tokens flattened into one [T, ...] batch with no
padding. Sequences are ordered so that those computing several tokens (prefill chunks) come first and
those computing one token (decodes) last:

    tokens:    | seq0 chunk (q0 tokens) | seq1 chunk | ... | d0 | d1 | d2 |   T = sum of query lengths
    contexts:  each sequence attends to its cached KV plus its own new tokens, causally

Each layer first writes its new K/V into the paged store (slot_mapping), then attends by reading the
store through the block tables. Writing before reading is what lets a request attend to a shared prefix
that another request of the same forward is computing.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

# Puts host values (an array or nested lists) on the step's device as the given dtype, the copy queued, not
# waited for. The runner passes its staging ring's; whoever calls a backend or the sampler decides how.
Upload = Callable[[Any, torch.dtype], torch.Tensor]


@dataclass(slots=True)
class BatchLayout:
    query_lens: np.ndarray  # [S] int64, tokens computed this forward, per sequence
    context_lens: np.ndarray  # [S] int64, KV length after this forward (cached + new), per sequence
    # [S, W] int32, the one padded form of the block tables every consumer reads: row i holds the blocks
    # sequence i's context uses, then zeros (never read); W is a power of two so kernels see few strides.
    block_table: np.ndarray
    num_prefill_seqs: int  # sequences [0, num_prefill_seqs) have query_len > 1, the rest exactly 1

    @classmethod
    def build(
        cls, query_lens: list[int], context_lens: list[int], block_tables: list[list[int]], block_size: int
    ) -> BatchLayout:
        """block_tables may list blocks beyond a context (allocated ahead); only the used ones are kept."""
        used = [-(-n // block_size) for n in context_lens]
        width = 1 << (max(used) - 1).bit_length()
        table = np.zeros((len(block_tables), width), dtype=np.int32)
        for row, blocks, n in zip(table, block_tables, used):
            row[:n] = blocks[:n]
        return cls(
            np.asarray(query_lens, dtype=np.int64),
            np.asarray(context_lens, dtype=np.int64),
            table,
            sum(1 for n in query_lens if n > 1),
        )

    def slot_mapping(self, positions: np.ndarray, block_size: int) -> np.ndarray:
        """Flat KV-store slot of every computed token: its block (from its sequence's row) times block
        size plus its offset in the block. positions: [T], sequences' tokens in layout order."""
        seq_of_token = np.repeat(np.arange(len(self.query_lens)), self.query_lens)
        blocks = self.block_table[seq_of_token, positions // block_size].astype(np.int64)
        return blocks * block_size + positions % block_size


@dataclass(slots=True)
class StaticAttentionBuffers:
    """What a captured forward's attention reads: views of a CUDA graph's int32 device buffer, sized for the
    graph's largest step; each replay's step fills a prefix of each and marks the rest as padding."""

    slot_mapping: torch.Tensor  # [T] every token's KV slot (padding tokens: a scratch slot)
    context_lens: torch.Tensor  # [S]
    query_starts: torch.Tensor  # [P + 1] token offsets of the multi-token sequences
    prefill_tiles: torch.Tensor  # [2, tiles]: (sequence, first query) per tile, sequence -1 for padding; tiles may be 0
    # [4]: first decode sequence, its query's token row, number of decodes, their contexts' slice length
    decode_span: torch.Tensor
    # The decodes' contexts cut into slices (AttentionBackend.decode_slices): the decode of each slice [slices the
    # launch covers] (-1: padding) and each decode's first slice [decode_programs + 1].
    decode_slice_seqs: torch.Tensor
    decode_slice_starts: torch.Tensor
    block_tables: torch.Tensor  # [S, W]
    decode_programs: int  # the most decode sequences a step of the graph may hold
    # Whether padding tokens belong to no sequence (their outputs are zeros) rather than to one-token
    # sequences of their own in a scratch block.
    padding_outside_sequences: bool
    decode_only: bool  # every sequence of the graph's steps computes one token (a decode graph)


@dataclass(frozen=True, slots=True)
class LayerAttention:
    """What one layer asks of attention (this rank's heads): the options forward receives, and the shapes."""

    num_heads: int
    num_kv_heads: int
    head_dim: int
    scale: float
    sliding_window: int | None = None
    softcap: float | None = None


class AttentionBackend(ABC):
    """Builds per-forward metadata once, then runs every layer's attention with it."""

    # Whether forwards can be captured in CUDA graphs (static_metadata is implemented).
    supports_cuda_graphs = False

    def __init__(self, block_size: int):
        self.block_size = block_size

    def static_metadata(self, buffers: StaticAttentionBuffers, max_context: int) -> Any:
        """Metadata for a forward reading caller-owned device buffers, which the caller refills before each
        graph replay. Every launch shape must depend only on the buffers' shapes and max_context, never on
        their contents."""
        raise NotImplementedError(f"{type(self).__name__} cannot be captured in CUDA graphs")

    def decode_slice_capacity(self, decode_programs: int) -> int:
        """The slices a captured step's decode launch covers, for steps of up to decode_programs decodes."""
        raise NotImplementedError(f"{type(self).__name__} cannot be captured in CUDA graphs")

    def decode_slices(self, context_lens: np.ndarray, capacity: int) -> Any:
        """How a captured step's decodes split their contexts into slices (seqs, starts and slice_len, for the
        static buffers' decode_slice_* fields and the decode span's fourth entry); capacity: the slices the
        graph launches for."""
        raise NotImplementedError(f"{type(self).__name__} cannot be captured in CUDA graphs")

    @abstractmethod
    def build_metadata(self, layout: BatchLayout, slot_mapping: np.ndarray, upload: Upload) -> Any:
        """Everything the layers need, on the device `upload` copies to; called once per forward."""

    def prepare_replay(self, metadata: Any, layout: BatchLayout) -> None:  # noqa: B027 (optional: most need none)
        """Before a graph replays a step: whatever the host plans for it beyond the static buffers (FlashInfer's
        plan()), after the buffers' upload and outside the capture. metadata: the graph's static_metadata; layout:
        the step's own sequences (the graph's padding is the backend's to add). Nothing by default."""

    @abstractmethod
    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        metadata: Any,
        scale: float,
        *,
        sliding_window: int | None = None,
        softcap: float | None = None,
        kv_scales: tuple[float, float] = (1.0, 1.0),
    ) -> torch.Tensor:
        """q: [T, Hq, D]; k, v: [T, Hkv, D]; caches: [num_blocks, block_size, Hkv, D]. Returns [T, Hq, D].

        Caches of float8 e4m3 (--kv-cache-dtype fp8) hold K and V in units of the layer's kv_scales (K's, V's):
        new tokens are quantized on write and the context dequantized on load (gpu_worker/kv_cache.py).

        The layer's options: sliding_window, each query sees only itself and the sliding_window - 1 positions
        before it (transformers' rule: key > query - window); softcap, scores scale * q.k become
        softcap * tanh(score / softcap) before the mask and softmax (Gemma 2). None: neither."""
