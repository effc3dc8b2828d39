"""Decode steps replayed from CUDA graphs: one graph per batch-size bucket, captured at start-up.

A decode step of a small model is mostly kernel-launch overhead (a dozen launches per layer, each a few
microseconds of Python and driver time). Captured once, a step is one replay. Everything a step changes
lives in static device buffers, refilled by a single host-to-device copy before each replay
(graph_capture.py):

    | input ids | gather slots | sample slots | positions | slots | context lens | decode span |
    | decode slices | block tables [B, W] |

Inputs that only the device knows (tokens sampled by the previous step, not yet read back) are gathered
inside the graph from the worker's last-token slots: the host writes which slot each such row takes
(gather slots, -1 elsewhere) with the other fields. Every bucket writes its
logits into one buffer they share (a bucket's own output would stay allocated in the graph pool: ~1.7 GB
over 36 buckets of a 512-seat GPT-2, memory the KV store's sizing does not reserve), in the model's dtype
(model.logits_buffer): the head's product writes them there itself, and a step that samples converts them.

Batches are padded up to the next bucket; padding rows read and write a scratch KV block that no
request owns, and their logits are ignored. Logits are computed inside the graph; sampling runs outside
(its parameters vary per request), except the greedy token of each row, taken inside the graph and
written to its request's last-token slot: a step whose rows all sample greedily with nothing else to apply
(no bias, penalty, logprobs or grammar) uses those and launches nothing more; any other step samples again
outside, and its writes to the slots land after the graph's. Steps that compute a prompt replay
mixed_graphs.py's graphs.
"""

from __future__ import annotations

import numpy as np
import torch

