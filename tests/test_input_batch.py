"""The worker's persistent batch: a step's inputs gathered from per-slot arrays equal those built from the
plan afresh, the padding of eager forwards changes no real row's output, and a graph's device-side inputs
are the tokens the host does not hold."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from common.messages import ScheduledChunk, StepPlan
from common.pipeline import PIPELINE_DEPTH
from common.sampling_params import SamplingParams
from gpu_worker.attention.base import BatchLayout
from gpu_worker.graph_capture import with_device_inputs, write_gather_slots
from gpu_worker.input_batch import PersistentBatch, eager_bucket, pad_batch
from offline import LLM
from tests.tiny_models import hf_greedy, random_prompts

BLOCK = 4


def prepare(batch: PersistentBatch, chunks: list[ScheduledChunk], slots: np.ndarray, known):
    """The batch's inputs for these chunks, given as the plan's columns (StepPlan.of); known(rid): the tokens the
    host holds of a request (as the batch's slots were reset with)."""
    plan = StepPlan.of(1, [], chunks, [])
    columns = [np.array(c) for c in (plan.starts, plan.num_tokens, plan.samples)]
    return batch.prepare(plan.rids, *columns, slots, lambda i: known(plan.rids[i]))


def test_a_mixed_step_matches_the_layout_built_from_the_block_tables():
    batch = PersistentBatch(num_slots=8, max_blocks_per_request=6, block_size=BLOCK)
    tables = {5: [10, 11, 12], 2: [3, 4], 7: [20]}  # slot -> blocks
    known = {5: [1] * 9 + [2, 3], 2: list(range(7)), 7: [9, 8]}  # tokens the host holds, per slot
    for slot, blocks in tables.items():
        batch.reset(slot, known[slot])
        batch.append_blocks(slot, blocks)
    # A decode listed before a prefill chunk: the batch must put multi-token chunks first.
    chunks = [
        ScheduledChunk(rid=50, start=7, num_tokens=1, new_block_ids=[], sample=True),  # slot 2, pending token
        ScheduledChunk(rid=70, start=0, num_tokens=2, new_block_ids=[], sample=True),  # slot 7, prompt
        ScheduledChunk(rid=51, start=8, num_tokens=3, new_block_ids=[], sample=False),  # slot 5, prompt chunk
    ]
    slot_of = {50: 2, 70: 7, 51: 5}
    slots = np.array([slot_of[c.rid] for c in chunks])
    inputs = prepare(batch, chunks, slots, lambda rid: known[slot_of[rid]])

    assert inputs.rids == [70, 51, 50] and inputs.order.tolist() == [1, 2, 0]
    expected = BatchLayout.build([2, 3, 1], [2, 11, 8], [tables[7], tables[5], tables[2]], BLOCK)
    assert inputs.layout.query_lens.tolist() == [2, 3, 1]
    assert inputs.layout.context_lens.tolist() == [2, 11, 8]
    assert inputs.layout.num_prefill_seqs == 2
    width = expected.block_table.shape[1]
    for row, blocks in enumerate([tables[7], tables[5], tables[2]]):
        used = -(-expected.context_lens[row] // BLOCK)
        assert inputs.layout.block_table[row, :used].tolist() == blocks[:used]
    assert inputs.layout.block_table.shape[1] == width
    assert inputs.positions.tolist() == [0, 1, 8, 9, 10, 7]
    assert inputs.slot_mapping.tolist() == expected.slot_mapping(inputs.positions, BLOCK).tolist()
    assert inputs.input_ids.tolist() == [9, 8, 1, 2, 3, 0]  # the decode's token is only on the device
    assert inputs.pending_rows.tolist() == [5] and inputs.pending_slots.tolist() == [2]
    assert inputs.sampling_rows.tolist() == [0, 2] and inputs.logit_rows.tolist() == [1, 5]


def test_decodes_whose_last_token_was_read_back_take_it_from_the_host():
    """The worker finished the step before this plan came: every input is on the host, none is gathered."""
    batch = PersistentBatch(num_slots=4, max_blocks_per_request=4, block_size=BLOCK)
    known = {0: [5, 6, 7], 1: [8, 9], 2: [1, 2, 3, 4, 10]}  # slot -> tokens read back
    for slot, tokens in known.items():
        batch.reset(slot, tokens)
        batch.append_blocks(slot, [slot + 1, slot + 5])
    chunks = [
        ScheduledChunk(rid=20 + slot, start=len(tokens) - 1, num_tokens=1, new_block_ids=[], sample=True)
        for slot, tokens in known.items()
    ]
    slots = np.array(list(known))
    inputs = prepare(batch, chunks, slots, lambda rid: known[rid - 20])
    assert inputs.input_ids.tolist() == [7, 9, 10]
    assert inputs.positions.tolist() == [2, 1, 4]
    assert len(inputs.pending_rows) == 0


def test_a_prompt_chunk_behind_its_last_token_and_a_one_token_chunk_of_an_older_position():
    """A chunk whose last input the step in flight samples takes it from the device; a one-token chunk of a
    position before the host's last token takes that position's token."""
    batch = PersistentBatch(num_slots=2, max_blocks_per_request=4, block_size=BLOCK)
    known = {0: [5, 6, 7, 8], 1: [1, 2, 3, 4, 9]}
    for slot, tokens in known.items():
        batch.reset(slot, tokens)
        batch.append_blocks(slot, [slot + 1, slot + 3])
    chunks = [
        ScheduledChunk(rid=30, start=2, num_tokens=1, new_block_ids=[], sample=False),  # slot 1: token 3
        ScheduledChunk(rid=40, start=2, num_tokens=3, new_block_ids=[], sample=True),  # slot 0: 7, 8, pending
    ]
    slot_of = {30: 1, 40: 0}
    inputs = prepare(batch, chunks, np.array([1, 0]), lambda rid: known[slot_of[rid]])
    assert inputs.input_ids.tolist() == [7, 8, 0, 3]
    assert inputs.pending_rows.tolist() == [2] and inputs.pending_slots.tolist() == [0]


def test_a_position_further_ahead_of_the_host_than_the_steps_in_flight_is_refused():
    batch = PersistentBatch(num_slots=2, max_blocks_per_request=4, block_size=BLOCK)
    batch.reset(0, [0] * 4)
    batch.append_blocks(0, [1, 2])
    # The host holds 4 tokens; each step in flight but the one being prepared sampled one more.
    position = 4 + PIPELINE_DEPTH - 1
    chunk = ScheduledChunk(rid=9, start=position, num_tokens=1, new_block_ids=[], sample=True)
    with pytest.raises(ValueError, match=f"request 9: position {position} is ahead of the host's 4 tokens"):
        prepare(batch, [chunk], np.array([0]), lambda rid: [0] * 4)
    allowed = ScheduledChunk(rid=9, start=position - 1, num_tokens=1, new_block_ids=[], sample=True)
    assert prepare(batch, [allowed], np.array([0]), lambda rid: [0] * 4).pending_rows.tolist() == [0]


def test_a_prompt_chunk_needs_every_input_but_its_last_on_the_host():
    batch = PersistentBatch(num_slots=2, max_blocks_per_request=4, block_size=BLOCK)
    batch.reset(0, [0] * 4)
    batch.append_blocks(0, [1, 2])
    chunk = ScheduledChunk(rid=9, start=2, num_tokens=4, new_block_ids=[], sample=True)
    with pytest.raises(ValueError, match="request 9: position 5"):
        prepare(batch, [chunk], np.array([0]), lambda rid: [0] * 4)


def test_a_finished_step_counts_its_tokens_only_for_the_requests_it_sampled_for():
    """A slot released and given to another request while a step that sampled for it was in flight: the new
    request's tokens are left as they were; then its decode's input is its own last token."""
    batch = PersistentBatch(num_slots=2, max_blocks_per_request=4, block_size=BLOCK)
    batch.reset(0, [5, 6])
    batch.reset(1, [7])
    slots = np.array([0, 1])
    occupants = batch.occupant[slots]
    batch.reset(1, [8, 9, 10])
    batch.record_samples(slots, occupants, np.array([11, 12]))
    assert batch.num_held.tolist() == [3, 3] and batch.last_held.tolist() == [11, 10]
    batch.append_blocks(1, [1])
    decode = ScheduledChunk(rid=4, start=2, num_tokens=1, new_block_ids=[], sample=True)
    assert prepare(batch, [decode], np.array([1]), lambda rid: [8, 9, 10]).input_ids.tolist() == [10]


def test_a_request_cannot_hold_more_blocks_than_its_context_allows():
    batch = PersistentBatch(num_slots=1, max_blocks_per_request=3, block_size=BLOCK)
    batch.append_blocks(0, [1, 2, 3, 4])  # 4 columns: a power of two of them is kept
    with pytest.raises(ValueError, match="exceed"):
        batch.append_blocks(0, [5])


def test_eager_buckets_are_few_and_cover_every_count():
    buckets = {eager_bucket(n) for n in range(1, 4500)}
    assert all(eager_bucket(n) >= n for n in range(1, 4500))
    assert all(eager_bucket(n) - n < 64 for n in range(65, 4500))
    assert len(buckets) < 80


def test_padding_rows_are_one_token_sequences_in_the_scratch_block():
    layout = BatchLayout.build([3, 1], [3, 5], [[1], [2, 3]], BLOCK)
    ids, pos, slots, padded = pad_batch(
        np.array([5, 6, 7, 8]), np.array([0, 1, 2, 4]), np.array([4, 5, 6, 12]), layout, 6, 9, BLOCK
    )
    assert ids.tolist() == [5, 6, 7, 8, 0, 0] and pos.tolist() == [0, 1, 2, 4, 0, 0]
    assert slots.tolist() == [4, 5, 6, 12, 36, 36]
    assert padded.query_lens.tolist() == [3, 1, 1, 1] and padded.context_lens.tolist() == [3, 5, 1, 1]
    assert padded.block_table[2:, 0].tolist() == [9, 9] and padded.num_prefill_seqs == 1


def test_padded_eager_forwards_give_the_same_tokens(tiny_model):
    """What CUDA runs (every eager forward padded to a bucket), forced on the CPU: still token-exact."""
    prompts = random_prompts(5, [3, 17, 40, 9, 66], vocab=256, seed=3)
    llm = LLM(str(tiny_model), device="cpu", dtype="float32", max_num_batched_tokens=48)
    llm.runner.eager.pad = True
    outs = llm.generate(prompts, SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True))
    assert [o.token_ids for o in outs] == hf_greedy(tiny_model, prompts, 12)


@pytest.mark.parametrize(
    ("pending_rows", "pending_slots"),
    [
        pytest.param([0, 1, 2, 3], [7, 2, 5, 0], id="a-decode-step-every-row"),
        pytest.param([3], [2], id="one-decode-after-a-prompt"),
        pytest.param([], [], id="every-input-on-the-host"),
    ],
)
def test_a_graph_takes_from_the_device_exactly_the_rows_the_host_does_not_hold(pending_rows, pending_slots):
    """The static gather slots (over a larger step's values) make the captured forward's input ids: the slot's
    last sampled token on pending rows, the host's id on the others and on padding."""
    field = np.full(6, 99, dtype=np.int32)  # an older, larger step's slots
    field[4:] = -1  # padding rows, as the graphs' padding writes them
    write_gather_slots(field, 4, np.array(pending_rows, np.int64), np.array(pending_slots, np.int64))
    last_tokens = torch.tensor([100, 101, 102, 103, 104, 105, 106, 107])
    host_ids = torch.tensor([11, 12, 13, 14, 0, 0], dtype=torch.int32)
    ids = with_device_inputs(host_ids, torch.from_numpy(field), last_tokens)
    expected = host_ids.long().clone()
    for row, slot in zip(pending_rows, pending_slots):
        expected[row] = 100 + slot
    assert ids.tolist() == expected.tolist()
