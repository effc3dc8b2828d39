"""The worker's persistent batch: what a step's inputs are made of, kept between steps in arrays indexed by
each request's slot (its row of ModelRunner.last_tokens), updated in place from the plan's changes.

    slot:             0      1      2     ...
    block_table:   [b b b][b b .][b . .]          [slots, columns] int32: a request's blocks, appended
    num_blocks:       3      2      1             as plans hand them out (stale columns are never read)
    sampling rows:  temperature, top-p, top-k, min-p, seed, greedy, special    (sampler.SamplingRows)

A step then costs a few numpy operations over the plan's columns (slots, starts, token counts: StepPlan is
columnar) instead of per-request Python: a decode step of 256 requests builds its positions, slot mapping,
block-table rows and device-gathered input ids without a loop over them. Only entries that carry new blocks,
prompt tokens the host holds, or prompt-logprob rows are visited one by one.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass

import numpy as np

from common.pipeline import PIPELINE_DEPTH
from gpu_worker.attention.base import BatchLayout


@dataclass(slots=True)
class StepInputs:
    """One step's inputs, the plan's entries (chunks) in the attention layout's order (multi-token ones first)."""

    rids: list[int]  # each chunk's request: the plan's own list where its order was kept (every decode step)
    starts: np.ndarray  # [S] int64, each chunk's first position
    slots: np.ndarray  # [S] int64, each chunk's request's slot
    layout: BatchLayout
    positions: np.ndarray  # [T] int64
    slot_mapping: np.ndarray  # [T] int64: KV-store slot of each computed token
    input_ids: np.ndarray  # [T] int64; 0 where the token is only on the device
    pending_rows: np.ndarray  # [P] token rows whose id is the last token sampled for...
    pending_slots: np.ndarray  # [P] ...this slot, gathered on the device
    sampling_rows: np.ndarray  # [R] chunks that sample, in layout order
    logit_rows: np.ndarray  # [R] their last token's row (the logits they sample from)