from gpu_worker.attention.base import AttentionBackend, StaticAttentionBuffers
from gpu_worker.graph_capture import (
    GraphInputs,
    capture_buckets,
    smallest_bucket,
    with_device_inputs,
    write_decode_slices,
    write_gather_slots,
)
from gpu_worker.input_batch import StepInputs
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
        last_tokens: torch.Tensor,
        pool,
    ):
        """last_tokens: the worker's last sampled token of each slot (read by rows whose input only the device
        knows, written with each row's greedy token), with one more entry at the end, a sink for rows that sample
        nothing; pool: the graph memory pool, shared with the worker's other graphs (they never run at once)."""
        self.model = model
        self.last_tokens = last_tokens
        self.sink_slot = len(last_tokens) - 1
        self.device = kv_cache.data.device
        self.block_size = kv_cache.block_size
        self.buckets = batch_buckets(max_batch)
        self.max_batch = max_batch
        self.width = -(-max_model_len // self.block_size)
        self.scratch_slot = scratch_block * self.block_size
        self.scratch_block = scratch_block
        self.attention = attention
        b = max_batch
        self.inputs = GraphInputs(
            {
                "input_ids": (b,),
                "gather_slots": (b,),
                "sample_slots": (b,),
                "positions": (b,),
                "slots": (b,),
                "context_lens": (b,),
                "decode_span": (4,),
                "slice_seqs": (attention.decode_slice_capacity(b),),
                "slice_starts": (b + 1,),
                "block_tables": (b, self.width),
            },
            self.device,
        )
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.logits: dict[int, torch.Tensor] = {}  # each bucket's rows of the shared buffer
        self.greedy: dict[int, torch.Tensor] = {}  # each bucket's greedy tokens
        self.attention_metadata: dict[int, object] = {}  # each bucket's, planned before a replay (prepare_replay)
        self._logits = model.logits_buffer(max_batch)
        self._capture(attention, kv_cache, max_model_len, pool)

    def _capture(self, attention: AttentionBackend, kv_cache: PagedKVCache, max_model_len: int, pool) -> None:
        d = self.inputs.device
        no_prefill = torch.zeros(2, 0, dtype=torch.int32, device=self.device)  # no tile, no query start read

        def forward_of(bucket: int):
            # A step of padding rows alone, as many as the bucket has: its first run and capture read no row past it.
            host = self.inputs.fill()
            self._fill_padding(host, 0, bucket)
            host["decode_span"][:3] = (0, 0, bucket)
            self._fill_slices(host, bucket)
            self.inputs.upload()
            buffers = StaticAttentionBuffers(
                slot_mapping=d["slots"][:bucket],
                context_lens=d["context_lens"][:bucket],
                query_starts=no_prefill[0],
                prefill_tiles=no_prefill,
                decode_span=d["decode_span"],
                decode_slice_seqs=d["slice_seqs"][: attention.decode_slice_capacity(bucket)],
                decode_slice_starts=d["slice_starts"][: bucket + 1],
                block_tables=d["block_tables"][:bucket],
                decode_programs=bucket,
                padding_outside_sequences=False,
                decode_only=True,
            )
            metadata = self.attention_metadata[bucket] = attention.static_metadata(buffers, max_model_len)
            ctx = ForwardContext(attention, metadata, kv_cache)
            ids, gather, pos = d["input_ids"][:bucket], d["gather_slots"][:bucket], d["positions"][:bucket]
            sample_slots, out = d["sample_slots"][:bucket], self._logits[:bucket]

            def forward():
                hidden = self.model(with_device_inputs(ids, gather, self.last_tokens), pos, ctx)
                logits = self.model.compute_logits(hidden, out)
                greedy = logits.argmax(dim=-1)
                self.last_tokens.index_copy_(0, sample_slots.long(), greedy)
                return logits, greedy

            return forward

        for bucket, (graph, (logits, greedy)) in capture_buckets(self.buckets, forward_of, pool, self.device).items():
            self.graphs[bucket], self.logits[bucket], self.greedy[bucket] = graph, logits, greedy

    def bucket_for(self, num_seqs: int) -> int | None:
        return smallest_bucket(self.buckets, num_seqs)

    def run(self, inputs: StepInputs) -> tuple[torch.Tensor, torch.Tensor]:
        """Replay the decode graph for a decode-only step's sequences (one token each); returns their logits
        [n, V] and greedy tokens [n], already written to the last-token slots of the rows that sample.
        inputs.pending_rows take the last token sampled in their slot (on the device) instead of input_ids'."""
        input_ids, layout, request_slots, sampling_rows = (
            inputs.input_ids,
            inputs.layout,
            inputs.slots,
            inputs.sampling_rows,
        )
        n = len(input_ids)
        bucket = self.bucket_for(n)
        host = self.inputs.fill()
        host["input_ids"][:n] = input_ids
        write_gather_slots(host["gather_slots"], n, inputs.pending_rows, inputs.pending_slots)
        sample_slots = host["sample_slots"]
        if len(sampling_rows) == n:
            sample_slots[:n] = request_slots
        else:
            sample_slots[:n] = self.sink_slot
            sample_slots[sampling_rows] = request_slots[sampling_rows]
        host["positions"][:n] = inputs.positions
        host["slots"][:n] = inputs.slot_mapping
        host["context_lens"][:n] = layout.context_lens
        host["decode_span"][2] = bucket  # the padding rows are sequences too, in the scratch block
        # Columns past the layout's width keep older entries: never read, as no context reaches them.
        width = min(self.width, layout.block_table.shape[1])
        host["block_tables"][:n, :width] = layout.block_table[:, :width]
        if bucket > n:
            self._fill_padding(host, n, bucket)
        self._fill_slices(host, bucket)
        self.inputs.upload(table_rows=bucket, table_columns=max(width, 1))  # padding rows read column 0
        self.attention.prepare_replay(self.attention_metadata[bucket], layout)
        self.graphs[bucket].replay()
        return self.logits[bucket][:n], self.greedy[bucket][:n]

    def _fill_slices(self, host: dict[str, np.ndarray], bucket: int) -> None:
        """The decode slices of the bucket's rows (padding rows too: one slice of one token each)."""
        capacity = self.attention.decode_slice_capacity(bucket)
        write_decode_slices(host, self.attention.decode_slices(host["context_lens"][:bucket], capacity), capacity)

    def _fill_padding(self, host: dict[str, np.ndarray], first: int, last: int) -> None:
        """Rows [first, last) become harmless: token 0 at position 0, in the scratch block."""
        host["input_ids"][first:last] = 0
        host["gather_slots"][first:last] = -1
        host["sample_slots"][first:last] = self.sink_slot
        host["positions"][first:last] = 0
        host["slots"][first:last] = self.scratch_slot
        host["context_lens"][first:last] = 1
        host["block_tables"][first:last, 0] = self.scratch_block
