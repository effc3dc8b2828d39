"""The prefix cache: a radix trie over token ids, one node per full KV block.

    root ─(t0..t15)─▶ node[block 7] ─(t16..t31)─▶ node[block 2] ─▶ ...
                                    └(t16'..t31')─▶ node[block 9]

A child is keyed by the tuple of its block's tokens, so matching a prompt walks one dict lookup per
block: time proportional to the prompt, not to the cache. A request's cache_salt heads its first block's
key, (salt, t0..t15): a salted prompt's chain hangs apart from every other salt's (and from the unsalted
ones), so one client's prompts are never matched by another's; below the first block nothing changes.

The cache is one holder of each node's block. A request that uses a cached block is another holder, and
it holds the whole chain from the root (matches are prefixes), so a node whose block has one holder (the
cache) has only such nodes below it: those are exactly the evictable blocks, and leaves among them go
first, least recently used.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Iterator
from dataclasses import dataclass, field

from scheduler.block_manager import BlockManager

BlockKey = tuple[int | str, ...]  # a block's tokens; a first block's are headed by its request's cache_salt, if any


@dataclass(eq=False, slots=True)
class TrieNode:
    block: int
    parent: TrieNode | None
    key: BlockKey
    children: dict[BlockKey, TrieNode] = field(default_factory=dict)
    last_access: int = 0
    removed: bool = False


@dataclass(slots=True)
class InsertCursor:
    """Where a request's next insert resumes: the node of block next_block - 1 (None: the root)."""

    node: TrieNode | None = None
    next_block: int = 0
    stopped: bool = False

    def resume_position(self, block_size: int) -> int:
        """The first token position the next insert needs: where it resumes, or 0 when it must walk from the
        root again (first insert, or its node was evicted)."""
        return 0 if self.node is None or self.node.removed else self.next_block * block_size


