"""Runs step plans: keeps a mirror of each running request, builds the flat token batch, runs the model
and samples. It allocates no block and makes no decision; every choice arrives in the plan.

    plan ──▶ drop released mirrors ─▶ add new mirrors ─▶ extend block tables ─▶ copy blocks
         ──▶ order chunks (multi-token first, single-token last) ─▶ inputs, positions, slots
         ──▶ forward ─▶ logits of sampling rows only ─▶ sample ─▶ StepResult (plan order)
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np
import torch

from common.config import EngineConfig
from common.messages import NewRequestSpec, StepPlan, StepResult, StepTimings
from common.model_info import ModelInfo
from gpu_worker.attention import BatchLayout, make_attention_backend
from gpu_worker.kv_cache import PagedKVCache
from gpu_worker.model_loader import load_model, resolve_dtype
from gpu_worker.models.forward_context import ForwardContext
from gpu_worker.sampler import SamplingBatch, sample


@dataclass(slots=True)
class RequestMirror:
    """The worker's copy of a running request: its tokens so far and its block table."""

    token_ids: list[int]
    block_table: list[int]
    temperature: float
    top_k: int
    top_p: float
    seed: int
    num_sampled: int


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    return torch.device(name)


class ModelRunner:
    def __init__(self, config: EngineConfig, info: ModelInfo, progress: bool = False):
        self.config = config
        self.info = info
        self.device = resolve_device(config.device)
        self.dtype = resolve_dtype(config.dtype, self.device)
        self.block_size = config.block_size
        self.model = load_model(config.model, config.load_format, self.dtype, self.device, config.seed, progress)
        self.attention = make_attention_backend(config.attention_backend, self.device.type, config.block_size)
        num_layers, kv_heads, head_dim = self.model.kv_shape
        self.kv_cache = PagedKVCache(num_layers, self._num_kv_blocks(), config.block_size, kv_heads, head_dim,
                                     self.dtype, self.device)
        self.mirrors: dict[int, RequestMirror] = {}

    @property
    def num_kv_blocks(self) -> int:
        return self.kv_cache.num_blocks

    def _num_kv_blocks(self) -> int:
        cfg = self.config
        if cfg.num_kv_blocks:
            return cfg.num_kv_blocks
        num_layers, kv_heads, head_dim = self.model.kv_shape
        per_block = PagedKVCache.bytes_per_block(num_layers, cfg.block_size, kv_heads, head_dim, self.dtype)
        # Never more than every running request at full context could use.
        useful = cfg.max_num_seqs * -(-self.info.max_model_len // cfg.block_size)
        if self.device.type == "cuda":
            budget = self._cuda_kv_budget_bytes()
        else:
            budget = int(cfg.cpu_kv_cache_gib * 2**30)
        blocks = min(useful, budget // per_block)
        if blocks < 1:
            raise RuntimeError("no memory left for the KV store; lower --max-num-batched-tokens or raise "
                               "--gpu-memory-utilization")
        return blocks

    def _cuda_kv_budget_bytes(self) -> int:
        """Free memory after a forward at the largest step size, times --gpu-memory-utilization."""
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(self.device)
        tokens = min(self.config.max_num_batched_tokens, self.info.max_model_len)
        num_layers, kv_heads, head_dim = self.model.kv_shape
        blocks = -(-tokens // self.block_size)
        probe_cache = PagedKVCache(num_layers, blocks, self.block_size, kv_heads, head_dim, self.dtype, self.device)
        layout = BatchLayout([tokens], [tokens], [list(range(blocks))], 1)
        slots = torch.arange(tokens)
        ctx = ForwardContext(self.attention, self.attention.build_metadata(layout, slots, self.device), probe_cache)
        ids = torch.zeros(tokens, dtype=torch.long, device=self.device)
        hidden = self.model(ids, slots.to(self.device), ctx)
        self.model.compute_logits(hidden[-min(tokens, self.config.max_num_seqs):])
        torch.cuda.synchronize(self.device)
        peak = torch.cuda.max_memory_allocated(self.device)
        del probe_cache, ctx, hidden
        torch.cuda.empty_cache()
        total = torch.cuda.get_device_properties(self.device).total_memory
        return int(total * self.config.gpu_memory_utilization) - peak

    # ------------------------------------------------------------------ the step

    @torch.inference_mode()
    def execute(self, plan: StepPlan) -> StepResult:
        t0 = time.perf_counter()
        for rid in plan.released:
            self.mirrors.pop(rid, None)
        for spec in plan.new_requests:
            self.mirrors[spec.rid] = self._mirror_for(spec)
        for chunk in plan.chunks:
            self.mirrors[chunk.rid].block_table.extend(chunk.new_block_ids)
        self.kv_cache.copy_blocks(plan.block_copies)
        if not plan.chunks:
            return StepResult(plan.step_id, [], [], time.time(), StepTimings())

        # Multi-token chunks first, single-token chunks last (the attention backend's layout).
        chunks = sorted(plan.chunks, key=lambda c: c.num_tokens == 1)
        mirrors = [self.mirrors[c.rid] for c in chunks]
        q_lens = [c.num_tokens for c in chunks]
        input_ids = np.fromiter(
            (t for c, m in zip(chunks, mirrors) for t in m.token_ids[c.start:c.start + c.num_tokens]),
            dtype=np.int64, count=sum(q_lens))
        positions = np.concatenate([np.arange(c.start, c.start + c.num_tokens) for c in chunks])
        seq_index = np.repeat(np.arange(len(chunks)), q_lens)
        max_blocks = max(len(m.block_table) for m in mirrors)
        tables = np.zeros((len(chunks), max_blocks), dtype=np.int64)
        for i, m in enumerate(mirrors):
            tables[i, :len(m.block_table)] = m.block_table
        slot_mapping = tables[seq_index, positions // self.block_size] * self.block_size + positions % self.block_size
        layout = BatchLayout(
            query_lens=q_lens,
            context_lens=[c.start + c.num_tokens for c in chunks],
            block_tables=[m.block_table for m in mirrors],
            num_prefill_seqs=sum(1 for n in q_lens if n > 1),
        )
        ends = np.cumsum(q_lens) - 1
        sampling_rows = [i for i, c in enumerate(chunks) if c.sample]
        device = self.device
        ctx = ForwardContext(self.attention,
                             self.attention.build_metadata(layout, torch.from_numpy(slot_mapping), device),
                             self.kv_cache)
        ids_t = torch.from_numpy(input_ids).to(device, non_blocking=True)
        pos_t = torch.from_numpy(positions).to(device, non_blocking=True)
        t1 = time.perf_counter()

        hidden = self.model(ids_t, pos_t, ctx)
        tokens: list[int] = []
        if sampling_rows:
            logits = self.model.compute_logits(hidden[torch.from_numpy(ends[sampling_rows]).to(device)])
            t2 = time.perf_counter()
            rows = [(m.temperature, m.top_k, m.top_p, m.seed, m.num_sampled)
                    for m in (mirrors[i] for i in sampling_rows)]
            tokens = sample(logits, SamplingBatch.build(rows, logits.shape[1], device)).tolist()
        else:
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            t2 = time.perf_counter()
        sampled_time = time.time()
        t3 = time.perf_counter()

        by_rid = {}
        for i, token in zip(sampling_rows, tokens):
            mirror = mirrors[i]
            mirror.token_ids.append(token)
            mirror.num_sampled += 1
            by_rid[chunks[i].rid] = token
        rids = [c.rid for c in plan.chunks if c.rid in by_rid]
        return StepResult(plan.step_id, rids, [by_rid[r] for r in rids], sampled_time,
                          StepTimings(prepare_s=t1 - t0, forward_s=t2 - t1, sample_s=t3 - t2))

    def _mirror_for(self, spec: NewRequestSpec) -> RequestMirror:
        s = spec.sampling
        if s.seed is None:
            raise ValueError(f"request {spec.rid} arrived without a seed; the scheduler assigns one")
        return RequestMirror(list(spec.token_ids), [], s.temperature, s.top_k, s.top_p, s.seed, spec.num_sampled)
