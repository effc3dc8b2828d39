"""Runs step plans: keeps a mirror of each running request, builds the flat token batch, runs the model
and samples. It allocates no block and makes no decision; every choice arrives in the plan.

A step is launched, then finished:

    launch(plan N):  drop released mirrors, add new ones, extend block tables; order the
                     chunks (multi-token first); inputs, positions, slots; forward (a CUDA graph: a
                     decode graph by batch size, a mixed one by token count; eager for prompt logprobs);
                     sample; start copying the tokens to the host                        -- no waiting
    finish(N):       wait for N's tokens; append them to the mirrors; StepResult in plan order

Launching N+1 before finishing N keeps the GPU busy while the host prepares the next step. N+1 may then
compute a token that N sampled and the host has not seen yet: each mirror owns a slot in a device
tensor holding its last sampled token, and such inputs are gathered from there on the device.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

import numpy as np
import torch

from common.config import EngineConfig, with_batch_limits
from common.messages import (
    Logprobs,
    NewRequestSpec,
    RequestLogprobs,
    StepPlan,
    StepResult,
    StepTimings,
)
from common.model_info import ModelInfo
from common.pipeline import host_ring_size, max_live_mirrors
from common.sampling_params import MAX_LOGIT_BIAS, MAX_STOP_TOKEN_IDS, SamplingParams
from common.startup import PhaseClock
from gpu_worker.attention import BatchLayout, make_attention_backend, resolve_attention_backend
from gpu_worker.cuda_graphs import DecodeGraphs
from gpu_worker.host_copy import StagingRing
from gpu_worker.input_batch import PersistentBatch, StepInputs, eager_bucket, pad_batch
from gpu_worker.kv_cache import PagedKVCache
from gpu_worker.kv_sizing import requests_held, size_kv_store
from gpu_worker.model_loader import load_model, resolve_dtype
from gpu_worker.models.forward_context import ForwardContext
from gpu_worker.parallel import SINGLE, TensorParallel
from gpu_worker.sampler import SampledLogprobs, SamplingRows, process_logits, sample, sampled_logprobs
from gpu_worker.token_counts import TokenCounts
from gpu_worker.warm_up import WARM_UP_REQUESTS

if TYPE_CHECKING:
    from gpu_worker.mixed_graphs import MixedGraphs

PROMPT_LOGPROBS_ROWS = 256  # prompt positions whose logits are made at once (bounds that memory)


@dataclass(slots=True)
class RequestMirror:
    """The worker's copy of a running request: its tokens so far and its block table."""

    token_ids: list[int]  # prompt and the sampled tokens read back so far
    sampling: SamplingParams
    slot: int  # its row in ModelRunner.last_tokens (and in the token counts, for penalties)
    # Prompt positions [1, prompt_logprobs_end) still get their logprobs computed: the prompt's length
    # when the request asked for them and arrives fresh (a resumed one has sent them already), else 0.
    prompt_logprobs_end: int = 0


@dataclass(slots=True)
class LaunchedStep:
    """A step whose forward and sampling are queued on the device, its tokens on their way to the host."""

    step_id: int
    rids: list[int]  # requests that sample, in the order of `tokens`
    mirrors: list[RequestMirror]  # theirs, same order (kept even if a later plan drops them)
    plan_order: list[int] | None  # positions in `rids` of the plan's order of those requests; None: in order
    tokens: torch.Tensor | None  # host tensor the sampled ids are copied into
    copied: torch.cuda.Event | None
    prepare_s: float
    forward_s: float
    # Logprobs on their way to the host, for requests that asked: (rid, start, k, tensors) per entry.
    logprobs: list[tuple[int, int, int, list[int], list[torch.Tensor]]] | None = None
    prompt_logprobs: list[tuple[int, int, int, list[int], list[torch.Tensor]]] | None = None


