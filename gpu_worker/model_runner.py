"""Runs step plans: keeps a mirror of each running request, builds the flat token batch, runs the model
and samples. It allocates no block and makes no decision; every choice arrives in the plan. It is built once
(builder.py), then run:

    launch(plan N):  drop released mirrors, add new ones, extend block tables (request_mirrors.py); the step's
                     inputs, multi-token chunks first (input_batch.py); forward (a decode graph by batch size, a
                     mixed one by token count, eager where no graph fits or prompt logprobs are asked); sample;
                     start copying the tokens to the host                                    -- no waiting
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

from common.messages import StepPlan, StepResult, StepTimings, WorkerLimits
from common.model_info import ModelInfo
from gpu_worker.attention import AttentionBackend
from gpu_worker.eager_forward import EagerForward
from gpu_worker.graph_capture import StepGraphs
from gpu_worker.host_copy import Readback, StagingRing
from gpu_worker.input_batch import StepInputs, pick
from gpu_worker.logprobs import (
    PendingLogprobs,
    logprob_messages,
    prompt_logprob_targets,
    prompt_logprobs,
    split_prompt_logprobs,
)
from gpu_worker.request_mirrors import RequestMirror, RequestMirrors
from gpu_worker.sampler import SampledLogprobs, process_logits, sample, sampled_logprobs


@dataclass(slots=True)
class Forward:
    """What a step's forward leaves for sampling."""

    logits: torch.Tensor  # [R, V], the sampling rows' (layout order): float32, or a decode graph's model dtype
    greedy: torch.Tensor | None = None  # a decode graph's: each row's greedy token, in its last-token slot already
    prompt_hidden: torch.Tensor | None = None  # the prompt-logprob rows' hidden states (eager only)


@dataclass(slots=True)
class LaunchedStep:
    """A step whose forward and sampling are queued on the device, its tokens on their way to the host."""

    step_id: int
    rids: list[int]  # requests that sample, in the order of `tokens`
    mirrors: list[RequestMirror]  # theirs, same order (kept even if a later plan drops them)
    slots: np.ndarray  # their slots, same order...
    occupants: np.ndarray  # ...and who held each then (PersistentBatch.occupant)
    plan_order: list[int] | None  # positions in `rids` of the plan's order of those requests; None: in order
    tokens: torch.Tensor | None  # host tensor the sampled ids are copied into
    copied: torch.cuda.Event | None
    prepare_s: float
    forward_s: float
    # Logprobs on their way to the host, for the requests that asked (of their samples, of prompt positions).
    logprobs: list[PendingLogprobs] | None = None
    prompt_logprobs: list[PendingLogprobs] | None = None


