"""benchmarks.n_samples reports the scheduler's prompt work over one request of n samples per prompt."""

from __future__ import annotations

from benchmarks.n_samples import main


def test_the_prompt_work_of_one_request_is_counted(tiny_server):
    args = ["--url", tiny_server.url, "--prompts", "2", "--n", "3", "--prompt-len", "40", "--vocab", "512"]
    result = main([*args, "--echo", "--logprobs", "1", "--seed", "3"])
    assert len(result["choices"]) == 6 and result["wall_s"] > 0
    # Each prompt once; each other sample its last 8 tokens (the 16-token blocks before them are cached).
    assert result["prompt_tokens_computed"] == 2 * 40 + 2 * 2 * 8
    assert result["prompt_tokens_admitted"] == 6 * 40
