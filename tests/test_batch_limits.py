"""Batch limits left to the device: the GPU worker chooses them, the scheduler plans with its choice."""

from __future__ import annotations

from common.config import (
    CPU_MAX_NUM_BATCHED_TOKENS,
    CPU_MAX_NUM_SEQS,
    GPU_MAX_NUM_BATCHED_TOKENS,
    GPU_MAX_NUM_SEQS,
    EngineConfig,
    with_batch_limits,
)
from gpu_worker.kv_sizing import requests_held
from offline import LLM


def limits(config: EngineConfig) -> tuple[int | None, int | None]:
    return config.max_num_seqs, config.max_num_batched_tokens


def test_a_cpu_takes_the_small_limits():
    assert limits(with_batch_limits(EngineConfig(), on_gpu=False)) == (CPU_MAX_NUM_SEQS, CPU_MAX_NUM_BATCHED_TOKENS)


def test_a_gpu_seats_more_requests_only_where_the_kv_store_holds_them():
    big = with_batch_limits(EngineConfig(), on_gpu=True, requests_the_kv_store_holds=GPU_MAX_NUM_SEQS)
    small = with_batch_limits(EngineConfig(), on_gpu=True, requests_the_kv_store_holds=GPU_MAX_NUM_SEQS - 1)
    assert limits(big) == (GPU_MAX_NUM_SEQS, GPU_MAX_NUM_BATCHED_TOKENS)
    assert limits(small) == (CPU_MAX_NUM_SEQS, GPU_MAX_NUM_BATCHED_TOKENS)


def test_flags_given_are_kept():
    config = EngineConfig(max_num_seqs=3, max_num_batched_tokens=64)
    assert limits(with_batch_limits(config, on_gpu=True, requests_the_kv_store_holds=10_000)) == (3, 64)


def test_requests_held_counts_typical_requests_or_whole_contexts():
    assert requests_held(num_blocks=128 * 10, max_model_len=8192, block_size=16) == 10  # 2,048 tokens each
    assert requests_held(num_blocks=64 * 10, max_model_len=1024, block_size=16) == 10  # the context is shorter


def test_the_offline_engine_plans_with_the_runners_limits(tiny_gpt2):
    llm = LLM(str(tiny_gpt2), device="cpu", dtype="float32")
    assert limits(llm.config) == (CPU_MAX_NUM_SEQS, CPU_MAX_NUM_BATCHED_TOKENS)
    assert (llm.scheduler.max_num_seqs, llm.scheduler.max_num_batched_tokens) == limits(llm.config)
