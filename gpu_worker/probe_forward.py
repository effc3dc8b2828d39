"""One forward outside any step, before the worker serves: for what it leaves behind (the peak memory that sizes
the KV store, kv_sizing.py; the K and V it writes, which calibrate an fp8 store's scales, kv_scales.py)."""

from __future__ import annotations

import torch

from gpu_worker.attention import AttentionBackend, BatchLayout
from gpu_worker.host_copy import StagingRing
from gpu_worker.kv_cache import PagedKVCache
from gpu_worker.models.forward_context import ForwardContext


def probe_forward(
    model: torch.nn.Module, attention: AttentionBackend, cache: PagedKVCache, ids: torch.Tensor
) -> torch.Tensor:
    """`ids` [T] (on the model's device) as one prompt at positions 0.., its K/V in blocks 0.. of `cache` (which
    must hold T tokens). Returns the hidden states [T, hidden]."""
    tokens = len(ids)
    blocks = -(-tokens // cache.block_size)
    layout = BatchLayout.build([tokens], [tokens], [list(range(blocks))], cache.block_size)
    slots = torch.arange(tokens)
    staging = StagingRing(ids.device, 64 * tokens + 2**16, depth=1)
    staging.next_step()
    ctx = ForwardContext(attention, attention.build_metadata(layout, slots.numpy(), staging.upload), cache)
    return model(ids, slots.to(ids.device), ctx)
