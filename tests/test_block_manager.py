"""The block manager: allocation, reference counts, freeing, and a clear signal on exhaustion."""

from __future__ import annotations

import pytest

from scheduler.block_manager import BlockManager, OutOfBlocks


def test_allocation_hands_out_distinct_blocks_with_one_holder():
    blocks = BlockManager(num_blocks=8, block_size=4)
    got = blocks.allocate(5)
    assert len(set(got)) == 5
    assert all(blocks.ref_counts[b] == 1 for b in got)
    assert blocks.num_free == 3
    blocks.check_integrity()


def test_release_returns_a_block_to_the_free_list_only_at_zero_holders():
    blocks = BlockManager(num_blocks=4, block_size=4)
    [b] = blocks.allocate(1)
    assert blocks.add_holder(b) == 2
    assert blocks.release(b) == 1
    assert blocks.num_free == 3
    assert blocks.release(b) == 0
    assert blocks.num_free == 4
    blocks.check_integrity()


def test_exhaustion_raises_out_of_blocks_and_changes_nothing():
    blocks = BlockManager(num_blocks=3, block_size=4)
    blocks.allocate(2)
    with pytest.raises(OutOfBlocks, match="asked for 2 KV blocks, 1 free"):
        blocks.allocate(2)
    assert blocks.num_free == 1
    blocks.check_integrity()


def test_double_release_is_refused_and_count_never_goes_negative():
    blocks = BlockManager(num_blocks=2, block_size=4)
    [b] = blocks.allocate(1)
    blocks.release(b)
    with pytest.raises(ValueError, match="double free"):
        blocks.release(b)
    assert blocks.ref_counts[b] == 0
    blocks.check_integrity()


def test_sharing_a_free_block_is_refused():
    blocks = BlockManager(num_blocks=2, block_size=4)
    with pytest.raises(ValueError, match="is free"):
        blocks.add_holder(0)


def test_blocks_for_tokens_rounds_up():
    blocks = BlockManager(num_blocks=2, block_size=16)
    assert [blocks.blocks_for_tokens(n) for n in (0, 1, 16, 17, 32)] == [0, 1, 1, 2, 2]