def resolve_device(name: str, index: int = 0) -> torch.device:
    """`index`: which GPU "cuda" means (an engine replica's rank's); a CPU has one device."""
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if name == "cuda":
        visible = torch.cuda.device_count()
        if index >= visible:
            raise RuntimeError(
                f"this GPU worker runs on cuda:{index} (one GPU per engine replica and tensor-parallel rank), "
                f"but {visible} GPU(s) are visible"
            )
        device = torch.device("cuda", index)
        torch.cuda.set_device(device)  # what runs on "the current device" (graph pools, Triton launches) too
        return device
    return torch.device(name)


class ModelRunner:
    """Loads the model, allocates the KV store (sized by kv_sizing.py) and runs plans. Its owners (the worker
    process, LLM) warm it up with warm_up.py before the first request."""

    def __init__(
        self,
        config: EngineConfig,
        info: ModelInfo,
        phases: PhaseClock | None = None,
        tp: TensorParallel = SINGLE,
        device_index: int = 0,
    ):
        """`phases`: log each start-up phase (weights, KV store, CUDA graphs) there, with a progress bar for
        the weights (the server's worker); None: quiet (tests, the offline engine). `tp`: this runner is one
        rank of a tensor-parallel group (gpu_worker/parallel.py): it holds that rank's share of the weights
        and of the KV heads, and runs every plan in step with the other ranks. `device_index`: the GPU to run
        on (an engine replica's rank's own: gpu_worker/process.py)."""
        self.info = info
        self.tp = tp
        self.device = resolve_device(config.device, device_index)
        on_gpu = self.device.type == "cuda"
        # Batch limits left to the device: the prompt budget now, the seats once the KV store is sized.
        seats_from_memory = config.max_num_seqs is None and on_gpu
        self.config = config = with_batch_limits(config, on_gpu)
        self.dtype = resolve_dtype(config.dtype, self.device)
        self.block_size = config.block_size
        # The Triton path is the whole forward: attention kernels and the models' fused elementwise ones;
        # the torch path is the reference throughout.
        backend = resolve_attention_backend(config.attention_backend, self.device.type)
        self.model = load_model(
            config.model,
            config.load_format,
            self.dtype,
            self.device,
            config.seed,
            progress=phases is not None,
            fused_kernels=backend == "triton",
            tp=tp,
            quantization=config.quantization,
        )
        if phases is not None:
            params = sum(p.numel() for p in self.model.parameters())
            what = "random weights" if config.load_format == "dummy" else "weights loaded"
            phases.done(f"{what}: {params / 1e6:.0f}M parameters, {self.dtype} on {self.device}")
        num_layers, kv_heads, head_dim = self.model.kv_shape  # this rank's KV heads
        self.attention = make_attention_backend(backend, self.device, config.block_size, kv_heads)
        captures_graphs = on_gpu and self.attention.supports_cuda_graphs and not config.enforce_eager
        # Every rank must have every block the scheduler hands out: the smallest store of any rank.
        self.num_kv_blocks = tp.min(
            config.num_kv_blocks
            or size_kv_store(config, info, self.model, self.attention, self.device, self.dtype, captures_graphs),
            self.device,
        )
        if seats_from_memory:
            holds = requests_held(self.num_kv_blocks, info.max_model_len, config.block_size)
            self.config = config = with_batch_limits(replace(config, max_num_seqs=None), on_gpu, holds)
        # One block more than the scheduler is told of: a scratch block for CUDA-graph padding rows.
        self.kv_cache = PagedKVCache(
            num_layers, self.num_kv_blocks + 1, config.block_size, kv_heads, head_dim, self.dtype, self.device
        )
        if phases is not None:
            gib = self.kv_cache.data.numel() * self.kv_cache.data.element_size() / 2**30
            phases.done(f"KV store: {self.num_kv_blocks} blocks of {config.block_size} tokens, {gib:.2f} GiB")
        # Last sampled token of each mirror, on the device (the graphs read and write it), and a sink entry past
        # them for the decode graphs' rows that sample nothing. A released slot may be reused at once: the
        # device runs steps in order, so the old owner's last write lands before the new owner's.
        self.num_slots = num_slots = max(max_live_mirrors(config.max_num_seqs), WARM_UP_REQUESTS)
        self.last_tokens = torch.zeros(num_slots + 1, dtype=torch.long, device=self.device)
        self.graphs: DecodeGraphs | None = None
        self.mixed_graphs: MixedGraphs | None = None
        if captures_graphs:
            # Imported only here: it builds on the Triton kernels, which the CPU path never loads.
            from gpu_worker.mixed_graphs import MixedGraphs

            pool = torch.cuda.graph_pool_handle()  # one pool for every graph: they never run at once
            # Largest activations first (a full prompt budget), so the decode graphs reuse their memory.
            self.mixed_graphs = MixedGraphs(
                self.model,
                self.attention,
                self.kv_cache,
                config.max_num_batched_tokens + config.max_num_seqs,
                config.max_num_seqs,
                info.max_model_len,
                scratch_block=self.num_kv_blocks,
                last_tokens=self.last_tokens,
                pool=pool,
            )
            self.graphs = DecodeGraphs(
                self.model,
                self.attention,
                self.kv_cache,
                config.max_num_seqs,
                info.max_model_len,
                scratch_block=self.num_kv_blocks,
                last_tokens=self.last_tokens,
                pool=pool,
            )
            if phases is not None:
                mixed, decode = self.mixed_graphs.buckets, self.graphs.buckets
                phases.done(
                    f"CUDA graphs captured: {len(mixed)} for steps of {mixed[0]}-{mixed[-1]} tokens, "
                    f"{len(decode)} for decode batches of {decode[0]}-{decode[-1]}"
                )
        self.mirrors: dict[int, RequestMirror] = {}
        # Per-step inputs: ids and positions (8 bytes each per token), metadata (block tables dominate).
        max_tokens = config.max_num_batched_tokens + config.max_num_seqs
        table_width = -(-info.max_model_len // config.block_size)
        # Sampling rows add their parameters and bias entries (logit_bias, and min_tokens' masked EOS and stop
        # ids: 20 bytes each), and for structured output a bitmask of the vocabulary. Prompt logprobs add
        # two int64 per prompt token (rows and scored ids).
        num_bias = MAX_LOGIT_BIAS + MAX_STOP_TOKEN_IDS + len(info.eos_token_ids)
        sampling_bytes = config.max_num_seqs * (20 * num_bias + 128 + info.vocab_size // 8 + 16) + 16 * max_tokens
        self.staging = StagingRing(
            self.device, 32 * max_tokens + 8 * config.max_num_seqs * (table_width + 16) + sampling_bytes + 2**16
        )
        self._free_slots = list(range(num_slots - 1, -1, -1))
        # Each slot's block table and sampling parameters, kept between steps (input_batch.py).
        self.batch = PersistentBatch(num_slots, table_width, config.block_size)
        self.sampling_rows = SamplingRows(num_slots, self.model.vocab_size)
        # Eager forwards padded to a few token counts, so cuBLAS meets shapes it has seen (eager_bucket); on a
        # CPU there is nothing to gain.
        self.pad_eager = self.device.type == "cuda"
        self.num_prompt_logprob_mirrors = 0  # mirrors still computing prompt logprobs: their rows are looked for
        self.num_structured_mirrors = 0  # mirrors whose samples are masked (structured output)
        # Samples launched per slot, including one whose token may not be read back yet: the index in its
        # output of the token a request samples next (seeds its draws).
        self.num_sampled = np.zeros(num_slots, dtype=np.int64)
        self.token_counts: TokenCounts | None = None  # made when a request first asks for a penalty
        pinned = self.device.type == "cuda"
        self._token_hosts = [
            torch.empty(num_slots, dtype=torch.long, pin_memory=pinned) for _ in range(host_ring_size())
        ]
        self._token_turn = 0

    # ------------------------------------------------------------------ the step

    @property
    def launches_async(self) -> bool:
        """Whether launch() returns before the step is computed. On a CPU it computes everything, so
        launching the next step before finishing this one would only hold this one's tokens back."""
        return self.device.type == "cuda"

    def release_graphs(self) -> None:
        """Destroy the CUDA graphs; later steps run eagerly. Every rank does this before leaving a tensor-parallel
        group: NCCL's teardown never returns while a graph that captured its collectives still exists
        (pytorch/pytorch#115388)."""
        for owner in (self.graphs, self.mixed_graphs):
            for graph in owner.graphs.values() if owner is not None else ():
                graph.reset()
        self.graphs = self.mixed_graphs = None
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

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
                self.num_prompt_logprob_mirrors -= mirror.prompt_logprobs_end > 0
                self.num_structured_mirrors -= mirror.sampling.structured is not None
        for spec in plan.new_requests:
            self.mirrors[spec.rid] = self._mirror_for(spec)
        mirrors = self.mirrors
        for rid, block_ids in plan.new_block_ids.items():
            self.batch.append_blocks(mirrors[rid].slot, block_ids)
        if not plan.rids:
            return LaunchedStep(plan.step_id, [], [], [], None, None, time.perf_counter() - t0, 0.0)

        step_mirrors = [mirrors[rid] for rid in plan.rids]
        n = len(step_mirrors)
        token_lists = [m.token_ids for m in step_mirrors]
        inputs = self.batch.prepare(
            plan.rids,
            np.array(plan.starts, np.int64),
            np.array(plan.num_tokens, np.int64),
            np.array(plan.samples, bool),
            np.fromiter((m.slot for m in step_mirrors), np.int64, n),
            np.fromiter(map(len, token_lists), np.int64, n),
            token_lists,
        )
        layout_rids, layout = inputs.rids, inputs.layout
        sampling_rows = inputs.sampling_rows.tolist()
        prompt_rows, prompt_targets = self._prompt_logprob_rows(inputs) if self.num_prompt_logprob_mirrors else ([], [])
        staging = self.staging
        staging.next_step()
        t1 = time.perf_counter()

        input_ids, positions, slot_mapping = inputs.input_ids, inputs.positions, inputs.slot_mapping
        decode_only = len(input_ids) == n
        prompt_logprobs = None
        # Inputs only the device knows (tokens sampled by a step whose result is not read yet): a graph gathers
        # them itself from the last-token slots; the eager forward is handed them gathered.
        pending_rows, pending_slots = inputs.pending_rows, inputs.pending_slots
        graph_greedy = None  # the decode graph's greedy tokens of the sampling rows (in their slots already)
        if decode_only and not prompt_rows and self.graphs is not None and self.graphs.bucket_for(n):
            logits, graph_greedy = self.graphs.run(
                input_ids,
                positions,
                slot_mapping,
                layout,
                pending_rows,
                pending_slots,
                inputs.slots,
                inputs.sampling_rows,
            )
            if len(sampling_rows) < n:
                rows = staging.upload(inputs.sampling_rows, torch.long)
                logits, graph_greedy = logits[rows], graph_greedy[rows]
        elif (
            not decode_only
            and not prompt_rows
            and self.mixed_graphs is not None
            and self.mixed_graphs.bucket_for(len(input_ids), n)
        ):
            logits = self.mixed_graphs.run(
                input_ids, positions, slot_mapping, layout, inputs.logit_rows, pending_rows, pending_slots
            )
        else:
            device_inputs = (
                None
                if not len(pending_rows)
                else (
                    staging.upload(pending_rows, torch.long),
                    self.last_tokens[staging.upload(pending_slots, torch.long)],
                )
            )
            logits, prompt_hidden = self._forward_eager(
                input_ids, positions, slot_mapping, layout, inputs.logit_rows, device_inputs, prompt_rows
            )
            if prompt_rows:
                prompt_logprobs = self._prompt_logprobs(prompt_hidden, prompt_targets)
        every_chunk_samples = len(sampling_rows) == n
        if every_chunk_samples and layout_rids is plan.rids:  # a decode step: the plan's order, every request
            sampled = step_mirrors
        else:
            sampled = [mirrors[layout_rids[i]] for i in sampling_rows]
        rids = layout_rids if every_chunk_samples else [layout_rids[i] for i in sampling_rows]
        to_host: list[torch.Tensor] = []
        logprobs = None
        if sampled:
            masks = plan.token_bitmasks
            bitmasks = [masks.get(rid) for rid in rids] if self.num_structured_mirrors else None
            sampled_slots = inputs.slots if every_chunk_samples else inputs.slots[inputs.sampling_rows]
            output_index = self.num_sampled[sampled_slots]
            drawn, sampled_lp = self._sample(logits, sampled_slots, output_index, bitmasks, staging, graph_greedy)
            to_host.append(drawn)
            if sampled_lp is not None:
                to_host += [sampled_lp.sampled, sampled_lp.top_ids, sampled_lp.top_logprobs]
                logprobs = [
                    (rids[row], int(output_index[row]), sampled[row].sampling.logprobs, [], [])
                    for row in sampled_lp.rows
                ]
        if prompt_logprobs is not None:
            to_host += prompt_logprobs
        host, copied = self._copy_to_host(to_host, tokens_first=bool(sampled))
        tokens = host[0] if sampled else None
        if logprobs is not None:
            for k, entry in enumerate(logprobs):
                entry[4].extend(t[k] for t in host[1:4])
        if prompt_logprobs is not None:
            prompt_logprobs = self._split_prompt_logprobs(prompt_targets, host[-3:])
        plan_order = None  # the layout kept the plan's order (every decode step)
        if layout_rids is not plan.rids:
            index = {rid: k for k, rid in enumerate(rids)}
            plan_order = [index[rid] for rid in plan.rids if rid in index]
        return LaunchedStep(
            plan.step_id,
            rids,
            sampled,
            plan_order,
            tokens,
            copied,
            t1 - t0,
            time.perf_counter() - t1,
            logprobs,
            prompt_logprobs,
        )

    def _sample(
        self,
        logits: torch.Tensor,
        slots: np.ndarray,
        output_index: np.ndarray,
        bitmasks: list[bytes | None] | None,
        staging: StagingRing,
        graph_greedy: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, SampledLogprobs | None]:
        """Sample one token per row (the requests in these slots), write it to their last-token slots and
        token counts on the device; output_index: the index in its output of the token each samples.
        graph_greedy: each row's greedy token, already in its slot (a decode graph's): the draw itself when
        every row samples greedily with nothing to apply first."""
        if graph_greedy is not None and bitmasks is None and self.sampling_rows.plain_greedy(slots):
            self.num_sampled[slots] += 1
            return graph_greedy, None
        counts = self.token_counts
        batch = self.sampling_rows.batch(
            slots, output_index, staging.upload, None, counts, self.info.eos_token_ids, bitmasks
        )
        logits = process_logits(logits, batch)
        drawn = sample(logits, batch)
        lp = sampled_logprobs(logits, batch, drawn)
        self.last_tokens.index_copy_(0, staging.upload(slots, torch.long), drawn)
        if batch.penalties is not None:
            counts.add(batch.penalties.slots, drawn[batch.penalties.rows])
        self.num_sampled[slots] += 1
        return drawn, lp

    def _prompt_logprob_rows(self, inputs: StepInputs) -> tuple[list[int], list[tuple[int, int, int, list[int]]]]:
        """Flat token rows whose logits give prompt logprobs (position p's logits score token p + 1),
        and per request (rid, first scored position, k, the scored token ids)."""
        rows: list[int] = []
        targets: list[tuple[int, int, int, list[int]]] = []
        row = 0
        for rid, start, num_tokens in zip(inputs.rids, inputs.starts.tolist(), inputs.layout.query_lens.tolist()):
            mirror = self.mirrors[rid]
            end = min(start + num_tokens, mirror.prompt_logprobs_end - 1)
            if end > start:
                rows.extend(range(row, row + end - start))
                ids = mirror.token_ids[start + 1 : end + 1]
                targets.append((rid, start + 1, mirror.sampling.prompt_logprobs, ids))
            row += num_tokens
        return rows, targets

    def _prompt_logprobs(
        self, hidden: torch.Tensor, targets: list[tuple[int, int, int, list[int]]]
    ) -> list[torch.Tensor]:
        """[rows] logprob of each scored token, [rows, k] top ids and logprobs (k: the step's largest).
        Logits are made PROMPT_LOGPROBS_ROWS rows at a time: a whole prefill's [tokens, vocab] logits
        would need memory the KV store was sized without."""
        ids = self.staging.upload([t for target in targets for t in target[3]], torch.long)
        k = max(target[2] for target in targets)
        parts: list[list[torch.Tensor]] = []
        for start in range(0, len(hidden), PROMPT_LOGPROBS_ROWS):
            end = start + PROMPT_LOGPROBS_ROWS
            logprobs = torch.log_softmax(self.model.compute_logits(hidden[start:end]).float(), dim=-1)
            top = logprobs.topk(k, dim=-1)
            parts.append([logprobs.gather(1, ids[start:end, None])[:, 0], top.indices, top.values])
        return [torch.cat(column) for column in zip(*parts)]

    @staticmethod
    def _split_prompt_logprobs(targets, host: list[torch.Tensor]) -> list[tuple[int, int, int, list[int], list]]:
        entries, row = [], 0
        for rid, start, k, ids in targets:
            entries.append((rid, start, k, ids, [t[row : row + len(ids)] for t in host]))
            row += len(ids)
        return entries

    @staticmethod
    def is_done(step: LaunchedStep) -> bool:
        """Whether the step's tokens are on the host (finish would not wait)."""
        return step.copied is None or step.copied.query()

    def finish(self, step: LaunchedStep) -> StepResult:
        """Wait for a launched step's tokens and record them."""
        t0 = time.perf_counter()
        token_ids: list[int] = []
        if step.copied is not None:
            step.copied.synchronize()
        waited = time.perf_counter() - t0
        if step.tokens is not None:
            token_ids = step.tokens.tolist()
            for mirror, token in zip(step.mirrors, token_ids):
                mirror.token_ids.append(token)
        sampled_time = time.time()
        # Results in plan order: the scheduler hands out first tokens in the order it admitted requests.
        return StepResult(
            step.step_id,
            step.rids if step.plan_order is None else [step.rids[k] for k in step.plan_order],
            token_ids if step.plan_order is None else [token_ids[k] for k in step.plan_order],
            sampled_time,
            StepTimings(step.prepare_s, step.forward_s, sample_s=time.perf_counter() - t0, wait_s=waited),
            self._logprobs_of(step.logprobs, token_ids, step.rids),
            self._logprobs_of(step.prompt_logprobs),
        )

    @staticmethod
    def _logprobs_of(entries, token_ids: list[int] | None = None, rids: list[int] | None = None) -> list:
        """Host tensors to messages: (rid, start, k, scored ids, [logprob, top ids, top logprobs]) each;
        sampled entries score the token the step drew (looked up by rid)."""
        if not entries:
            return []
        drawn = dict(zip(rids, token_ids)) if rids is not None else {}
        out = []
        for rid, start, k, ids, (chosen, top_ids, top_logprobs) in entries:
            ids = ids or [drawn[rid]]
            out.append(
                RequestLogprobs(
                    rid,
                    Logprobs(
                        start,
                        list(ids),
                        [float(x) for x in chosen.reshape(-1).tolist()],
                        top_ids.reshape(len(ids), -1)[:, :k].tolist(),
                        top_logprobs.reshape(len(ids), -1)[:, :k].tolist(),
                    ),
                )
            )
        return out

    def _copy_to_host(
        self, tensors: list[torch.Tensor], tokens_first: bool
    ) -> tuple[list[torch.Tensor], torch.cuda.Event | None]:
        """Queue the copies of a step's results to pinned host memory; one event says they all landed.
        The sampled tokens (the first tensor, when tokens_first) land in a ring of pinned buffers, one per step in
        flight and one more, so that the common step allocates nothing."""
        if self.device.type != "cuda" or not tensors:
            return tensors, None
        hosts = [torch.empty(t.shape, dtype=t.dtype, pin_memory=True) for t in tensors[tokens_first:]]
        if tokens_first:
            self._token_turn = (self._token_turn + 1) % len(self._token_hosts)
            hosts.insert(0, self._token_hosts[self._token_turn][: len(tensors[0])])
        for host, tensor in zip(hosts, tensors):
            host.copy_(tensor, non_blocking=True)
        event = torch.cuda.Event()
        event.record()
        return hosts, event

    def _forward_eager(
        self,
        input_ids: np.ndarray,
        positions: np.ndarray,
        slot_mapping: np.ndarray,
        layout: BatchLayout,
        logit_rows: np.ndarray,
        device_inputs: tuple[torch.Tensor, torch.Tensor] | None,
        prompt_rows: list[int],
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Run the model op by op; returns the logits of `logit_rows` (flat token rows of the sampling chunks'
        last tokens), and the hidden states of `prompt_rows` (flat token rows) when given."""
        num_logit_rows = len(logit_rows)
        if self.pad_eager:
            input_ids, positions, slot_mapping, layout = pad_batch(
                input_ids,
                positions,
                slot_mapping,
                layout,
                eager_bucket(len(input_ids)),
                self.num_kv_blocks,
                self.block_size,
            )
            if len(logit_rows):
                logit_rows = np.pad(logit_rows, (0, eager_bucket(len(logit_rows)) - len(logit_rows)), mode="edge")
        ctx = ForwardContext(
            self.attention, self.attention.build_metadata(layout, slot_mapping, self.staging.upload), self.kv_cache
        )
        ids = self.staging.upload(input_ids, torch.long)
        if device_inputs is not None:
            ids[device_inputs[0]] = device_inputs[1]
        hidden = self.model(ids, self.staging.upload(positions, torch.long), ctx)
        prompt_hidden = hidden[self.staging.upload(prompt_rows, torch.long)] if prompt_rows else None
        if not len(logit_rows):
            return hidden.new_empty(0, 0), prompt_hidden
        logits = self.model.compute_logits(hidden[self.staging.upload(logit_rows, torch.long)])
        return logits[:num_logit_rows], prompt_hidden

    def _mirror_for(self, spec: NewRequestSpec) -> RequestMirror:
        s = spec.sampling
        if s.seed is None:
            raise ValueError(f"request {spec.rid} arrived without a seed; the scheduler assigns one")
        if not self._free_slots:
            raise RuntimeError("more live requests than --max-num-seqs allows (seated plus finishing)")
        slot = self._free_slots.pop()
        prompt_len = len(spec.token_ids) - spec.num_sampled
        if s.has_penalties:
            if self.token_counts is None:
                self.token_counts = TokenCounts(self.num_slots, self.model.vocab_size, self.device)
            self.token_counts.reset(slot, spec.token_ids[:prompt_len], spec.token_ids[prompt_len:])
        fresh = spec.num_sampled == 0 and s.prompt_logprobs is not None
        self.num_prompt_logprob_mirrors += fresh and prompt_len > 0
        self.batch.reset(slot)
        self.sampling_rows.set(slot, s)
        self.num_sampled[slot] = spec.num_sampled
        self.num_structured_mirrors += s.structured is not None
        return RequestMirror(list(spec.token_ids), s, slot, prompt_len if fresh else 0)