class ModelRunner:
    """Runs plans on the parts builder.py made: launch, then finish (the module docstring)."""

    def __init__(
        self,
        info: ModelInfo,
        limits: WorkerLimits,
        model: torch.nn.Module,
        attention: AttentionBackend,
        mirrors: RequestMirrors,
        last_tokens: torch.Tensor,
        staging: StagingRing,
        eager: EagerForward,
        graphs: StepGraphs | None,
        dtype: torch.dtype,
    ):
        """Its parts, as builder.py makes them. last_tokens: the last sampled token of each mirror's slot, on the
        device (the graphs read and write it), and a sink entry past them for the decode graphs' rows that sample
        nothing; staging: every per-step host-to-device copy; graphs: None where steps run eagerly."""
        self.info = info
        self.limits = limits
        self.model = model
        self.attention = attention
        self.mirrors = mirrors
        self.last_tokens = last_tokens
        self.staging = staging
        self.eager = eager
        self.graphs = graphs
        self.device = last_tokens.device
        self.dtype = dtype
        self.readback = Readback(self.device, mirrors.num_slots)

    @property
    def launches_async(self) -> bool:
        """Whether launch() returns before the step is computed. On a CPU it computes everything, so
        launching the next step before finishing this one would only hold this one's tokens back."""
        return self.device.type == "cuda"

    def release_graphs(self) -> None:
        """Destroy the CUDA graphs; later steps run eagerly. Every rank does this before leaving a tensor-parallel
        group: NCCL's teardown never returns while a graph that captured its collectives still exists
        (pytorch/pytorch#115388)."""
        if self.graphs is not None:
            self.graphs.release()
        self.graphs = None
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def execute(self, plan: StepPlan) -> StepResult:
        """Launch and finish one step (no overlap)."""
        return self.finish(self.launch(plan))

    # ------------------------------------------------------------------ the step

    @torch.inference_mode()
    def launch(self, plan: StepPlan) -> LaunchedStep:
        """Queue a step on the device and return without waiting for it: the plan's changes to the mirrors, the
        step's inputs, its forward, sampling, and the copy of the tokens (and logprobs) to the host."""
        t0 = time.perf_counter()
        self.mirrors.update(plan)
        if not plan.rids:
            no_slots = np.zeros(0, dtype=np.int64)
            return LaunchedStep(
                plan.step_id, [], [], no_slots, no_slots, None, None, None, time.perf_counter() - t0, 0.0
            )
        step_mirrors, inputs = self.mirrors.step_inputs(plan)
        prompt_rows, prompt_targets = self._prompt_logprob_targets(inputs)
        self.staging.next_step()
        t1 = time.perf_counter()
        forward = self._forward(inputs, prompt_rows)
        prompt_values = self._prompt_logprobs(forward, prompt_targets)
        rids, sampled = self._sampling_requests(plan, inputs, step_mirrors)
        slots = self._sampling_slots(inputs)
        drawn, logprobs = self._sample(plan, rids, sampled, slots, forward) if sampled else ([], None)
        host, copied = self.readback.copy(drawn + prompt_values, tokens_first=bool(sampled))
        for k, entry in enumerate(logprobs or ()):
            entry.values.extend(t[k] for t in host[1:4])
        prompt_entries = split_prompt_logprobs(prompt_targets, host[-3:]) if prompt_targets else None
        plan_order = None if inputs.order is None else self._plan_order(inputs.order, inputs.sampling_rows)
        tokens = host[0] if sampled else None
        occupants = self.mirrors.batch.occupant[slots]
        forward_s = time.perf_counter() - t1
        return LaunchedStep(
            plan.step_id,
            rids,
            sampled,
            slots,
            occupants,
            plan_order,
            tokens,
            copied,
            t1 - t0,
            forward_s,
            logprobs,
            prompt_entries,
        )

    def _forward(self, inputs: StepInputs, prompt_rows: list[int]) -> Forward:
        """A decode-only step replays a decode graph, one that computes prompt tokens a mixed graph; eager where
        no graph holds the step, or where it asks for prompt logprobs (a graph keeps no hidden states of them)."""
        graphs, n = self.graphs, len(inputs.rids)
        decode_only = len(inputs.input_ids) == n
        if graphs is not None and not prompt_rows:
            if decode_only and graphs.decode.bucket_for(n):
                logits, greedy = graphs.decode.run(inputs)
                if len(inputs.sampling_rows) < n:  # a row that samples nothing: keep the others'
                    rows = self.staging.upload(inputs.sampling_rows, torch.long)
                    logits, greedy = logits[rows], greedy[rows]
                return Forward(logits, greedy)
            if not decode_only and graphs.mixed.bucket_for(len(inputs.input_ids), n):
                return Forward(graphs.mixed.run(inputs))
        logits, prompt_hidden = self.eager.run(inputs, prompt_rows)
        return Forward(logits, prompt_hidden=prompt_hidden)

    def _prompt_logprob_targets(self, inputs: StepInputs) -> tuple[list[int], list[PendingLogprobs]]:
        """Flat token rows whose logits give prompt logprobs, and what they score (logprobs.py); none unless a
        mirror still asks for them."""
        if not self.mirrors.num_prompt_logprobs:
            return [], []
        return prompt_logprob_targets(inputs, self.mirrors)

    def _prompt_logprobs(self, forward: Forward, targets: list[PendingLogprobs]) -> list[torch.Tensor]:
        if not targets:
            return []
        return prompt_logprobs(self.model, forward.prompt_hidden, targets, self.staging.upload)

    @staticmethod
    def _plan_order(order: np.ndarray, sampling_rows: np.ndarray) -> list[int]:
        """Positions among the sampling chunks (in layout order) of those chunks in the plan's order. order: each
        chunk's index in the plan (StepInputs.order)."""
        return np.argsort(order[sampling_rows]).tolist()

    @staticmethod
    def _sampling_requests(
        plan: StepPlan, inputs: StepInputs, step_mirrors: list[RequestMirror]
    ) -> tuple[list[int], list[RequestMirror]]:
        """The requests that sample this step and their mirrors (step_mirrors: the plan's, in its order), in
        layout order."""
        if inputs.order is None and len(inputs.sampling_rows) == len(plan.rids):
            return plan.rids, step_mirrors
        rows = inputs.sampling_rows if inputs.order is None else inputs.order[inputs.sampling_rows]
        entries = rows.tolist()  # the sampling chunks' indices in the plan
        return pick(plan.rids, entries), pick(step_mirrors, entries)

    @staticmethod
    def _sampling_slots(inputs: StepInputs) -> np.ndarray:
        """The slots of the requests that sample this step, in layout order."""
        if len(inputs.sampling_rows) == len(inputs.rids):
            return inputs.slots
        return inputs.slots[inputs.sampling_rows]

    def _sample(
        self, plan: StepPlan, rids: list[int], sampled: list[RequestMirror], slots: np.ndarray, forward: Forward
    ) -> tuple[list[torch.Tensor], list[PendingLogprobs] | None]:
        """The drawn tokens (and their logprobs, for the rows that ask: [logprob, top ids, top logprobs]) to copy to
        the host, and the logprob entries awaiting them."""
        masks = plan.token_bitmasks
        bitmasks = [masks.get(rid) for rid in rids] if self.mirrors.num_structured else None
        output_index = self.mirrors.num_sampled[slots]
        drawn, lp = self._draw(forward.logits, slots, output_index, bitmasks, forward.greedy)
        if lp is None:
            return [drawn], None
        logprobs = [
            PendingLogprobs(rids[row], int(output_index[row]), sampled[row].sampling.logprobs, []) for row in lp.rows
        ]
        return [drawn, lp.sampled, lp.top_ids, lp.top_logprobs], logprobs

    def _draw(
        self,
        logits: torch.Tensor,
        slots: np.ndarray,
        output_index: np.ndarray,
        bitmasks: list[bytes | None] | None,
        graph_greedy: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, SampledLogprobs | None]:
        """Sample one token per row (the requests in these slots), write it to their last-token slots and
        token counts on the device; output_index: the index in its output of the token each samples.
        graph_greedy: each row's greedy token, already in its slot (a decode graph's): the draw itself when
        every row samples greedily with nothing to apply first."""
        mirrors = self.mirrors
        if graph_greedy is not None and bitmasks is None and mirrors.sampling_rows.plain_greedy(slots):
            mirrors.num_sampled[slots] += 1
            return graph_greedy, None
        counts = mirrors.token_counts
        upload = self.staging.upload
        batch = mirrors.sampling_rows.batch(
            slots, output_index, upload, None, counts, self.info.eos_token_ids, bitmasks
        )
        logits = process_logits(logits.float(), batch)  # a decode graph's are in the model's dtype
        drawn = sample(logits, batch)
        lp = sampled_logprobs(logits, batch, drawn)
        self.last_tokens.index_copy_(0, upload(slots, torch.long), drawn)
        if batch.penalties is not None:
            counts.add(batch.penalties.slots, drawn[batch.penalties.rows])
        mirrors.num_sampled[slots] += 1
        return drawn, lp

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
            token_ids = self.mirrors.record_samples(step.mirrors, step.slots, step.occupants, step.tokens)
        sampled_time = time.time()
        # Results in plan order: the scheduler hands out first tokens in the order it admitted requests.
        return StepResult(
            step.step_id,
            step.rids if step.plan_order is None else pick(step.rids, step.plan_order),
            token_ids if step.plan_order is None else pick(token_ids, step.plan_order),
            sampled_time,
            StepTimings(step.prepare_s, step.forward_s, sample_s=time.perf_counter() - t0, wait_s=waited),
            logprob_messages(step.logprobs, step.rids, token_ids),
            logprob_messages(step.prompt_logprobs),
        )
