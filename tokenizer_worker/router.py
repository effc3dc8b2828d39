"""Which engine replica serves a request: the longest cached prefix, else the least load.

Each tokenizer worker routes the requests it tokenized and remembers where each one went, so its abort
reaches the same scheduler (and, taking the same socket, never overtakes it). The router asks the replicas
nothing: it keeps its own picture of them.

    prompt ids ─▶ block hashes h1 h2 h3 … (full blocks only, as the schedulers' prefix tries hold them;
                  each chained to the one before, so a hash names a whole prefix, as a trie node does;
                  h1 chained to the request's cache_salt, as the trie keys a first block with it)
    per replica:  the hashes of prompts recently routed there (LRU, bounded) ─▶ leading blocks matched
                  requests routed there and not yet finished (in flight)
    one replica:  no choice to make, so no hashes and no memory: only the requests in flight

    choose: most leading blocks matched, then fewest in flight, then lowest index, among the replicas
            whose load is within `max_imbalance` of the least loaded one (which always qualifies)

A replica the launcher took out (it failed: common/engine_replica.py) is not chosen again; `remove` hands
back the requests that were routed there, for the tokenizer worker to end. A replica on another host serves
from when its node joins (`add`), and again after its node comes back: with an empty trie, so an empty memory.

The guard keeps a popular prefix (a shared system prompt) from piling every request onto one replica: once
its replica is `max_imbalance` requests ahead, the next request goes elsewhere and that replica learns the
prefix too. The picture is approximate by design (a replica's trie may have evicted a prefix recorded
here; other tokenizer workers route too): a wrong guess costs a prefill, never a wrong answer.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict

# Block hashes remembered per replica. Full, 32768 cost ~6 MB of Python objects (the OrderedDict 4.5 MB, the
# hashes 1.1 MB) and ~10 MiB of RSS with the allocator's slack, reached within ~15,000 requests of varied
# prompts and flat from there (docs/notes/benchmark-history.md, Soak).
PREFIX_MEMORY_BLOCKS = 32768
MAX_IMBALANCE = 8  # requests in flight a cached prefix may put a replica ahead of the least loaded one


class ReplicaRouter:
    def __init__(
        self,
        num_replicas: int,
        block_size: int,
        memory_blocks: int = PREFIX_MEMORY_BLOCKS,
        max_imbalance: int = MAX_IMBALANCE,
        serving: list[int] | None = None,
    ):
        """`serving`: the replicas that serve from the start (default: all; those of headless nodes join later)."""
        self.block_size = block_size
        self.memory_blocks = memory_blocks
        self.max_imbalance = max_imbalance
        self.in_flight = [0] * num_replicas
        self.routed = [0] * num_replicas  # requests routed to each replica, ever
        self._prefixes: list[OrderedDict[int, None]] = [OrderedDict() for _ in range(num_replicas)]
        self._owner: dict[int, int] = {}
        self.serving = list(range(num_replicas)) if serving is None else sorted(serving)  # joined, not taken out

    def route(self, rid: int, prompt_ids: list[int], cache_salt: str | None = None) -> int:
        """The replica for a new request; it counts as in flight there until `release(rid)`. Some replica must
        serve."""
        replica = self._choose(prompt_ids, cache_salt) if len(self.serving) > 1 else self.serving[0]
        self._owner[rid] = replica
        self.in_flight[replica] += 1
        self.routed[replica] += 1
        return replica

    def owner(self, rid: int) -> int | None:
        return self._owner.get(rid)

    def release(self, rid: int) -> int | None:
        """The request ended (finished, aborted or refused): it no longer loads its replica. Returns that
        replica, None for a request this router does not hold."""
        replica = self._owner.pop(rid, None)
        if replica is not None:
            self.in_flight[replica] -= 1
        return replica

    def remove(self, replica: int) -> list[int]:
        """Route nothing more to `replica` (it failed); returns the requests routed there, now forgotten."""
        if replica in self.serving:
            self.serving.remove(replica)
        rids = [rid for rid, owner in self._owner.items() if owner == replica]
        for rid in rids:
            self.release(rid)
        self._prefixes[replica].clear()
        return rids

    def add(self, replica: int) -> None:
        """Route to `replica` from now on (its node joined, or came back with an empty trie)."""
        if replica not in self.serving:
            self.serving = sorted([*self.serving, replica])
        self._prefixes[replica].clear()

    def block_hashes(self, prompt_ids: list[int], cache_salt: str | None = None) -> list[int]:
        # Python's hash of a tuple of ints is the same in every process and run (a string's is not: the salt's
        # is hashlib's); a collision only misroutes.
        parent = 0
        if cache_salt is not None:
            parent = int.from_bytes(hashlib.blake2b(cache_salt.encode(), digest_size=8).digest(), "big")
        hashes, size = [], self.block_size
        for start in range(0, len(prompt_ids) - size + 1, size):
            parent = hash((parent, *prompt_ids[start : start + size]))
            hashes.append(parent)
        return hashes

    def remembered_blocks(self, replica: int) -> int:
        return len(self._prefixes[replica])

    def _choose(self, prompt_ids: list[int], cache_salt: str | None) -> int:
        hashes = self.block_hashes(prompt_ids, cache_salt)
        least = min(self.in_flight[r] for r in self.serving)
        candidates = [r for r in self.serving if self.in_flight[r] - least <= self.max_imbalance]
        replica = min(candidates, key=lambda r: (-self._matched_blocks(r, hashes), self.in_flight[r], r))
        self._remember(replica, hashes)
        return replica

    def _matched_blocks(self, replica: int, hashes: list[int]) -> int:
        known = self._prefixes[replica]
        matched = 0
        for h in hashes:
            if h not in known:
                break
            matched += 1
        return matched

    def _remember(self, replica: int, hashes: list[int]) -> None:
        known = self._prefixes[replica]
        for h in hashes:
            known[h] = None
            known.move_to_end(h)
        while len(known) > self.memory_blocks:
            known.popitem(last=False)