class PrefixCache:
    def __init__(self, blocks: BlockManager):
        self.blocks = blocks
        self.block_size = blocks.block_size
        self.root = TrieNode(block=-1, parent=None, key=())
        self.node_of_block: dict[int, TrieNode] = {}
        self.num_evictable = 0
        self._clock = itertools.count(1)
        self._lru: list[tuple[int, int, TrieNode]] = []  # (last_access, tiebreak, node); stale entries skipped
        self._tiebreak = itertools.count()

    def __len__(self) -> int:
        return len(self.node_of_block)

    # ------------------------------------------------------------------ lookups

    def match(self, token_ids: list[int], max_blocks: int, salt: str | None = None) -> tuple[list[int], InsertCursor]:
        """Blocks of the longest cached prefix (at most max_blocks) under `salt`, each gaining the caller as
        holder, and the cursor from which the caller's own blocks will be inserted."""
        node, matched = self.root, []
        bs = self.block_size
        now = next(self._clock)
        for i in range(min(max_blocks, len(token_ids) // bs)):
            key: BlockKey = tuple(token_ids[i * bs : (i + 1) * bs])
            child = node.children.get(key if i or salt is None else (salt, *key))
            if child is None:
                break
            child.last_access = now
            if self.blocks.add_holder(child.block) == 2:
                self.num_evictable -= 1
            matched.append(child.block)
            node = child
        return matched, InsertCursor(node, len(matched))

    def insert(
        self,
        token_ids: list[int],
        block_ids: list[int],
        cursor: InsertCursor,
        first_position: int = 0,
        salt: str | None = None,
    ) -> None:
        """Cache a request's full blocks from cursor.next_block up to the end of token_ids, moving the cursor.
        token_ids[k] is the token at position first_position + k, where first_position is 0 or
        cursor.resume_position(bs) (a request caching its output's blocks at its end copies no more than them).
        salt: the request's cache_salt, as it was matched.

        If a node for the same tokens already exists with another block (the same prefix computed twice,
        by two requests running side by side), the request stops caching: its own copy is not shared, so
        every node still hangs under nodes that are held at least as long as it is.
        """
        if cursor.stopped:
            return
        node = cursor.node
        bs = self.block_size
        if node is None or node.removed:  # first call, or the resume point was evicted: walk from the root
            node, cursor.next_block = self.root, 0
        if first_position not in (0, cursor.next_block * bs):
            raise ValueError(f"tokens from position {first_position}; the insert resumes at block {cursor.next_block}")
        now = next(self._clock)
        first, end = cursor.next_block, (first_position + len(token_ids)) // bs
        # The blocks' keys cut in one C-level pass (zip over bs references to one iterator), not a slice and a tuple
        # per block; each key is hashed once (setdefault), not once to look it up and again to add it.
        span = token_ids[first * bs - first_position : end * bs - first_position]
        keys: Iterator[BlockKey] = zip(*[iter(span)] * bs)
        node_of_block = self.node_of_block
        added: list[int] = []
        for i, key in enumerate(keys, first):
            if i == 0 and salt is not None:
                key = (salt, *key)
            block = block_ids[i]
            new_node = TrieNode(block, node, key)
            child = node.children.setdefault(key, new_node)
            if child is new_node:
                node_of_block[block] = child
                added.append(block)
            elif child.block != block:
                cursor.stopped = True
                break
            child.last_access = now
            node = child
            cursor.next_block = i + 1
        self.blocks.add_holders(added)
        cursor.node = node

    # ------------------------------------------------------------------ holders letting go

    def release(self, block: int) -> None:
        """A request lets go of a block; the cache notes when it becomes the only holder. Only a leaf goes on the
        eviction heap: a node with children is evictable only after them, and evict() pushes it when its last
        child goes (a request lets go of ~30 blocks at its end, of which only the last is a leaf: pushing them
        all made evict pop ~30 stale entries per block it freed, a third of the scheduler's time in a burst
        once the cache was full)."""
        remaining = self.blocks.release(block)
        if remaining == 1:
            node = self.node_of_block.get(block)
            if node is not None:
                self.num_evictable += 1
                if not node.children:
                    heapq.heappush(self._lru, (node.last_access, next(self._tiebreak), node))

    def evict(self, n: int) -> int:
        """Free up to n blocks, least recently used leaves first. Returns how many were freed."""
        freed = 0
        while freed < n and self._lru:
            access, _, node = heapq.heappop(self._lru)
            if node.removed or node.children or access != node.last_access or self.blocks.ref_counts[node.block] != 1:
                continue  # stale entry: used again, or not a leaf yet (it is pushed again when it is)
            self._remove(node)
            freed += 1
            parent = node.parent
            if (
                parent is not None
                and parent is not self.root
                and not parent.children
                and self.blocks.ref_counts[parent.block] == 1
            ):
                heapq.heappush(self._lru, (parent.last_access, next(self._tiebreak), parent))
        return freed

    def _remove(self, node: TrieNode) -> None:
        node.removed = True
        assert node.parent is not None, "the root is never removed"
        del node.parent.children[node.key]
        del self.node_of_block[node.block]
        self.num_evictable -= 1
        self.blocks.release(node.block)

    def check_integrity(self) -> None:
        evictable = sum(1 for b in self.node_of_block if self.blocks.ref_counts[b] == 1)
        assert evictable == self.num_evictable, f"evictable count {self.num_evictable}, actual {evictable}"
        stack = [self.root]
        seen = 0
        while stack:
            node = stack.pop()
            for key, child in node.children.items():
                assert child.parent is node and child.key == key and not child.removed
                assert self.node_of_block.get(child.block) is child
                if self.blocks.ref_counts[child.block] > 1 and node is not self.root:
                    assert self.blocks.ref_counts[node.block] > 1, "a used node under an evictable one"
                seen += 1
                stack.append(child)
        assert seen == len(self.node_of_block), "trie nodes and block index disagree"
        # Every evictable leaf can be found by evict(): it has a heap entry that is not stale.
        live = {id(node) for access, _, node in self._lru if access == node.last_access and not node.removed}
        for block, node in self.node_of_block.items():
            if self.blocks.ref_counts[block] == 1 and not node.children:
                assert id(node) in live, f"evictable leaf of block {block} is not on the eviction heap"