class PersistentBatch:
    def __init__(self, num_slots: int, max_blocks_per_request: int, block_size: int):
        self.block_size = block_size
        # A power of two of columns: a step's table is a prefix of them, of power-of-two width.
        columns = 1 << max(0, max_blocks_per_request - 1).bit_length()
        self.block_table = np.zeros((num_slots, columns), dtype=np.int32)
        self.num_blocks = np.zeros(num_slots, dtype=np.int64)

    def reset(self, slot: int) -> None:
        """The slot starts a new request with no blocks."""
        self.num_blocks[slot] = 0

    def append_blocks(self, slot: int, block_ids: list[int]) -> None:
        start = int(self.num_blocks[slot])
        end = start + len(block_ids)
        if end > self.block_table.shape[1]:
            raise ValueError(f"slot {slot}: {end} blocks exceed the {self.block_table.shape[1]} a request may hold")
        self.block_table[slot, start:end] = block_ids
        self.num_blocks[slot] = end

    def blocks_of(self, slot: int) -> list[int]:
        return self.block_table[slot, : self.num_blocks[slot]].tolist()

    def prepare(
        self,
        rids: list[int],
        starts: np.ndarray,
        query_lens: np.ndarray,
        samples: np.ndarray,
        slots: np.ndarray,
        num_known: np.ndarray,
        known_tokens: list[list[int]],
    ) -> StepInputs:
        """Inputs of a forward over a plan's chunks: chunk i computes query_lens[i] tokens of request rids[i]
        from position starts[i] and samples when samples[i]; slots[i], num_known[i]: its request's slot and how
        many of its tokens the host holds; known_tokens[i]: those tokens (read only where the chunk computes a
        token the host holds: a prompt chunk, a recomputation, a decode whose last token was read back).

        A computed position the host does not hold is the one token sampled by a step still in flight: its
        input is gathered from the device's last-token slots (pending_rows, pending_slots)."""
        multi = query_lens > 1
        num_prefill = int(multi.sum())
        if num_prefill and not multi[:num_prefill].all():
            # Multi-token chunks first, single-token ones last (the attention backends' layout), stable.
            order = np.argsort(~multi, kind="stable")
            # Python ints to index the lists: iterating the array itself made a numpy scalar per entry (~60 µs
            # for each of the two lists of a 444-entry mixed step, this CPU).
            take = operator.itemgetter(*order.tolist())  # (at least two entries: a prefill behind a decode)
            rids, known_tokens = list(take(rids)), list(take(known_tokens))
            slots, num_known, starts, query_lens = slots[order], num_known[order], starts[order], query_lens[order]
            samples = samples[order]
        ends = starts + query_lens
        # An input the host does not hold was sampled by a step still in flight, so it can only be a one-token
        # chunk's (a decode's) and at most PIPELINE_DEPTH - 1 steps ahead of the host; a longer chunk's
        # inputs are all held but for its last one at most (the step before finishes a prompt).
        ahead = ends - num_known
        too_far = (ahead > PIPELINE_DEPTH - 1) | ((query_lens > 1) & (ahead > 1))
        if too_far.any():
            i = int(np.argmax(too_far))
            raise ValueError(
                f"request {rids[i]}: position {ends[i] - 1} is ahead of the host's {num_known[i]} tokens "
                f"by more than the {PIPELINE_DEPTH} steps in flight allow"
            )
        bs = self.block_size
        num_tokens = int(query_lens.sum())
        last_rows = np.cumsum(query_lens) - 1
        if num_tokens == len(rids):  # one token each (a decode step): no expansion
            positions, token_slots = starts, slots
        else:
            first_rows = last_rows + 1 - query_lens
            positions = np.arange(num_tokens, dtype=np.int64) + np.repeat(starts - first_rows, query_lens)
            token_slots = np.repeat(slots, query_lens)
        slot_mapping = self.block_table[token_slots, positions // bs].astype(np.int64) * bs + positions % bs
        used = -(-ends // bs)
        width = 1 << (int(used.max()) - 1).bit_length()
        layout = BatchLayout(query_lens, ends, self.block_table[slots, :width], num_prefill)

        input_ids = np.zeros(num_tokens, dtype=np.int64)
        held = np.flatnonzero(starts < num_known)  # chunks computing tokens the host holds
        if len(held):
            # A decode whose input is the last token the host read back (the worker finished the step before
            # this plan came): a whole batch of them in one pass, not one slice each.
            last = (query_lens[held] == 1) & (ends[held] == num_known[held])
            decodes = held[last].tolist()
            if decodes:
                input_ids[last_rows[decodes]] = [known_tokens[i][-1] for i in decodes]
            for i in held[~last].tolist():
                start, end = int(starts[i]), min(int(ends[i]), int(num_known[i]))
                row = int(last_rows[i]) + 1 - int(query_lens[i])
                input_ids[row : row + end - start] = known_tokens[i][start:end]
        pending = ends > num_known
        sampling_rows = np.flatnonzero(samples)
        return StepInputs(
            rids,
            starts,
            slots,
            layout,
            positions,
            slot_mapping,
            input_ids,
            last_rows[pending],
            slots[pending],
            sampling_rows,
            last_rows[sampling_rows],
        )


def eager_bucket(num: int) -> int:
    """The size an eager forward's token count (or its logit rows) is padded up to on CUDA: a power of two up
    to 64, then a multiple of 64. cuBLAS chooses a matmul's kernel per shape, at ~150 µs of host time for a
    shape it has not seen (measured on an H100, per linear layer, ~50 of them per forward): a step whose
    shape is one seen before skips that. A padding token costs little; 64 is under 2 % of a full step."""
    if num <= 64:
        return 1 << max(0, num - 1).bit_length()
    return -(-num // 64) * 64


def pad_batch(
    input_ids: np.ndarray,
    positions: np.ndarray,
    slot_mapping: np.ndarray,
    layout: BatchLayout,
    num_tokens: int,
    scratch_block: int,
    block_size: int,
) -> tuple[np.ndarray, np.ndarray, np.ndarray, BatchLayout]:
    """The batch grown to num_tokens by one-token sequences after the real ones (so still in the layout's
    order): token 0 at position 0, attending to itself alone in a scratch block no request owns. Their
    outputs are never read."""
    pad = num_tokens - len(input_ids)
    if pad <= 0:
        return input_ids, positions, slot_mapping, layout
    ones = np.ones(pad, dtype=np.int64)
    table = np.zeros((pad, layout.block_table.shape[1]), dtype=np.int32)
    table[:, 0] = scratch_block
    padded = BatchLayout(
        np.concatenate([layout.query_lens, ones]),
        np.concatenate([layout.context_lens, ones]),
        np.concatenate([layout.block_table, table]),
        layout.num_prefill_seqs,
    )
    return (
        np.concatenate([input_ids, np.zeros(pad, dtype=np.int64)]),
        np.concatenate([positions, np.zeros(pad, dtype=np.int64)]),
        np.concatenate([slot_mapping, np.full(pad, scratch_block * block_size, dtype=np.int64)]),
        padded,
    )
