"""Batch limits left to the device: the GPU worker decides them, the scheduler plans with its decision."""

from __future__ import annotations

from common.config import (
    CPU_MAX_NUM_BATCHED_TOKENS,
    CPU_MAX_NUM_SEQS,
    GPU_MAX_NUM_BATCHED_TOKENS,
    GPU_MAX_NUM_SEQS,
    EngineConfig,
)
from common.messages import WorkerLimits
from common.model_info import ModelInfo
from gpu_worker.limits import decide_limits, requests_held
from offline import LLM

INFO = ModelInfo("llama", 8192, [0], 64)
BLOCKS_PER_REQUEST = 2048 // 16  # of a typical length (GPU_TYPICAL_REQUEST_TOKENS), blocks of 16 tokens


def limits(limits: WorkerLimits) -> tuple[int, int]:
    return limits.max_num_seqs, limits.max_num_batched_tokens


def test_a_cpu_takes_the_small_limits():
    decided = decide_limits(EngineConfig(), INFO, on_gpu=False, num_kv_blocks=10**6)
    assert limits(decided) == (CPU_MAX_NUM_SEQS, CPU_MAX_NUM_BATCHED_TOKENS)


def test_a_gpu_seats_more_requests_only_where_the_kv_store_holds_them():
    big = decide_limits(EngineConfig(), INFO, on_gpu=True, num_kv_blocks=GPU_MAX_NUM_SEQS * BLOCKS_PER_REQUEST)
    small = decide_limits(EngineConfig(), INFO, on_gpu=True, num_kv_blocks=GPU_MAX_NUM_SEQS * BLOCKS_PER_REQUEST - 1)
    assert limits(big) == (GPU_MAX_NUM_SEQS, GPU_MAX_NUM_BATCHED_TOKENS)
    assert limits(small) == (CPU_MAX_NUM_SEQS, GPU_MAX_NUM_BATCHED_TOKENS)


def test_flags_given_are_kept():
    config = EngineConfig(max_num_seqs=3, max_num_batched_tokens=64)
    assert limits(decide_limits(config, INFO, on_gpu=True, num_kv_blocks=10**6)) == (3, 64)


def test_a_server_on_a_gpu_adapts_its_prompt_budget_unless_given_a_number_and_a_cpu_only_when_asked():
    def adaptive(on_gpu: bool, **flags) -> bool:
        return decide_limits(EngineConfig(**flags), INFO, on_gpu=on_gpu, num_kv_blocks=10**6).adaptive_prefill_budget

    assert adaptive(on_gpu=True) and adaptive(on_gpu=True, max_num_batched_tokens="auto")
    assert not adaptive(on_gpu=True, max_num_batched_tokens=4096)
    assert not adaptive(on_gpu=False) and adaptive(on_gpu=False, max_num_batched_tokens="auto")


def test_the_offline_engine_keeps_a_fixed_prompt_budget_unless_asked(tiny_gpt2):
    """In process, throughput first (a burst's prompts in as few steps as the ceiling allows)."""
    assert LLM(str(tiny_gpt2), device="cpu", dtype="float32").config.adaptive_prefill_budget is False
    auto = LLM(str(tiny_gpt2), device="cpu", dtype="float32", max_num_batched_tokens="auto")
    assert auto.runner.limits.adaptive_prefill_budget and auto.scheduler.prefill_budget.target_s is not None


def test_the_context_is_what_the_kv_store_holds_where_that_is_less():
    assert decide_limits(EngineConfig(block_size=16), INFO, on_gpu=False, num_kv_blocks=10).max_model_len == 160
    assert decide_limits(EngineConfig(block_size=16), INFO, on_gpu=False, num_kv_blocks=10**6).max_model_len == 8192


def test_requests_held_counts_typical_requests_or_whole_contexts():
    assert requests_held(num_blocks=128 * 10, max_model_len=8192, block_size=16) == 10  # 2,048 tokens each
    assert requests_held(num_blocks=64 * 10, max_model_len=1024, block_size=16) == 10  # the context is shorter


def test_the_offline_engine_plans_with_the_runners_limits(tiny_gpt2):
    llm = LLM(str(tiny_gpt2), device="cpu", dtype="float32")
    assert limits(llm.runner.limits) == (CPU_MAX_NUM_SEQS, CPU_MAX_NUM_BATCHED_TOKENS)
    assert (llm.scheduler.max_num_seqs, llm.scheduler.max_num_batched_tokens) == limits(llm.runner.limits)
    assert llm.config.max_num_seqs is None, "the flags stay as given: the worker's decision is in its limits"
