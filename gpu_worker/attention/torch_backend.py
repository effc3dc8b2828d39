"""Reference attention in plain torch: runs on CPU and CUDA, the baseline every kernel is checked against.

The model runs on the flat [T, ...] token batch; only inside attention are queries placed into a
[sequences, longest query] grid so that one scaled_dot_product_attention call covers every prefill
chunk (and one more call every decode). Keys and values are gathered from the paged store through
the block tables, so prefix-cached context and the new tokens are read the same way. A layer with logit
soft-capping (Gemma 2) runs the same steps written out (SDPA cannot cap scores), as transformers' eager
attention does. A float8 store (--kv-cache-dtype fp8) is written through kv_cache.quantize and its gathered
keys and values dequantized into q's dtype before the same calls.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch
import torch.nn.functional as F

from gpu_worker.attention.base import AttentionBackend, BatchLayout, Upload
from gpu_worker.kv_cache import FP8, dequantize, quantize


@dataclass(slots=True)
class _Group:
    """Sequences that share one SDPA call."""

    token_start: int
    token_end: int
    grid_cells: torch.Tensor | None  # [num tokens]: token -> grid cell (prefill only)
    kv_slots: torch.Tensor  # [S, max_kv]: flat KV-store slot of each context position
    mask: torch.Tensor  # [S, 1, max_q, max_kv]: True where attention is allowed (causal)
    query_pos: torch.Tensor  # [S, 1, max_q, 1]: each query's context position (grid padding rows: 0)
    max_q: int
    # Every sequence's queries start at its first position (no cached prefix, no earlier chunk): the mask is plain
    # causality over the grid (query i against keys 0..i), which SDPA applies itself as is_causal, skipping the
    # tiles above the diagonal: a 2,141-token prompt's attention took half the time (a CPU, the same bits).
    from_start: bool = False
    windowed: dict[int, torch.Tensor] = field(default_factory=dict)  # sliding window -> mask, made once a forward

    def mask_for(self, sliding_window: int | None) -> torch.Tensor:
        """The causal mask, less the keys `sliding_window` or more positions before each query."""
        if not sliding_window:
            return self.mask
        mask = self.windowed.get(sliding_window)
        if mask is None:
            key_pos = torch.arange(self.mask.shape[-1], device=self.mask.device)
            mask = self.windowed[sliding_window] = self.mask & (self.query_pos - key_pos < sliding_window)
        return mask


@dataclass(slots=True)
class TorchAttentionMetadata:
    slot_mapping: torch.Tensor  # [T]
    prefill: _Group | None
    decode: _Group | None


class TorchAttention(AttentionBackend):
    def build_metadata(self, layout: BatchLayout, slot_mapping: np.ndarray, upload: Upload) -> TorchAttentionMetadata:
        slots = upload(slot_mapping, torch.long)
        device = slots.device
        n_pre = layout.num_prefill_seqs
        n_tok_pre = sum(layout.query_lens[:n_pre])
        prefill = decode = None
        if n_pre:
            prefill = self._group(layout, 0, n_pre, 0, device)
        if n_pre < len(layout.query_lens):
            decode = self._group(layout, n_pre, len(layout.query_lens), n_tok_pre, device)
        return TorchAttentionMetadata(slots, prefill, decode)

    def _group(self, layout: BatchLayout, first: int, last: int, token_start: int, device: torch.device) -> _Group:
        q_lens = torch.tensor(layout.query_lens[first:last], dtype=torch.long)
        ctx_lens = torch.tensor(layout.context_lens[first:last], dtype=torch.long)
        num_seqs = last - first
        max_q, max_kv = int(q_lens.max()), int(ctx_lens.max())
        bs = self.block_size
        table = torch.from_numpy(layout.block_table[first:last]).long()
        pos = torch.arange(max_kv)
        kv_slots = table[:, pos // bs] * bs + pos % bs
        # Query i of a sequence sits at context position (ctx_len - q_len + i): it sees keys up to there. Grid
        # padding rows (i >= q_len) stand at position 0, so that they see key 0 in any window (softmax of
        # nothing is NaN); their outputs are dropped.
        qi = torch.arange(max_q)
        last_visible = (ctx_lens - q_lens)[:, None] + qi[None, :]  # [S, max_q]
        last_visible.masked_fill_(qi[None, :] >= q_lens[:, None], 0)
        mask = pos[None, None, :] <= last_visible[:, :, None]
        mask &= pos[None, None, :] < ctx_lens[:, None, None]
        grid_cells = None
        num_tokens = int(q_lens.sum())
        if max_q > 1:
            seq_of_token = torch.repeat_interleave(torch.arange(num_seqs), q_lens)
            starts = torch.cumsum(q_lens, 0) - q_lens
            offset_in_seq = torch.arange(num_tokens) - starts[seq_of_token]
            grid_cells = (seq_of_token * max_q + offset_in_seq).to(device)
        return _Group(
            token_start,
            token_start + num_tokens,
            grid_cells,
            kv_slots.to(device),
            mask[:, None].to(device),
            last_visible[:, None, :, None].to(device),
            max_q,
            from_start=max_q > 1 and bool(torch.equal(q_lens, ctx_lens)),
        )

    def forward(
        self,
        q,
        k,
        v,
        k_cache,
        v_cache,
        metadata: TorchAttentionMetadata,
        scale: float,
        *,
        sliding_window: int | None = None,
        softcap: float | None = None,
        kv_scales: tuple[float, float] = (1.0, 1.0),
    ):
        k_flat = k_cache.view(-1, *k_cache.shape[2:])
        v_flat = v_cache.view(-1, *v_cache.shape[2:])
        quantized = k_cache.dtype == FP8
        if quantized:  # as bytes: torch copies and gathers float8 on CUDA only
            k, v = quantize(k, kv_scales[0]).view(torch.uint8), quantize(v, kv_scales[1]).view(torch.uint8)
            k_flat, v_flat = k_flat.view(torch.uint8), v_flat.view(torch.uint8)
        k_flat.index_copy_(0, metadata.slot_mapping, k)
        v_flat.index_copy_(0, metadata.slot_mapping, v)
        out = torch.empty_like(q)
        for group in (metadata.prefill, metadata.decode):
            if group is not None:
                out[group.token_start : group.token_end] = self._attend(
                    q[group.token_start : group.token_end],
                    k_flat,
                    v_flat,
                    group,
                    scale,
                    sliding_window,
                    softcap,
                    kv_scales if quantized else None,
                )
        return out

    @staticmethod
    def _attend(
        q: torch.Tensor,
        k_flat: torch.Tensor,
        v_flat: torch.Tensor,
        group: _Group,
        scale: float,
        sliding_window: int | None,
        softcap: float | None,
        kv_scales: tuple[float, float] | None,
    ):
        """kv_scales: the store's float8 scales (K's, V's), k_flat and v_flat its bytes; None: the store is in q's
        dtype."""
        num_seqs = group.kv_slots.shape[0]
        heads, dim = q.shape[1], q.shape[2]
        if group.grid_cells is not None:
            grid = q.new_zeros(num_seqs * group.max_q, heads, dim)
            grid[group.grid_cells] = q
            qg = grid.view(num_seqs, group.max_q, heads, dim)
        else:
            qg = q.view(num_seqs, 1, heads, dim)
        keys = k_flat[group.kv_slots].transpose(1, 2)  # [S, Hkv, max_kv, D]
        values = v_flat[group.kv_slots].transpose(1, 2)
        if kv_scales is not None:
            keys = dequantize(keys.view(FP8), kv_scales[0], q.dtype)
            values = dequantize(values.view(FP8), kv_scales[1], q.dtype)
        mask = group.mask_for(sliding_window)
        gqa = keys.shape[1] != heads
        if softcap:
            out = _capped_attention(qg.transpose(1, 2), keys, values, mask, scale, softcap)
        elif group.from_start and not sliding_window:
            # A grid row's valid queries see only keys of their own sequence this way too (key j <= query i <
            # its length); padding rows see padding keys (blocks of the store: finite) and are dropped.
            out = F.scaled_dot_product_attention(
                qg.transpose(1, 2), keys, values, is_causal=True, scale=scale, enable_gqa=gqa
            )
        else:
            out = F.scaled_dot_product_attention(
                qg.transpose(1, 2), keys, values, attn_mask=mask, scale=scale, enable_gqa=gqa
            )
        out = out.transpose(1, 2)  # [S, max_q, H, D]
        if group.grid_cells is not None:
            return out.reshape(num_seqs * group.max_q, heads, dim)[group.grid_cells]
        return out.reshape(num_seqs, heads, dim)


def _capped_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float, softcap: float
) -> torch.Tensor:
    """q [S, H, M, D], k and v [S, Hkv, N, D], mask [S, 1, M, N]: softmax(cap * tanh(q k^T * scale / cap)) v,
    in transformers' eager order (softmax in float32, cast back before the product with v)."""
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    scores = torch.matmul(q, k.transpose(2, 3)) * scale
    scores = torch.tanh(scores / softcap) * softcap
    probs = torch.softmax(scores.masked_fill(~mask, float("-inf")), dim=-1, dtype=torch.float32).to(q.dtype)
    return torch.matmul(probs, v)
