"""The compiled-grammar cache is bounded in bytes: each entry costs its compiled grammar's size and its source; past
the bound the least recently used go, and a grammar larger than the whole bound is not kept."""

from __future__ import annotations

from dataclasses import dataclass

from scheduler.grammar_cache import GrammarCache


@dataclass
class Compiled:
    """Stands for xgrammar's CompiledGrammar: only its size is read."""

    memory_size_bytes: int


def key(i: int) -> tuple[str, str]:
    return ("choice", f'["{i:06d}"]')  # 10 bytes of source each


def test_distinct_grammars_never_hold_more_bytes_than_the_bound():
    cache = GrammarCache(limit_bytes=1_000)
    for i in range(500):
        cache.put(key(i), Compiled(90))
        assert cache.size_bytes <= 1_000
    assert len(cache) == 10 and cache.size_bytes == 10 * (90 + 10)
    assert cache.get(key(499)) is not None and cache.get(key(0)) is None


def test_the_least_recently_used_grammar_goes_first():
    cache = GrammarCache(limit_bytes=300)
    for i in range(3):
        cache.put(key(i), Compiled(90))
    assert cache.get(key(0)) is not None  # used: now the most recent
    cache.put(key(3), Compiled(90))
    assert cache.get(key(1)) is None
    assert all(cache.get(key(i)) is not None for i in (0, 2, 3))


def test_a_grammar_larger_than_the_bound_is_not_kept_and_evicts_nothing():
    cache = GrammarCache(limit_bytes=300)
    cache.put(key(0), Compiled(90))
    cache.put(key(1), Compiled(1_000))
    assert cache.get(key(1)) is None and cache.get(key(0)) is not None
    assert cache.size_bytes == 100
