"""How many KV blocks the worker allocates when --num-kv-blocks does not say.

CUDA:  (total memory x --gpu-memory-utilization - peak of a forward at the largest step
        - that forward's activations once more where CUDA graphs are captured: their pool holds as much) / block bytes
CPU:   --cpu-kv-cache-gib / block bytes
A block's bytes are in the store's dtype (--kv-cache-dtype fp8: one byte an element, twice bfloat16's blocks).
and never more than the most seats (gpu_worker/limits.py: most_seats) at full context could use. On a GPU, the
default number of seats is then chosen by how many requests of a typical length the store holds (decide_limits).
"""

from __future__ import annotations

import torch

from common.config import EngineConfig
from common.model_info import ModelInfo
from gpu_worker.attention import AttentionBackend
from gpu_worker.kv_cache import PagedKVCache
from gpu_worker.probe_forward import probe_forward


def size_kv_store(
    config: EngineConfig,
    info: ModelInfo,
    model: torch.nn.Module,
    attention: AttentionBackend,
    device: torch.device,
    kv_dtype: torch.dtype,
    kv_scales: list[tuple[float, float]] | None,
    max_seqs: int,
    max_prompt_tokens: int,
    captures_graphs: bool = False,
) -> int:
    """kv_dtype, kv_scales: what the store will hold (kv_cache.py); max_seqs, max_prompt_tokens: the most seats and
    the prompt budget a step may have; captures_graphs: CUDA graphs will be captured after the store is allocated
    (the mixed graphs' largest bucket is a step of the whole prompt budget, whose activations their memory pool
    keeps)."""
    num_layers, kv_heads, head_dim = model.kv_shape
    per_block = PagedKVCache.bytes_per_block(num_layers, config.block_size, kv_heads, head_dim, kv_dtype)
    useful = max_seqs * -(-info.max_model_len // config.block_size)
    if device.type == "cuda":
        budget = _cuda_budget_bytes(
            config, info, model, attention, kv_dtype, kv_scales, device, max_seqs, max_prompt_tokens, captures_graphs
        )
    else:
        budget = int(config.cpu_kv_cache_gib * 2**30)
    blocks = min(useful, budget // per_block)
    if blocks < 1:
        raise RuntimeError(
            "no memory left for the KV store; lower --max-num-batched-tokens or raise --gpu-memory-utilization"
        )
    return blocks


def _cuda_budget_bytes(
    config: EngineConfig,
    info: ModelInfo,
    model: torch.nn.Module,
    attention: AttentionBackend,
    kv_dtype: torch.dtype,
    kv_scales: list[tuple[float, float]] | None,
    device: torch.device,
    max_seqs: int,
    max_prompt_tokens: int,
    captures_graphs: bool,
) -> int:
    """Free memory after a forward at the largest step size (reading and writing a store like the real one: the
    torch backend's dequantized keys are activations too), times --gpu-memory-utilization."""
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)
    before = torch.cuda.memory_allocated(device)
    block_size = config.block_size
    tokens = min(max_prompt_tokens, info.max_model_len)
    num_layers, kv_heads, head_dim = model.kv_shape
    blocks = -(-tokens // block_size)
    probe_cache = PagedKVCache(num_layers, blocks, block_size, kv_heads, head_dim, kv_dtype, device, kv_scales)
    hidden = probe_forward(model, attention, probe_cache, torch.zeros(tokens, dtype=torch.long, device=device))
    model.compute_logits(hidden[-min(tokens, max_seqs) :])
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device)
    del probe_cache, hidden
    torch.cuda.empty_cache()
    total = torch.cuda.get_device_properties(device).total_memory
    graph_pool = peak - before if captures_graphs else 0
    return int(total * config.gpu_memory_utilization) - peak - graph_pool
