"""Compiled grammars kept for the next request that asks for the same one, bounded in bytes.

An entry costs its compiled grammar's own estimate (xgrammar's `memory_size_bytes`: the grammar and its token
masks) plus its source, the key. Past the bound the least recently used entries go; a grammar larger than the
whole bound is not kept. A grammar in use by a request stays alive through its matcher whether cached or not:
the bound is on what is kept for nobody.

xgrammar's GrammarCompiler has a byte-bounded cache of its own, but its compiler also keeps memory the bound
does not count (freed only with the compiler: +2.5 MB per distinct 3,000-choice grammar, measured), so the
compile worker runs with xgrammar's cache off and this one is the only cache.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any

GrammarKey = tuple[str, str]  # (kind, spec): StructuredOutput's, whatever field it came from


class GrammarCache:
    def __init__(self, limit_bytes: int):
        self.limit_bytes = limit_bytes
        self.size_bytes = 0
        self._entries: OrderedDict[GrammarKey, tuple[Any, int]] = OrderedDict()  # key -> (compiled, bytes)

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, key: GrammarKey) -> Any | None:
        entry = self._entries.get(key)
        if entry is None:
            return None
        self._entries.move_to_end(key)
        return entry[0]

    def put(self, key: GrammarKey, compiled: Any) -> None:
        size = compiled.memory_size_bytes + len(key[1])
        if key in self._entries or size > self.limit_bytes:
            return
        while self.size_bytes + size > self.limit_bytes:
            _, (_, evicted) = self._entries.popitem(last=False)
            self.size_bytes -= evicted
        self._entries[key] = (compiled, size)
        self.size_bytes += size
