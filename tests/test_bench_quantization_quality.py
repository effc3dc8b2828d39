"""benchmarks.quantization_quality: agreement counts the tokens before the first difference, the logprob gap
is over the same (the base's) tokens, and the whole run works end to end on a tiny model."""

import json

import pytest

from benchmarks.quantization_quality import EngineRun, compare, main


def test_agreement_counts_the_tokens_before_the_first_difference_and_logprobs_compare_the_same_tokens():
    base = EngineRun(outputs=[[1, 2, 3, 4], [5, 6]], scored=[[-0.1, -0.2, -0.3, -0.4], [-0.5, -0.6]])
    run = EngineRun(outputs=[[1, 2, 9, 9], [5, 6]], scored=[[-0.1, -0.5, -0.3, -0.4], [-0.5, -0.6]])
    result = compare(run, base)
    assert result["greedy_agreement"] == 4 / 6  # 2 of the first output, all of the second
    assert result["exact_outputs"] == 0.5
    assert result["mean_abs_delta_logprob"] == pytest.approx(0.3 / 6)
    assert result["max_abs_delta_logprob"] == pytest.approx(0.3) and result["scored_tokens"] == 6


def test_the_benchmark_runs_on_a_tiny_model_and_writes_its_report(tiny_llama, tmp_path):
    out = tmp_path / "quality.json"
    report = main(["--model", str(tiny_llama), "--device", "cpu", "--max-tokens", "3", "--out", str(out)])
    assert json.loads(out.read_text()) == report
    assert set(report["compared"]) == {"fp8", "kv_fp8", "fp8+kv_fp8", "float32"} and report["prompts"] == 32
    for result in report["compared"].values():
        assert result["scored_tokens"] == report["base_tokens"]
        assert 0 <= result["greedy_agreement"] <= 1 and result["mean_abs_delta_logprob"] >= 0
