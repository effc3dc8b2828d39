"""Steps that compute prompt tokens (alone or beside decodes), replayed from CUDA graphs: one graph per
token-count bucket, captured at start-up.

An eager step launches every kernel from Python, about a thousand for a 30-layer model: ~10 ms of host time
whatever the step's size (docs/notes/benchmark-history.md), so a 512-token chunk beside 64 decodes cost as much
as several decode steps. Captured, such a step is one replay. What makes it capturable is that every launch is
sized for the most its bucket can hold, and the step's real extent is read on the device
(attention/triton_backend.py):

    | input ids [T] | gather slots [T] | positions [T] | slots [T] | logit rows [S] | context lens [S] |
    | query starts [S + 1] | prefill tiles [2, tiles] | decode span [4] | decode slices | block tables [S, W] |
                                                                          one copy (graph_capture.py)

T: the bucket's token count; S: the most sequences a step holds. A step of t tokens fills rows [0, t); rows
[t, T) are padding tokens in no sequence: their K/V land in a scratch block no request owns, their attention
outputs are zeros, and no logits are made from them. Padding prefill tiles and decode slices have sequence -1,
and prefill merge rows past the prefill tokens return at once.

The graph ends by gathering the sampling rows' hidden states (one per sequence at most) into one buffer that
every bucket shares; the logits are made from it outside the graph, for the rows that sample only, so no
bucket holds a [S, vocab] output of its own.
"""

from __future__ import annotations

import numpy as np
import torch

from gpu_worker.attention.base import AttentionBackend, BatchLayout, StaticAttentionBuffers
from gpu_worker.attention.triton_backend import prefill_tiles
from gpu_worker.attention.triton_kernels import PREFILL_BLOCK_M
from gpu_worker.graph_capture import (
    GraphInputs,
    capture_buckets,
    smallest_bucket,
    with_device_inputs,
    write_decode_slices,
    write_gather_slots,
)
from gpu_worker.input_batch import StepInputs, eager_bucket
from gpu_worker.kv_cache import PagedKVCache
from gpu_worker.models.forward_context import ForwardContext

SMALLEST_BUCKET = 16
FINE_FROM = 256  # token counts below this double from bucket to bucket; from it on, four buckets per doubling


def token_buckets(max_tokens: int) -> list[int]:
    """16, 32, ... 256, then four per doubling (320, 384, 448, 512, 640, ...), up to and including max_tokens:
    a step pads at most a quarter of its tokens from 256 tokens on."""
    sizes, size = [], SMALLEST_BUCKET
    while size < max_tokens:
        sizes.append(size)
        size = size * 2 if size < FINE_FROM else size + (1 << (size.bit_length() - 1)) // 4
    return sizes + [max_tokens]


