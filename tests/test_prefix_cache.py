"""The prefix cache fed a block at a time, as a decoding request feeds it (only the new block's tokens), holds
the same prefix as one fed the whole sequence at once."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from scheduler.block_manager import BlockManager
from scheduler.prefix_cache import InsertCursor, PrefixCache
from scheduler.request import Request

BS = 4


def cache_with_blocks(num_blocks: int) -> tuple[PrefixCache, list[int]]:
    blocks = BlockManager(num_blocks, BS)
    return PrefixCache(blocks), blocks.allocate(num_blocks)


@settings(max_examples=50, deadline=None)
@given(tokens=st.lists(st.integers(0, 9), min_size=BS, max_size=8 * BS), steps=st.lists(st.integers(1, 9)))
def test_inserting_block_by_block_caches_what_one_whole_insert_does(tokens, steps):
    num_blocks = len(tokens) // BS
    whole, whole_blocks = cache_with_blocks(num_blocks)
    whole.insert(tokens, whole_blocks, InsertCursor())
    pieces, piece_blocks = cache_with_blocks(num_blocks)
    cursor, known = InsertCursor(), 0
    for step in [*steps, len(tokens)]:  # tokens become known a few at a time, then all of them
        known = min(len(tokens), known + step)
        start = cursor.resume_position(BS)
        pieces.insert(tokens[start : known // BS * BS], piece_blocks, cursor, start)
    assert cursor.next_block == num_blocks
    assert pieces.match(tokens, num_blocks)[0] == whole.match(tokens, num_blocks)[0] == whole_blocks


def test_an_insert_given_tokens_from_elsewhere_than_its_resume_point_is_refused():
    cache, blocks = cache_with_blocks(3)
    cursor = InsertCursor()
    cache.insert(list(range(BS)), blocks, cursor)
    with pytest.raises(ValueError, match="resumes at block 1"):
        cache.insert(list(range(BS)), blocks, cursor, first_position=2 * BS)


def test_a_token_span_crosses_from_the_prompt_into_the_outputs_without_the_rest():
    request = Request(1, [1, 2, 3, 4, 5], None, 10, None, output_ids=[6, 7, 8])  # type: ignore[arg-type]
    assert request.token_span(1, 4) == [2, 3, 4]
    assert request.token_span(3, 7) == [4, 5, 6, 7]
    assert request.token_span(6, 8) == [7, 8]
    assert request.token_span(0, 8) == request.known_token_ids()


def test_a_salted_prompts_blocks_are_matched_only_under_the_same_salt():
    cache, blocks = cache_with_blocks(4)
    tokens = list(range(2 * BS))
    cache.insert(tokens, blocks[:2], InsertCursor(), salt="a")
    cache.insert(tokens, blocks[2:], InsertCursor())  # the same tokens, unsalted: a chain of their own
    assert cache.match(tokens, 2, "a")[0] == blocks[:2]
    assert cache.match(tokens, 2)[0] == blocks[2:]
    assert cache.match(tokens, 2, "b")[0] == []
    cache.check_integrity()


def test_a_salted_chain_is_evicted_like_any_other():
    cache, blocks = cache_with_blocks(2)
    tokens = list(range(2 * BS))
    cache.insert(tokens, blocks, InsertCursor(), salt="a")
    for block in blocks:
        cache.release(block)  # the inserting request lets go: the cache is the only holder
    assert cache.evict(2) == 2 and len(cache) == 0
    assert cache.match(tokens, 2, "a")[0] == []
    cache.check_integrity()
