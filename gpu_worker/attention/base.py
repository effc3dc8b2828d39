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
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from gpu_worker.host_copy import StagingRing


@dataclass(slots=True)
class BatchLayout:
    query_lens: list[int]  # tokens computed this forward, per sequence
    context_lens: list[int]  # KV length after this forward (cached + new), per sequence
    block_tables: list[list[int]]
    num_prefill_seqs: int  # sequences [0, num_prefill_seqs) have query_len > 1, the rest exactly 1

    @property
    def num_tokens(self) -> int:
        return sum(self.query_lens)


class AttentionBackend(ABC):
    """Builds per-forward metadata once, then runs every layer's attention with it."""

    # Whether decode-only forwards can be captured in CUDA graphs (static_decode_metadata is implemented).
    supports_cuda_graphs = False

    def __init__(self, block_size: int):
        self.block_size = block_size

    def static_decode_metadata(self, slot_mapping: torch.Tensor, context_lens: torch.Tensor,
                               block_tables: torch.Tensor, max_context: int) -> Any:
        """Metadata for a decode-only forward reading caller-owned device buffers (int32: slots [S],
        context lens [S], block tables [S, W]), which the caller refills before each graph replay.
        Every launch shape must depend only on S and max_context, never on the buffers' contents."""
        raise NotImplementedError(f"{type(self).__name__} cannot be captured in CUDA graphs")

    @abstractmethod
    def build_metadata(self, layout: BatchLayout, slot_mapping: np.ndarray, staging: StagingRing) -> Any:
        """Everything the layers need, on the staging ring's device; called once per forward."""

    @abstractmethod
    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                k_cache: torch.Tensor, v_cache: torch.Tensor, metadata: Any, scale: float) -> torch.Tensor:
        """q: [T, Hq, D]; k, v: [T, Hkv, D]; caches: [num_blocks, block_size, Hkv, D]. Returns [T, Hq, D]."""
