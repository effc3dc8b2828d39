"""Runs step plans: keeps a mirror of each running request, builds the flat token batch, runs the model
and samples. It allocates no block and makes no decision; every choice arrives in the plan.

A step is launched, then finished:

    launch(plan N):  drop released mirrors, add new ones, extend block tables; order the
                     chunks (multi-token first); inputs, positions, slots; forward (a CUDA graph for
                     decode-only steps); sample; start copying the tokens to the host   -- no waiting
    finish(N):       wait for N's tokens; append them to the mirrors; StepResult in plan order

Launching N+1 before finishing N keeps the GPU busy while the host prepares the next step. N+1 may then
compute a token that N sampled and the host has not seen yet: each mirror owns a slot in a device
tensor holding its last sampled token, and such inputs are gathered from there on the device.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np
import torch

from common.config import EngineConfig
from common.messages import NewRequestSpec, StepPlan, StepResult, StepTimings
from common.model_info import ModelInfo
from common.pipeline import max_live_mirrors
from gpu_worker.attention import BatchLayout, make_attention_backend, resolve_attention_backend
from gpu_worker.cuda_graphs import DecodeGraphs
from gpu_worker.host_copy import StagingRing
from gpu_worker.kv_cache import PagedKVCache
from gpu_worker.kv_sizing import size_kv_store
from gpu_worker.model_loader import load_model, resolve_dtype
from gpu_worker.models.forward_context import ForwardContext
from gpu_worker.sampler import SamplingBatch, sample
from gpu_worker.warm_up import WARM_UP_REQUESTS


@dataclass(slots=True)
class RequestMirror:
    """The worker's copy of a running request: its tokens so far and its block table."""

    token_ids: list[int]  # prompt and the sampled tokens read back so far
    block_table: list[int]
    temperature: float
    top_k: int
    top_p: float
    seed: int
    num_sampled: int  # samples launched, including one whose token may not be read back yet
    slot: int  # its row in ModelRunner.last_tokens


@dataclass(slots=True)
class LaunchedStep:
    """A step whose forward and sampling are queued on the device, its tokens on their way to the host."""

    step_id: int
    rids: list[int]  # requests that sample, in the order of `tokens`
    mirrors: list[RequestMirror]  # theirs, same order (kept even if a later plan drops them)
    plan_order: list[int]  # positions in `rids` of the plan's order of those requests
    tokens: torch.Tensor | None  # host tensor the sampled ids are copied into
    copied: torch.cuda.Event | None
    prepare_s: float
    forward_s: float


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    return torch.device(name)


