"""KV block accounting: the free list and the reference counts. The one place that frees a block.

A block's holders are the requests whose block table lists it, plus the prefix cache when the block is
in the trie. ref_count[b] == number of holders; a block is on the free list exactly when it has none.
"""

from __future__ import annotations

from collections import deque


class OutOfBlocks(RuntimeError):
    """Asked for more blocks than are free: the caller must evict, preempt, or wait."""


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int):
        if num_blocks < 1 or block_size < 1:
            raise ValueError("need at least one block of at least one token")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.ref_counts = [0] * num_blocks
        self._free: deque[int] = deque(range(num_blocks))

    @property
    def num_free(self) -> int:
        return len(self._free)

    def blocks_for_tokens(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def allocate(self, n: int) -> list[int]:
        """n blocks, each with one holder (the caller)."""
        if n > len(self._free):
            raise OutOfBlocks(f"asked for {n} KV blocks, {len(self._free)} free")
        blocks = [self._free.popleft() for _ in range(n)]
        for b in blocks:
            self.ref_counts[b] = 1
        return blocks

    def add_holder(self, block: int) -> int:
        """One more holder for a block already in use; returns the new count."""
        if self.ref_counts[block] < 1:
            raise ValueError(f"block {block} is free: allocate it, don't share it")
        self.ref_counts[block] += 1
        return self.ref_counts[block]

    def add_holders(self, blocks: list[int]) -> None:
        """One more holder for each of these blocks, all in use (a prefix-cache insert's new nodes, in one call)."""
        ref_counts = self.ref_counts
        for block in blocks:
            if ref_counts[block] < 1:
                raise ValueError(f"block {block} is free: allocate it, don't share it")
            ref_counts[block] += 1

    def release(self, block: int) -> int:
        """One holder lets go; at zero holders the block is free again. Returns the new count."""
        count = self.ref_counts[block]
        if count < 1:
            raise ValueError(f"block {block} released with no holder (double free)")
        self.ref_counts[block] = count - 1
        if count == 1:
            self._free.append(block)
        return count - 1

    def check_integrity(self) -> None:
        free = set(self._free)
        assert len(free) == len(self._free), "a block is on the free list twice"
        for b, count in enumerate(self.ref_counts):
            assert count >= 0, f"block {b} has a negative count"
            assert (count == 0) == (b in free), f"block {b}: count {count} but free={b in free}"
