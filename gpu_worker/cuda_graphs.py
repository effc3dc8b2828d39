"""Decode steps replayed from CUDA graphs: one graph per batch-size bucket, captured at start-up.

Inputs that only the device knows (tokens sampled by the previous step, not yet read back) are copied
into the input-id buffer on the device, after the host copy and before the replay.

A decode step of a small model is mostly kernel-launch overhead (a dozen launches per layer, each a few
microseconds of Python and driver time). Captured once, a step is one replay. Everything a step changes
lives in static device buffers, refilled by a single host-to-device copy before each replay:

    host (pinned, a ring) ─ one copy ─▶ | input ids | positions | slots | context lens | block tables [B, W] |
                                 views of one int32 device buffer, read by the captured kernels

Batches are padded up to the next bucket; padding rows read and write a scratch KV block that no
request owns, and their logits are ignored. Logits are computed inside the graph; sampling runs outside
(its parameters vary per request).
"""

from __future__ import annotations

import numpy as np
import torch

from common.pipeline import host_ring_size
from gpu_worker.attention.base import AttentionBackend, BatchLayout
from gpu_worker.kv_cache import PagedKVCache
from gpu_worker.models.forward_context import ForwardContext


def batch_buckets(max_batch: int) -> list[int]:
    """1, 2, 4, 8, then every multiple of 16, up to and including max_batch."""
    sizes = [b for b in (1, 2, 4, 8) if b < max_batch] + list(range(16, max_batch, 16))
    return sorted(set(sizes + [max_batch]))


class DecodeGraphs:
    def __init__(
        self,
        model: torch.nn.Module,
        attention: AttentionBackend,
        kv_cache: PagedKVCache,
        max_batch: int,
        max_model_len: int,
        scratch_block: int,
    ):
        self.model = model
        self.device = kv_cache.data.device
        self.block_size = kv_cache.block_size
        self.buckets = batch_buckets(max_batch)
        self.max_batch = max_batch
        self.width = -(-max_model_len // self.block_size)
        self.scratch_slot = scratch_block * self.block_size
        self.scratch_block = scratch_block
        b, w = max_batch, self.width
        # Field offsets in the flat int32 buffer.
        self._sizes = [b, b, b, b, b * w]
        # Host side: a ring, so that a buffer whose copy is still queued is never rewritten (host_copy.py).
        self._hosts = [torch.zeros(sum(self._sizes), dtype=torch.int32).pin_memory() for _ in range(host_ring_size())]
        # Each host buffer's fields as numpy views, made once: a step writes into them directly.
        self._host_fields = [np.split(h.numpy(), np.cumsum(self._sizes)[:-1]) for h in self._hosts]
        self._turn = 0
        self._device = torch.zeros_like(self._hosts[0], device=self.device)
        views, offset = [], 0
        for size in self._sizes:
            views.append(self._device[offset : offset + size])
            offset += size
        self.input_ids, self.positions, self.slots, self.context_lens, tables = views
        self.block_tables = tables.view(b, w)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.logits: dict[int, torch.Tensor] = {}
        self._capture(attention, kv_cache, max_model_len)

    def _capture(self, attention: AttentionBackend, kv_cache: PagedKVCache, max_model_len: int) -> None:
        pool = torch.cuda.graph_pool_handle()
        self._fill_padding(self._hosts[0], 0, self.max_batch)
        self._device.copy_(self._hosts[0])
        for bucket in reversed(self.buckets):  # largest first: smaller graphs reuse its memory
            metadata = attention.static_decode_metadata(
                self.slots[:bucket], self.context_lens[:bucket], self.block_tables[:bucket], max_model_len
            )
            ctx = ForwardContext(attention, metadata, kv_cache)
            ids, pos = self.input_ids[:bucket], self.positions[:bucket]
            with torch.inference_mode():
                stream = torch.cuda.Stream(self.device)
                stream.wait_stream(torch.cuda.current_stream(self.device))
                with torch.cuda.stream(stream):  # first run outside capture: compiles and autotunes
                    self.model.compute_logits(self.model(ids, pos, ctx))
                torch.cuda.current_stream(self.device).wait_stream(stream)
                graph = torch.cuda.CUDAGraph()
                # thread_local: a CUDA call on another thread (NCCL's watchdog polling its events, with tensor
                # parallelism; the control thread) must not invalidate this thread's capture.
                with torch.cuda.graph(graph, pool=pool, capture_error_mode="thread_local"):
                    self.logits[bucket] = self.model.compute_logits(self.model(ids, pos, ctx))
            self.graphs[bucket] = graph
        torch.cuda.synchronize(self.device)

    def bucket_for(self, num_seqs: int) -> int | None:
        for bucket in self.buckets:
            if bucket >= num_seqs:
                return bucket
        return None

    def run(
        self,
        input_ids: np.ndarray,
        positions: np.ndarray,
        slots: np.ndarray,
        layout: BatchLayout,
        device_inputs: tuple[torch.Tensor, torch.Tensor] | None,
    ) -> torch.Tensor:
        """Replay the decode graph for these sequences (one token each); returns their logits [n, V].
        device_inputs: (rows, token ids) already on the device, overriding those rows of input_ids."""
        n = len(input_ids)
        bucket = self.bucket_for(n)
        b, w = self.max_batch, self.width
        self._turn += 1
        turn = self._turn % len(self._hosts)
        host_buffer = self._hosts[turn]
        ids_h, pos_h, slots_h, ctx_h, tables_h = self._host_fields[turn]
        ids_h[:n] = input_ids
        pos_h[:n] = positions
        slots_h[:n] = slots
        ctx_h[:n] = layout.context_lens
        # Columns past the layout's width keep older entries: never read, as no context reaches them.
        width = min(w, layout.block_table.shape[1])
        tables_h.reshape(b, w)[:n, :width] = layout.block_table[:, :width]
        if bucket > n:
            self._fill_padding(host_buffer, n, bucket)
        self._device.copy_(host_buffer, non_blocking=True)
        if device_inputs is not None:
            rows, tokens = device_inputs
            self.input_ids.index_copy_(0, rows, tokens.to(torch.int32))
        self.graphs[bucket].replay()
        return self.logits[bucket][:n]

    def _fill_padding(self, host_buffer: torch.Tensor, first: int, last: int) -> None:
        """Rows [first, last) become harmless: token 0 at position 0, in the scratch block."""
        ids_h, pos_h, slots_h, ctx_h, tables_h = np.split(host_buffer.numpy(), np.cumsum(self._sizes)[:-1])
        ids_h[first:last] = 0
        pos_h[first:last] = 0
        slots_h[first:last] = self.scratch_slot
        ctx_h[first:last] = 1
        tables_h.reshape(self.max_batch, self.width)[first:last, 0] = self.scratch_block
