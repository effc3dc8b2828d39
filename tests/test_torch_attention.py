"""The reference attention (plain torch, the CPU's): prompts computed from their first token, alone or beside a
cached prefix and a decode, attend exactly as causal attention per sequence does."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from gpu_worker.attention import BatchLayout, TorchAttention

BLOCK_SIZE = 4
HEADS, KV_HEADS, DIM = 6, 2, 8
SCALE = 0.3


def causal_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, first_position: int) -> torch.Tensor:
    """q [n, H, D] at positions first_position.., k and v [ctx, Hkv, D] from position 0, in float64."""
    group = HEADS // KV_HEADS
    k, v = k.double().repeat_interleave(group, 1), v.double().repeat_interleave(group, 1)
    scores = torch.einsum("qhd,khd->hqk", q.double(), k) * SCALE
    positions = first_position + torch.arange(q.shape[0])
    scores = scores.masked_fill(torch.arange(k.shape[0])[None, :] > positions[:, None], float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)


@pytest.mark.parametrize(
    ("query_lens", "context_lens"),
    [
        ([13], [13]),  # one prompt from its first token
        ([5, 17, 9], [5, 17, 9]),  # prompts of different lengths in one padded grid
        ([6, 11, 1], [6, 15, 21]),  # a prompt from its start beside a later chunk and a decode
    ],
)
def test_prompts_attend_causally_within_their_own_sequence(query_lens, context_lens):
    gen = torch.Generator().manual_seed(3)
    tables, next_block = [], 0
    for n in context_lens:
        blocks = -(-n // BLOCK_SIZE)
        tables.append(list(range(next_block, next_block + blocks)))
        next_block += blocks
    layout = BatchLayout.build(query_lens, context_lens, tables, BLOCK_SIZE)
    shape = (next_block, BLOCK_SIZE, KV_HEADS, DIM)
    k_cache, v_cache = torch.zeros(shape), torch.zeros(shape)
    # The context before this forward (a cached prefix, an earlier chunk) already in the store.
    keys = [torch.randn(n, KV_HEADS, DIM, generator=gen) for n in context_lens]
    values = [torch.randn(n, KV_HEADS, DIM, generator=gen) for n in context_lens]
    positions = np.concatenate([np.arange(c - q, c) for q, c in zip(query_lens, context_lens)])
    slots = layout.slot_mapping(positions, BLOCK_SIZE)
    for table, n, k, v in zip(tables, context_lens, keys, values):
        flat = torch.tensor([table[p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE for p in range(n)])
        k_cache.view(-1, KV_HEADS, DIM)[flat], v_cache.view(-1, KV_HEADS, DIM)[flat] = k, v
    q = torch.randn(sum(query_lens), HEADS, DIM, generator=gen)
    new_k = torch.cat([k[c - n :] for k, n, c in zip(keys, query_lens, context_lens)])
    new_v = torch.cat([v[c - n :] for v, n, c in zip(values, query_lens, context_lens)])

    backend = TorchAttention(BLOCK_SIZE)
    metadata = backend.build_metadata(layout, slots, lambda array, dtype: torch.as_tensor(array).to(dtype))
    out = backend.forward(q, new_k, new_v, k_cache, v_cache, metadata, SCALE)

    start = 0
    for n, c, k, v in zip(query_lens, context_lens, keys, values):
        expected = causal_reference(q[start : start + n], k, v, c - n)
        torch.testing.assert_close(out[start : start + n].double(), expected, rtol=0, atol=1e-5)
        start += n
