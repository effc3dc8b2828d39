"""The limits a GPU worker decides for its device where the flags leave them open: the one place their defaults
are filled in. The worker announces them (common/messages.py: WorkerReady); the scheduler plans with them, the
launcher and LLM report them, and none of them fills in a default of its own.

    prompt budget   --max-num-batched-tokens, else GPU_MAX_NUM_BATCHED_TOKENS on a GPU, CPU_... on a CPU;
                    adaptive below it (--max-num-batched-tokens auto) where asked, else on a GPU unless a number
                    was given: a step of 16k prompt tokens of an 8B model holds every decode in it ~300 ms (an
                    H100 burst's ITL p99 323 ms fixed, 53 ms adaptive; docs/benchmarks.md)
    seats           --max-num-seqs, else GPU_MAX_NUM_SEQS on a GPU whose KV store holds that many requests of
                    GPU_TYPICAL_REQUEST_TOKENS, else CPU_MAX_NUM_SEQS                       (common/config.py)
    context         the model's (or --max-model-len), within what the KV store holds: a request must fit alone

The KV store is sized before the seats are decided, for the most seats they can be (most_seats).
"""

from __future__ import annotations

from common.config import (
    CPU_MAX_NUM_BATCHED_TOKENS,
    CPU_MAX_NUM_SEQS,
    GPU_MAX_NUM_BATCHED_TOKENS,
    GPU_MAX_NUM_SEQS,
    GPU_TYPICAL_REQUEST_TOKENS,
    EngineConfig,
)
from common.messages import WorkerLimits
from common.model_info import ModelInfo


def prompt_budget(config: EngineConfig, on_gpu: bool) -> int:
    if config.max_num_batched_tokens is not None:
        return config.max_num_batched_tokens
    return GPU_MAX_NUM_BATCHED_TOKENS if on_gpu else CPU_MAX_NUM_BATCHED_TOKENS


def most_seats(config: EngineConfig, on_gpu: bool) -> int:
    """The most seats decide_limits can grant: the flag, or the device's largest default."""
    if config.max_num_seqs is not None:
        return config.max_num_seqs
    return GPU_MAX_NUM_SEQS if on_gpu else CPU_MAX_NUM_SEQS


def requests_held(num_blocks: int, max_model_len: int, block_size: int) -> int:
    """How many requests of a typical length (GPU_TYPICAL_REQUEST_TOKENS, or the context if shorter) fit in
    num_blocks: what the default seats on a GPU are chosen by."""
    tokens = min(max_model_len, GPU_TYPICAL_REQUEST_TOKENS)
    return num_blocks // -(-tokens // block_size)


def decide_limits(config: EngineConfig, info: ModelInfo, on_gpu: bool, num_kv_blocks: int) -> WorkerLimits:
    """The limits of a worker on this device (a GPU, or not) whose KV store has num_kv_blocks."""
    seats = config.max_num_seqs
    if seats is None:
        holds = requests_held(num_kv_blocks, info.max_model_len, config.block_size)
        seats = GPU_MAX_NUM_SEQS if on_gpu and holds >= GPU_MAX_NUM_SEQS else CPU_MAX_NUM_SEQS
    adaptive = on_gpu if config.adaptive_prefill_budget is None else config.adaptive_prefill_budget
    return WorkerLimits(
        num_kv_blocks,
        seats,
        prompt_budget(config, on_gpu),
        min(info.max_model_len, num_kv_blocks * config.block_size),
        adaptive,
    )