class ModelRunner:
    """Loads the model, allocates the KV store (sized by kv_sizing.py) and runs plans. Its owners (the worker
    process, LLM) warm it up with warm_up.py before the first request."""

    def __init__(self, config: EngineConfig, info: ModelInfo, progress: bool = False):
        self.config = config
        self.info = info
        self.device = resolve_device(config.device)
        self.dtype = resolve_dtype(config.dtype, self.device)
        self.block_size = config.block_size
        # The Triton path is the whole forward: attention kernels and the models' fused elementwise ones;
        # the torch path is the reference throughout.
        backend = resolve_attention_backend(config.attention_backend, self.device.type)
        self.attention = make_attention_backend(backend, self.device.type, config.block_size)
        self.model = load_model(
            config.model,
            config.load_format,
            self.dtype,
            self.device,
            config.seed,
            progress,
            fused_kernels=backend == "triton",
        )
        num_layers, kv_heads, head_dim = self.model.kv_shape
        self.num_kv_blocks = config.num_kv_blocks or size_kv_store(
            config, info, self.model, self.attention, self.device, self.dtype
        )
        # One block more than the scheduler is told of: a scratch block for CUDA-graph padding rows.
        self.kv_cache = PagedKVCache(
            num_layers, self.num_kv_blocks + 1, config.block_size, kv_heads, head_dim, self.dtype, self.device
        )
        self.graphs: DecodeGraphs | None = None
        if self.device.type == "cuda" and self.attention.supports_cuda_graphs and not config.enforce_eager:
            self.graphs = DecodeGraphs(
                self.model,
                self.attention,
                self.kv_cache,
                config.max_num_seqs,
                info.max_model_len,
                scratch_block=self.num_kv_blocks,
            )
        self.mirrors: dict[int, RequestMirror] = {}
        # Per-step inputs: ids and positions (8 bytes each per token), metadata (block tables dominate).
        max_tokens = config.max_num_batched_tokens + config.max_num_seqs
        table_width = -(-info.max_model_len // config.block_size)
        self.staging = StagingRing(self.device, 32 * max_tokens + 8 * config.max_num_seqs * (table_width + 16) + 2**16)
        # Last sampled token of each mirror, on the device. A released slot may be reused at once: the
        # device runs steps in order, so the old owner's last write lands before the new owner's.
        num_slots = max(max_live_mirrors(config.max_num_seqs), WARM_UP_REQUESTS)
        self.last_tokens = torch.zeros(num_slots, dtype=torch.long, device=self.device)
        self._free_slots = list(range(num_slots - 1, -1, -1))

    # ------------------------------------------------------------------ the step

    @property
    def launches_async(self) -> bool:
        """Whether launch() returns before the step is computed. On a CPU it computes everything, so
        launching the next step before finishing this one would only hold this one's tokens back."""
        return self.device.type == "cuda"

    def execute(self, plan: StepPlan) -> StepResult:
        """Launch and finish one step (no overlap)."""
        return self.finish(self.launch(plan))

    @torch.inference_mode()
    def launch(self, plan: StepPlan) -> LaunchedStep:
        t0 = time.perf_counter()
        for rid in plan.released:
            mirror = self.mirrors.pop(rid, None)
            if mirror is not None:
                self._free_slots.append(mirror.slot)
        for spec in plan.new_requests:
            self.mirrors[spec.rid] = self._mirror_for(spec)
        for chunk in plan.chunks:
            self.mirrors[chunk.rid].block_table.extend(chunk.new_block_ids)
        if not plan.chunks:
            return LaunchedStep(plan.step_id, [], [], [], None, None, time.perf_counter() - t0, 0.0)

        # Multi-token chunks first, single-token chunks last (the attention backend's layout).
        chunks = sorted(plan.chunks, key=lambda c: c.num_tokens == 1)
        mirrors = [self.mirrors[c.rid] for c in chunks]
        q_lens = [c.num_tokens for c in chunks]
        input_ids, pending_rows, pending_slots = self._input_ids(chunks, mirrors, sum(q_lens))
        positions = np.concatenate([np.arange(c.start, c.start + c.num_tokens) for c in chunks])
        layout = BatchLayout.build(
            q_lens, [c.start + c.num_tokens for c in chunks], [m.block_table for m in mirrors], self.block_size
        )
        slot_mapping = layout.slot_mapping(positions, self.block_size)
        sampling_rows = [i for i, c in enumerate(chunks) if c.sample]
        staging = self.staging
        staging.next_step()
        # (rows, token ids) of the inputs only the device knows: gathered from the last-token slots.
        device_inputs = (
            None
            if not pending_rows
            else (staging.upload(pending_rows, torch.long), self.last_tokens[staging.upload(pending_slots, torch.long)])
        )
        t1 = time.perf_counter()

        if len(input_ids) == len(chunks) and self.graphs is not None and self.graphs.bucket_for(len(chunks)):
            logits = self.graphs.run(input_ids, positions, slot_mapping, layout, device_inputs)
            if len(sampling_rows) < len(chunks):
                logits = logits[staging.upload(sampling_rows, torch.long)]
        else:
            logits = self._forward_eager(input_ids, positions, slot_mapping, layout, sampling_rows, device_inputs)
        sampled = [mirrors[i] for i in sampling_rows]
        tokens = copied = None
        if sampled:
            rows = [(m.temperature, m.top_k, m.top_p, m.seed, m.num_sampled) for m in sampled]
            drawn = sample(logits, SamplingBatch.build(rows, logits.shape[1], staging.upload))
            slots = staging.upload([m.slot for m in sampled], torch.long)
            self.last_tokens.index_copy_(0, slots, drawn)
            for m in sampled:
                m.num_sampled += 1
            tokens, copied = self._copy_to_host(drawn)
        rids = [chunks[i].rid for i in sampling_rows]
        index = {rid: k for k, rid in enumerate(rids)}
        plan_order = [index[c.rid] for c in plan.chunks if c.rid in index]
        return LaunchedStep(plan.step_id, rids, sampled, plan_order, tokens, copied, t1 - t0, time.perf_counter() - t1)

    def finish(self, step: LaunchedStep) -> StepResult:
        """Wait for a launched step's tokens and record them."""
        t0 = time.perf_counter()
        token_ids: list[int] = []
        if step.tokens is not None:
            if step.copied is not None:
                step.copied.synchronize()
            token_ids = step.tokens.tolist()
            for mirror, token in zip(step.mirrors, token_ids):
                mirror.token_ids.append(token)
        sampled_time = time.time()
        # Results in plan order: the scheduler hands out first tokens in the order it admitted requests.
        return StepResult(
            step.step_id,
            [step.rids[k] for k in step.plan_order],
            [token_ids[k] for k in step.plan_order],
            sampled_time,
            StepTimings(prepare_s=step.prepare_s, forward_s=step.forward_s, sample_s=time.perf_counter() - t0),
        )

    def _input_ids(self, chunks, mirrors, num_tokens: int) -> tuple[np.ndarray, list[int], list[int]]:
        """Token ids of every computed position. A position the host does not know yet is the token the
        previous step sampled: left 0 here, listed as (row, mirror slot) to be gathered on the device."""
        ids = np.zeros(num_tokens, dtype=np.int64)
        pending_rows, pending_slots = [], []
        row = 0
        for chunk, mirror in zip(chunks, mirrors):
            known = mirror.token_ids
            end = chunk.start + chunk.num_tokens
            if end <= len(known):
                ids[row : row + chunk.num_tokens] = known[chunk.start : end]
            else:
                if end != len(known) + 1:
                    raise ValueError(f"request {chunk.rid}: position {end - 1} is more than one step ahead")
                ids[row : row + chunk.num_tokens - 1] = known[chunk.start :]
                pending_rows.append(row + chunk.num_tokens - 1)
                pending_slots.append(mirror.slot)
            row += chunk.num_tokens
        return ids, pending_rows, pending_slots

    def _copy_to_host(self, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.cuda.Event | None]:
        if self.device.type != "cuda":
            return tokens, None
        host = torch.empty(tokens.shape, dtype=tokens.dtype, pin_memory=True)
        host.copy_(tokens, non_blocking=True)
        event = torch.cuda.Event()
        event.record()
        return host, event

    def _forward_eager(
        self,
        input_ids: np.ndarray,
        positions: np.ndarray,
        slot_mapping: np.ndarray,
        layout: BatchLayout,
        sampling_rows: list[int],
        device_inputs: tuple[torch.Tensor, torch.Tensor] | None,
    ) -> torch.Tensor:
        """Run the model op by op; returns the logits of the sampling rows."""
        ctx = ForwardContext(
            self.attention, self.attention.build_metadata(layout, slot_mapping, self.staging.upload), self.kv_cache
        )
        ids = self.staging.upload(input_ids, torch.long)
        if device_inputs is not None:
            ids[device_inputs[0]] = device_inputs[1]
        hidden = self.model(ids, self.staging.upload(positions, torch.long), ctx)
        if not sampling_rows:
            return hidden.new_empty(0, 0)
        ends = np.cumsum(layout.query_lens) - 1
        return self.model.compute_logits(hidden[self.staging.upload(ends[sampling_rows], torch.long)])

    def _mirror_for(self, spec: NewRequestSpec) -> RequestMirror:
        s = spec.sampling
        if s.seed is None:
            raise ValueError(f"request {spec.rid} arrived without a seed; the scheduler assigns one")
        if not self._free_slots:
            raise RuntimeError("more live requests than --max-num-seqs allows (seated plus finishing)")
        return RequestMirror(
            list(spec.token_ids), [], s.temperature, s.top_k, s.top_p, s.seed, spec.num_sampled, self._free_slots.pop()
        )
