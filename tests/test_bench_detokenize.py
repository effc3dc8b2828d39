"""benchmarks.detokenize times both ways of detokenizing, each checked against the whole decode."""

from __future__ import annotations

from benchmarks.detokenize import main


def test_both_ways_are_timed_on_the_same_tokens(tiny_llama):
    result = main(["--model", str(tiny_llama), "--tokens", "300"])
    assert set(result) == {"python windows", "decode stream"}
    assert all(microseconds > 0 for microseconds in result.values())
