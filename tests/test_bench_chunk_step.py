"""benchmarks.chunk_step times each chunk of a long prompt's prefill beside decoding requests."""

from __future__ import annotations

from benchmarks.chunk_step import main


def test_every_chunk_of_the_long_prompt_is_timed_in_order(tiny_model):
    result = main(
        [
            "--model",
            str(tiny_model),
            "--device",
            "cpu",
            "--prompt-len",
            "200",
            "--chunk",
            "64",
            "--decodes",
            "3",
            "--profile",
        ]
    )
    chunks = result["chunks"]
    assert [c["start"] for c in chunks] == [0, 64, 128, 192]
    assert sum(c["tokens"] for c in chunks) == 200
    assert all(c["ms"] > 0 for c in chunks) and result["decode_only_ms"] > 0
