"""The worker's persistent batch: what a step's inputs are made of, kept between steps in arrays indexed by
each request's slot (its row of ModelRunner.last_tokens), updated in place from the plan's changes.

    slot:             0      1      2     ...
    block_table:   [b b b][b b .][b . .]          [slots, columns] int32: a request's blocks, appended
    num_blocks:       3      2      1             as plans hand them out (stale columns are never read)
    num_held:        40     17     12             tokens the host holds of the request (finished steps')...
    last_held:       t40    t17    t12            ...and the last of them
    sampling rows:  temperature, top-p, top-k, min-p, seed, greedy, special    (sampler.SamplingRows)

A step then costs a few numpy operations over the plan's columns (slots, starts, token counts: StepPlan is
columnar) instead of per-request Python: a decode step of 256 requests builds its positions, slot mapping,
block-table rows and device-gathered input ids without a loop over them. Only entries that carry new blocks,
prompt tokens the host holds, or prompt-logprob rows are visited one by one. Over arrays this small a numpy call
costs about a microsecond whatever it does, so the count of calls is the cost: the host's token counts are
gathered per slot, not counted from the mirrors' lists, and array methods stand in for numpy's module-level
wrappers (a Python frame each).
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TypeVar

import numpy as np

from common.pipeline import PIPELINE_DEPTH
from gpu_worker.attention.base import BatchLayout

T = TypeVar("T")


@dataclass(slots=True)
class StepInputs:
    """One step's inputs, the plan's entries (chunks) in the attention layout's order (multi-token ones first)."""

    rids: list[int]  # each chunk's request: the plan's own list where its order was kept (every decode step)
    order: np.ndarray | None  # [S] each chunk's index in the plan; None where the plan's order was kept
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
        # The tokens the host holds of each slot's request: how many, and the last (a decode's input once the
        # step that sampled it is finished). Kept here, not counted from the mirrors' lists, so that a step reads
        # them with one gather. occupant: bumped when the slot changes hands, so that a step finishing after
        # that records nothing for the slot's new request.
        self.num_held = np.zeros(num_slots, dtype=np.int64)
        self.last_held = np.zeros(num_slots, dtype=np.int64)
        self.occupant = np.zeros(num_slots, dtype=np.int64)

    def reset(self, slot: int, token_ids: list[int]) -> None:
        """The slot starts a new request, holding token_ids (at least one) and no blocks."""
        self.num_blocks[slot] = 0
        self.num_held[slot] = len(token_ids)
        self.last_held[slot] = token_ids[-1]
        self.occupant[slot] += 1

    def record_samples(self, slots: np.ndarray, occupants: np.ndarray, tokens: np.ndarray) -> None:
        """A finished step's tokens, sampled for these slots' requests, reached the host; occupants: the slots'
        `occupant` when it launched."""
        seated = self.occupant[slots] == occupants
        if not seated.all():  # a slot released and reseated since: its new request holds none of these
            slots, tokens = slots[seated], tokens[seated]
        self.num_held[slots] += 1
        self.last_held[slots] = tokens

    def append_blocks(self, slot: int, block_ids: list[int]) -> None:
        start = int(self.num_blocks[slot])
        end = start + len(block_ids)
        if end > self.block_table.shape[1]:
            raise ValueError(f"slot {slot}: {end} blocks exceed the {self.block_table.shape[1]} a request may hold")
        self.block_table[slot, start:end] = block_ids
        self.num_blocks[slot] = end

    def prepare(
        self,
        rids: list[int],
        starts: np.ndarray,
        query_lens: np.ndarray,
        samples: np.ndarray,
        slots: np.ndarray,
        token_ids_of: Callable[[int], list[int]],
    ) -> StepInputs:
        """Inputs of a forward over a plan's chunks: chunk i computes query_lens[i] tokens of request rids[i]
        from position starts[i] and samples when samples[i]; slots[i]: its request's slot; token_ids_of(i): the
        tokens the host holds of it (read only for a chunk of several tokens, or of one before the host's last).

        A computed position the host does not hold is the one token sampled by a step still in flight: its
        input is gathered from the device's last-token slots (pending_rows, pending_slots)."""
        num_known = self.num_held[slots]
        multi = query_lens > 1
        num_prefill = int(np.count_nonzero(multi))
        order = None
        if num_prefill and not multi[:num_prefill].all():
            # Multi-token chunks first, single-token ones last (the attention backends' layout), stable.
            order = (~multi).argsort(kind="stable")
            rids = pick(rids, order.tolist())
            slots, num_known, starts, query_lens = slots[order], num_known[order], starts[order], query_lens[order]
            samples = samples[order]
        ends = starts + query_lens
        ahead = ends - num_known
        _check_inputs_held(rids, ends, num_known, ahead, num_prefill)
        last_rows, positions, slot_mapping = self._token_rows(starts, query_lens, ends, slots, num_prefill)
        width = 1 << (-(-int(ends.max()) // self.block_size) - 1).bit_length()
        layout = BatchLayout(query_lens, ends, self.block_table[slots, :width], num_prefill)

        if order is not None:
            token_ids_of = _in_plan_order(token_ids_of, order)
        input_ids = self._held_input_ids(
            len(positions), num_prefill, starts, query_lens, slots, ahead, last_rows, token_ids_of
        )
        pending = ahead > 0
        sampling_rows = samples.nonzero()[0]
        return StepInputs(
            rids,
            order,
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

    def _token_rows(
        self, starts: np.ndarray, query_lens: np.ndarray, ends: np.ndarray, slots: np.ndarray, num_prefill: int
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Each chunk's last token row; each token's position and KV-store slot. Chunks in layout order."""
        if num_prefill:
            last_rows = query_lens.cumsum() - 1
            # Each chunk's last token, at row last_rows[i], is at position ends[i] - 1.
            positions = np.arange(int(last_rows[-1]) + 1, dtype=np.int64) + (ends - 1 - last_rows).repeat(query_lens)
            token_slots = slots.repeat(query_lens)
        else:  # one token each (a decode step): no expansion
            last_rows, positions, token_slots = np.arange(len(starts)), starts, slots
        bs = self.block_size
        blocks, offsets = np.divmod(positions, bs)
        # A take from the flat table: 2/3 of a 2-D fancy index's time over a mixed step's tokens.
        block_ids = self.block_table.ravel().take(token_slots * self.block_table.shape[1] + blocks)
        return last_rows, positions, block_ids.astype(np.int64) * bs + offsets

    def _held_input_ids(
        self,
        num_tokens: int,
        num_prefill: int,
        starts: np.ndarray,
        query_lens: np.ndarray,
        slots: np.ndarray,
        ahead: np.ndarray,
        last_rows: np.ndarray,
        token_ids_of: Callable[[int], list[int]],
    ) -> np.ndarray:
        """The step's input ids the host holds, 0 at the others (pending rows). Chunks in layout order."""
        input_ids = np.zeros(num_tokens, dtype=np.int64)
        # A multi-token chunk (a prompt's, a recomputation's) holds every input but its last at most: copied chunk
        # by chunk, a handful a step, from row 0 on (they come first).
        row = 0
        columns = (starts[:num_prefill].tolist(), query_lens[:num_prefill].tolist(), ahead[:num_prefill].tolist())
        for i, (start, count, not_held) in enumerate(zip(*columns)):
            num_inputs = count - max(0, not_held)
            tokens = token_ids_of(i)[start : start + num_inputs]
            input_ids[row : row + num_inputs] = np.fromiter(tokens, np.int64, num_inputs)  # (3/4 of assigning the list)
            row += count
        # A one-token chunk's input the host holds is mostly the last token it read back (the worker finished the
        # step that sampled it before this plan came): one gather for all of them.
        held = (ahead[num_prefill:] <= 0).nonzero()[0] + num_prefill
        if len(held):
            input_ids[last_rows[held]] = self.last_held[slots[held]]
            for i in held[ahead[held] < 0].tolist():  # an older token (a one-token chunk of a prompt)
                input_ids[last_rows[i]] = token_ids_of(i)[int(starts[i])]
        return input_ids


def _in_plan_order(token_ids_of: Callable[[int], list[int]], order: np.ndarray) -> Callable[[int], list[int]]:
    """token_ids_of by chunk in layout order, from one by chunk in plan order (order: each's index in the plan)."""
    return lambda i: token_ids_of(int(order[i]))


def _check_inputs_held(
    rids: list[int], ends: np.ndarray, num_known: np.ndarray, ahead: np.ndarray, num_prefill: int
) -> None:
    """An input the host does not hold was sampled by a step still in flight, so it can only be a one-token
    chunk's (a decode's) and at most PIPELINE_DEPTH - 1 steps ahead of the host; a longer chunk's inputs are all
    held but for its last one at most (the step before finishes a prompt). Chunks in layout order."""
    most_ahead = PIPELINE_DEPTH - 1
    prefill_most_ahead = min(1, most_ahead)
    peak = int(ahead.max())
    if peak <= prefill_most_ahead or (peak <= most_ahead and ahead[:num_prefill].max(initial=0) <= prefill_most_ahead):
        return
    limits = np.full(len(ahead), most_ahead)
    limits[:num_prefill] = prefill_most_ahead
    i = int(np.argmax(ahead > limits))
    raise ValueError(
        f"request {rids[i]}: position {ends[i] - 1} is ahead of the host's {num_known[i]} tokens "
        f"by more than the {PIPELINE_DEPTH} steps in flight allow"
    )


def pick(items: Sequence[T] | Mapping[int, T], indices: list[int]) -> list[T]:
    """[items[i] for i in indices] (indices may be a mapping's keys) in one C-level call: about half a
    comprehension's time over a step's hundreds of entries."""
    if len(indices) < 2:
        return [items[i] for i in indices]
    return list(operator.itemgetter(*indices)(items))


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