def tiles_bound(num_tokens: int, max_seqs: int) -> int:
    """The most prefill tiles a step of num_tokens tokens can have: a tile per PREFILL_BLOCK_M of its prompt
    tokens, plus one per multi-token sequence (of at least two tokens each) for the last, partial tile."""
    return -(-num_tokens // PREFILL_BLOCK_M) + min(num_tokens // 2, max_seqs)


class MixedStepLayout:
    """The static inputs' layout for steps of up to max_tokens tokens and max_seqs sequences: how a step fills
    them (host side, numpy) and what a bucket's graph reads of them (device side). No CUDA here: tests run it
    with the Triton interpreter."""

    def __init__(
        self, max_tokens: int, max_seqs: int, table_width: int, scratch_slot: int, attention: AttentionBackend
    ):
        """attention: plans the decodes' context slices (decode_slices) and says how many a launch covers."""
        self.buckets = token_buckets(max_tokens)
        self.max_seqs = max_seqs
        self.table_width = table_width
        self.scratch_slot = scratch_slot
        self.attention = attention
        t, s = max_tokens, max_seqs
        self.shapes: dict[str, tuple[int, ...]] = {
            "input_ids": (t,),
            "gather_slots": (t,),
            "positions": (t,),
            "slots": (t,),
            "logit_rows": (s,),
            "context_lens": (s,),
            "query_starts": (s + 1,),
            "tiles": (2, tiles_bound(t, s)),
            "decode_span": (4,),
            "slice_seqs": (attention.decode_slice_capacity(s),),
            "slice_starts": (s + 1,),
            "block_tables": (s, table_width),
        }

    def bucket_for(self, num_tokens: int, num_seqs: int) -> int | None:
        return None if num_seqs > self.max_seqs else smallest_bucket(self.buckets, num_tokens)

    def attention_buffers(self, fields: dict[str, torch.Tensor], bucket: int) -> StaticAttentionBuffers:
        """What the attention of `bucket`'s graph reads, as views of the device fields."""
        seqs = min(bucket, self.max_seqs)
        return StaticAttentionBuffers(
            slot_mapping=fields["slots"][:bucket],
            context_lens=fields["context_lens"][:seqs],
            query_starts=fields["query_starts"],
            prefill_tiles=fields["tiles"][:, : tiles_bound(bucket, self.max_seqs)],
            decode_span=fields["decode_span"],
            decode_slice_seqs=fields["slice_seqs"][: self.slice_capacity(bucket)],
            decode_slice_starts=fields["slice_starts"][: seqs + 1],
            block_tables=fields["block_tables"][:seqs],
            decode_programs=seqs,
            padding_outside_sequences=True,
            decode_only=False,
        )

    def slice_capacity(self, bucket: int) -> int:
        """The decode slices `bucket`'s graph launches for."""
        return self.attention.decode_slice_capacity(min(bucket, self.max_seqs))

    def fill(
        self,
        host: dict[str, np.ndarray],
        input_ids: np.ndarray,
        positions: np.ndarray,
        slot_mapping: np.ndarray,
        layout: BatchLayout,
        logit_rows: np.ndarray,
        pending_rows: np.ndarray,
        pending_slots: np.ndarray,
    ) -> int:
        """Write a step into the host fields (which may hold a larger step's values); returns its bucket.
        pending_rows take the last token sampled in pending_slots (on the device) instead of input_ids'."""
        t, num_seqs = len(input_ids), len(layout.query_lens)
        bucket = self.bucket_for(t, num_seqs)
        if bucket is None:
            raise ValueError(f"a step of {t} tokens and {num_seqs} sequences has no graph")
        num_pre = layout.num_prefill_seqs
        host["input_ids"][:t] = input_ids
        write_gather_slots(host["gather_slots"], t, pending_rows, pending_slots)
        host["positions"][:t] = positions
        host["slots"][:t] = slot_mapping
        host["logit_rows"][: len(logit_rows)] = logit_rows
        host["context_lens"][:num_seqs] = layout.context_lens
        starts = host["query_starts"]
        starts[0] = 0
        starts[1 : num_pre + 1] = layout.query_lens[:num_pre].cumsum()
        tiles = prefill_tiles(layout.query_lens[:num_pre].astype(np.int32))
        host["tiles"][:, : tiles.shape[1]] = tiles
        host["decode_span"][:3] = (num_pre, starts[num_pre], num_seqs - num_pre)
        capacity = self.slice_capacity(bucket)
        write_decode_slices(host, self.attention.decode_slices(layout.context_lens[num_pre:], capacity), capacity)
        # Columns past the layout's width keep older entries: never read, as no context reaches them.
        width = min(self.table_width, layout.block_table.shape[1])
        host["block_tables"][:num_seqs, :width] = layout.block_table[:, :width]
        self.fill_padding(host, bucket, t, len(logit_rows), tiles.shape[1])
        return bucket

    def fill_step(self, host: dict[str, np.ndarray], inputs: StepInputs) -> int:
        """fill with a step's inputs (input_batch.py); returns its bucket."""
        return self.fill(
            host,
            inputs.input_ids,
            inputs.positions,
            inputs.slot_mapping,
            inputs.layout,
            inputs.logit_rows,
            inputs.pending_rows,
            inputs.pending_slots,
        )

    def fill_padding(
        self, host: dict[str, np.ndarray], bucket: int, first_token: int = 0, first_row: int = 0, first_tile: int = 0
    ) -> None:
        """Tokens [first_token, bucket) become padding (token 0 at position 0, writing the scratch slot), the
        logit rows from first_row on read row 0, and the tiles from first_tile on do nothing: a bucket's graph
        reads every one of them. With the defaults, a step of padding alone."""
        host["input_ids"][first_token:bucket] = 0
        host["gather_slots"][first_token:bucket] = -1
        host["positions"][first_token:bucket] = 0
        host["slots"][first_token:bucket] = self.scratch_slot
        host["logit_rows"][first_row : min(bucket, self.max_seqs)] = 0
        host["tiles"][0, first_tile : tiles_bound(bucket, self.max_seqs)] = -1
        if first_token == 0:
            host["decode_span"][:] = 0
            host["slice_seqs"][: self.slice_capacity(bucket)] = -1
            host["slice_starts"][:] = 0


class MixedGraphs:
    def __init__(
        self,
        model: torch.nn.Module,
        attention: AttentionBackend,
        kv_cache: PagedKVCache,
        max_tokens: int,
        max_seqs: int,
        max_model_len: int,
        scratch_block: int,
        last_tokens: torch.Tensor,
        pool,
    ):
        """max_tokens: the most tokens a step computes (prompt budget plus decodes); max_seqs: the most sequences
        a step holds; last_tokens: the worker's last sampled token of each slot (read by rows whose input only
        the device knows); pool: the graph memory pool, shared with the decode graphs (they never run at once)."""
        self.model = model
        self.last_tokens = last_tokens
        self.device = kv_cache.data.device
        width = -(-max_model_len // kv_cache.block_size)
        self.step_layout = MixedStepLayout(max_tokens, max_seqs, width, scratch_block * kv_cache.block_size, attention)
        self.buckets = self.step_layout.buckets
        self.inputs = GraphInputs(self.step_layout.shapes, self.device)
        dtype = next(model.parameters()).dtype
        self.selected = torch.zeros(max_seqs, _hidden_size(model), dtype=dtype, device=self.device)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.attention_metadata: dict[int, object] = {}  # each bucket's, planned before a replay (prepare_replay)
        self._capture(attention, kv_cache, max_model_len, pool)

    def _capture(self, attention: AttentionBackend, kv_cache: PagedKVCache, max_model_len: int, pool) -> None:
        # Every bucket's first run and capture sees a step of padding alone: nothing but the scratch block changes.
        self.step_layout.fill_padding(self.inputs.fill(), self.buckets[-1])
        self.inputs.upload()
        d = self.inputs.device

        def forward_of(bucket: int):
            metadata = attention.static_metadata(self.step_layout.attention_buffers(d, bucket), max_model_len)
            self.attention_metadata[bucket] = metadata
            ctx = ForwardContext(attention, metadata, kv_cache)
            seqs = min(bucket, self.step_layout.max_seqs)
            ids, gather, pos = d["input_ids"][:bucket], d["gather_slots"][:bucket], d["positions"][:bucket]
            rows, selected = d["logit_rows"][:seqs], self.selected[:seqs]

            def forward():
                hidden = self.model(with_device_inputs(ids, gather, self.last_tokens), pos, ctx)
                return torch.index_select(hidden, 0, rows, out=selected)

            return forward

        for bucket, (graph, _) in capture_buckets(self.buckets, forward_of, pool, self.device).items():
            self.graphs[bucket] = graph

    def bucket_for(self, num_tokens: int, num_seqs: int) -> int | None:
        return self.step_layout.bucket_for(num_tokens, num_seqs)

    def run(self, inputs: StepInputs) -> torch.Tensor:
        """Replay the graph for this step (bucket_for must have found one); returns the logits [R, V] of its
        sampling rows, as the eager forward does (eager_forward.py). inputs.pending_rows take the last token
        sampled in their slot (on the device) instead of input_ids'."""
        bucket = self.step_layout.fill_step(self.inputs.fill(), inputs)
        layout = self.step_layout
        self.inputs.upload(  # the table's rows a bucket's graph may read, the columns the step's contexts reach
            table_rows=min(bucket, layout.max_seqs),
            table_columns=max(1, min(layout.table_width, inputs.layout.block_table.shape[1])),
        )
        self.step_layout.attention.prepare_replay(self.attention_metadata[bucket], inputs.layout)
        self.graphs[bucket].replay()
        r = len(inputs.logit_rows)
        if not r:
            return self.selected.new_empty(0, 0)
        # The LM head sees a row count it was warmed up with (warm_up.py): rows past r are stale, and dropped.
        seqs = min(bucket, self.step_layout.max_seqs)
        return self.model.compute_logits(self.selected[: min(eager_bucket(r), seqs)])[:r]


def _hidden_size(model: torch.nn.Module) -> int:
    """The width of the hidden states the model returns (its token embedding's)."""
    return next(m for m in model.modules() if isinstance(m, torch.nn.Embedding)).embedding_dim
