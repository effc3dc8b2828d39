"""`LLM`: generate from Python, with the scheduler and the model runner in this process.

The two talk through the very messages the server sends over ZeroMQ (encoded and decoded with the wire
codec at every step), so what is tested here is what the processes run.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, fields, replace

from common.config import EngineConfig
from common.messages import (
    ChatTemplateOptions,
    Logprobs,
    RequestRejected,
    StageTimes,
    StepPlan,
    StepResult,
    TokenBatch,
    TokenizedRequest,
)
from common.model_info import ModelInfo, generation_defaults
from common.model_source import resolve_model
from common.sampling_params import InvalidParameter, SamplingParams
from common.wire import decode, encode
from gpu_worker.model_runner import ModelRunner
from gpu_worker.parallel import SINGLE
from gpu_worker.step_queue import StepQueue
from gpu_worker.warm_up import warm_up
from scheduler.scheduler import Scheduler
from tokenizer_worker.tokenizer import Tokenizer
from tokenizer_worker.worker import TokenizerWorker


@dataclass(slots=True)
class CompletionOutput:
    prompt_token_ids: list[int]
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    # With finish_reason "stop", vLLM's stop_reason: the stop string matched, or the stop token id sampled
    # (None: EOS, or a structured output complete).
    stop_reason: int | str | None = None
    text: str = ""
    first_token_time: float = 0.0  # time.time() when its first token was read back
    logprobs: Logprobs | None = None  # when asked for (SamplingParams.logprobs)
    prompt_logprobs: Logprobs | None = None  # when asked for (SamplingParams.prompt_logprobs)


@dataclass(slots=True)
class HostStepTimes:
    """Where one pass of generate()'s loop spent its host time (seconds; waiting for the device excluded). A
    pass plans and launches one step and finishes and processes the one before it (PIPELINE_DEPTH 2), so in
    a steady decode both are the same kind of step. The worker's parts are the StepTimings of the steps finished
    in the pass (launched in the one before)."""

    planned_rids: int  # requests in the plan launched
    planned_tokens: int  # tokens it computes (== planned_rids: a decode-only step)
    schedule_s: float  # Scheduler.schedule
    wire_s: float  # the plan through the wire codec, as the worker process receives it
    prepare_s: float  # worker: mirrors and the batch's inputs (ModelRunner.launch up to the forward)
    forward_s: float  # worker: the forward's launch (graph replay), sampling, the copy to the host queued
    finish_s: float  # worker: tokens read back into the mirrors, the result built (ModelRunner.finish)
    process_s: float  # the result through the codec, Scheduler.process_result, outputs collected
    total_s: float  # the whole pass: these and what falls between them


class LLM:
    """With tensor_parallel_size N > 1 this process is rank 0 and spawns ranks 1..N-1
    (offline/follower_ranks.py); `close()` (or leaving a `with` block) stops them."""

    def __init__(self, model: str | None = None, **engine_args):
        folder = resolve_model(model)
        self.config = EngineConfig(model=str(folder), **engine_args)
        self.info = ModelInfo.from_folder(folder, self.config.max_model_len)
        self._followers = None
        if self.config.tensor_parallel_size > 1:
            from offline.follower_ranks import FollowerRanks

            self._followers = FollowerRanks(self.config, self.info)
        try:
            tp = SINGLE if self._followers is None else self._followers.tp
            self.runner = ModelRunner(self.config, self.info, tp=tp)
            self.config = self.runner.config  # with the batch limits the runner chose for its device
            warm_up(self.runner)
            if self._followers is not None:
                self._followers.wait_ready()
        except BaseException:
            self.close(failed=True)
            raise
        self.scheduler = Scheduler(self.config, self.info, self.runner.num_kv_blocks)
        self._tokenizer: Tokenizer | None = None
        self._rids = itertools.count()
        self.plans_executed: list[StepPlan] = []  # every plan run, for tests and inspection
        self.record_plans = False
        # generate()'s host time (everything but waiting for the device) and the steps it ran: their ratio is
        # the host's cost of a step, which bounds the engine when the device is faster (benchmarks/offline.py).
        self.host_s = 0.0
        self.steps_run = 0
        # Set to a list to have generate() append each pass's HostStepTimes to it (benchmarks/offline.py).
        self.host_step_log: list[HostStepTimes] | None = None
        # Steps launched before the oldest one's tokens are read; None: as the worker process runs (StepQueue).
        self.plans_in_flight: int | None = None

    def close(self, failed: bool = False) -> None:
        """Stop the scheduler's grammar compile worker and the other tensor-parallel ranks. `failed`: after an
        error, when a step may have stopped halfway (its collectives launched on some ranks only), the followers
        are stopped rather than asked to leave the group with rank 0, which could then never complete."""
        if hasattr(self, "scheduler"):
            self.scheduler.close()
        if self._followers is not None:
            if hasattr(self, "runner") and not failed:  # (no runner: it failed to start)
                self.runner.release_graphs()  # on every rank before the group goes: see release_graphs
            self._followers.close(together=not failed)
            self._followers = None

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, exc_type, *exc) -> None:
        self.close(failed=exc_type is not None)

    @classmethod
    def from_config(cls, config: EngineConfig) -> LLM:
        """An LLM for a config made elsewhere (command-line flags); config.model is any source that
        resolve_model takes."""
        return cls(
            config.model or None, **{f.name: getattr(config, f.name) for f in fields(config) if f.name != "model"}
        )

    def default_sampling_params(self) -> SamplingParams:
        """What generate() uses when given no sampling parameters: the model's generation_config.json defaults
        where it sets them (as the server's --generation-config auto, and vLLM's), else the API's."""
        return SamplingParams(**generation_defaults(self.config.model))

    @property
    def tokenizer(self):
        """The model's Hugging Face tokenizer."""
        return self._text_tokenizer().hf

    def _text_tokenizer(self) -> Tokenizer:
        # The tokenizer workers' own (tokenizer_worker/tokenizer.py): chat renders here as the server renders it.
        if self._tokenizer is None:
            self._tokenizer = Tokenizer.load(self.config.model)
        return self._tokenizer

    # ------------------------------------------------------------------ request level

    def add_request(self, prompt_token_ids: list[int], sampling: SamplingParams, priority: int = 0) -> int:
        """priority: under scheduling_policy="priority", lower is served first (vLLM's)."""
        # What the server's frontend and tokenizer workers check; the scheduler checks the rest.
        sampling.validate()
        if not prompt_token_ids:
            raise InvalidParameter("prompt", "the prompt is empty")
        if sampling.structured is not None:
            sampling.structured.check_size(self.config.max_grammar_bytes)
        rid = next(self._rids)
        reply = self.scheduler.add_request(
            TokenizedRequest(rid, list(prompt_token_ids), replace(sampling), StageTimes(arrival=time.time()), priority)
        )
        while reply is None:  # its grammar is being compiled (in the scheduler's compile worker)
            reply = next((v for v in self.scheduler.take_grammar_verdicts(timeout_s=1.0) if v.rid == rid), None)
        if isinstance(reply, RequestRejected):
            raise InvalidParameter(reply.param or "prompt", reply.message)
        return rid

    def abort(self, rid: int) -> None:
        self.scheduler.abort_request(rid)

    def step(self) -> TokenBatch | None:
        """Plan one step, run it, and return the tokens it produced (None when idle). No overlap."""
        plan = self.scheduler.schedule()
        if plan is None:
            return None
        return self._process(self.runner.execute(self._sent(plan)))

    def _sent(self, plan: StepPlan) -> StepPlan:
        """The plan as the worker receives it (through the wire codec); recorded if asked. Its bytes go to
        the other tensor-parallel ranks first, as the worker process relays them."""
        data = encode(plan)
        if self._followers is not None:
            self._followers.send(data)
        plan = decode(data)
        if self.record_plans:
            self.plans_executed.append(plan)
        return plan

    def _process(self, result: StepResult) -> TokenBatch:
        return self.scheduler.process_result(decode(encode(result)))

    # ------------------------------------------------------------------ batch level

    @staticmethod
    def _collect(
        batch: TokenBatch,
        outputs: dict[int, CompletionOutput],
        pending: set[int],
        sampling_of: dict[int, SamplingParams],
    ) -> None:
        """A step's tokens into the outputs of the requests generate() is waiting for."""
        now = time.time()
        for rid, token in zip(batch.rids, batch.token_ids):
            out = outputs.get(rid)
            if out is not None:
                if not out.token_ids:
                    out.first_token_time = now
                out.token_ids.append(token)
        for first in batch.firsts:
            if first.prompt_logprobs is not None and first.rid in outputs:
                outputs[first.rid].prompt_logprobs = first.prompt_logprobs
        for item in batch.logprobs:
            out = outputs.get(item.rid)
            if out is not None:
                if out.logprobs is None:
                    out.logprobs = item.logprobs
                else:
                    out.logprobs.extend(item.logprobs)
        for rid, reason in batch.finish_reasons.items():
            out = outputs.get(rid)
            if out is not None:
                out.finish_reason = reason
                if reason == "stop":
                    out.stop_reason = sampling_of[rid].stop_reason_of(out.token_ids[-1])
                pending.discard(rid)

    def _collect_text(
        self, texts: TokenizerWorker, batch: TokenBatch, outputs: dict[int, CompletionOutput], pending: set[int]
    ) -> None:
        """A step's text into the outputs; a stop string matched ends its request, in the scheduler too."""
        step_outputs, aborts = texts.process_tokens(batch)
        for out in step_outputs:
            completion = outputs.get(out.rid)
            if completion is None:
                continue
            completion.text += out.text
            if out.finish_reason is not None:
                completion.finish_reason, completion.stop_reason = out.finish_reason, out.stop_reason
                pending.discard(out.rid)
        for abort in aborts:
            self.scheduler.abort_request(abort.rid, abort.reason)

    def chat(
        self,
        messages: list[dict] | Sequence[list[dict]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        options: ChatTemplateOptions | None = None,
        tools: list[dict] | None = None,
    ) -> list[CompletionOutput]:
        """vLLM's LLM.chat: one conversation (a list of messages) or several, each rendered with the model's chat
        template exactly as the server renders a chat request (with the same options; `tools`, OpenAI's function
        definitions, for templates that describe them), then generated; the outputs carry their text."""
        if tools is not None:
            options = replace(options or ChatTemplateOptions(), tools=tools)
        conversations = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        prompts = [self._text_tokenizer().render_chat(list(c), options) for c in conversations]
        return self.generate(prompts, sampling_params, text=True)

    def generate(
        self,
        prompts: Sequence[str] | Sequence[list[int]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        on_step: Callable[[], None] | None = None,
        text: bool = False,
        priority: Sequence[int] | None = None,
    ) -> list[CompletionOutput]:
        """Generate for every prompt (text or token ids); outputs in prompt order, with their text where a prompt
        was text (or `text` asks for it). priority: each prompt's, under scheduling_policy="priority"."""
        if sampling_params is None:
            sampling_params = self.default_sampling_params()
        params = (
            [sampling_params] * len(prompts) if isinstance(sampling_params, SamplingParams) else list(sampling_params)
        )
        outputs: dict[int, CompletionOutput] = {}
        sampling_of: dict[int, SamplingParams] = {}
        order = []
        # The text of the requests that want it (text prompts, `text`, stop strings to look for) is made as the
        # server's tokenizer workers make it, step by step: stop strings end a request there too.
        texts = None
        for i, (prompt, sp) in enumerate(zip(prompts, params)):
            ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
            rid = self.add_request(ids, sp, 0 if priority is None else priority[i])
            outputs[rid] = CompletionOutput(ids)
            sampling_of[rid] = sp
            order.append(rid)
            if text or isinstance(prompt, str) or sp.stop:
                texts = texts or TokenizerWorker(self._text_tokenizer())
                texts.track(rid, sp, len(ids))
        pending = set(order)
        # As the server runs: the next step is planned and launched before the previous one's tokens are
        # read back (see scheduler/process.py and gpu_worker/step_queue.py).
        steps = StepQueue(self.runner, self.plans_in_flight)
        log = self.host_step_log
        started, waited = time.perf_counter(), 0.0
        while pending:
            t0 = time.perf_counter()
            plan = self.scheduler.schedule()
            t1 = t2 = time.perf_counter()
            if plan is not None:
                sent = self._sent(plan)
                t2 = time.perf_counter()
                results = steps.launch(sent)
            elif steps:
                results = [steps.finish_oldest()]
            else:
                raise RuntimeError("requests are unfinished but the scheduler planned nothing")
            t3 = time.perf_counter()
            pass_waited = 0.0
            for result in results:
                pass_waited += result.timings.wait_s
                self.steps_run += 1
                batch = self._process(result)
                self._collect(batch, outputs, pending, sampling_of)
                if texts is not None:
                    self._collect_text(texts, batch, outputs, pending)
                if on_step is not None:
                    on_step()
            waited += pass_waited
            if log is not None:
                log.append(self._host_step_times(plan, results, t0, t1, t2, t3, pass_waited))
        while steps:  # steps planned before the last finish was seen: their tokens are discarded
            self._process(steps.finish_oldest())
        # Everything this loop did but wait for the device: planning, launching, reading back, processing.
        self.host_s += time.perf_counter() - started - waited
        return [outputs[rid] for rid in order]

    @staticmethod
    def _host_step_times(
        plan: StepPlan | None, results: list[StepResult], t0: float, t1: float, t2: float, t3: float, waited: float
    ) -> HostStepTimes:
        t4 = time.perf_counter()
        timings = [r.timings for r in results]
        return HostStepTimes(
            len(plan.rids) if plan is not None else 0,
            sum(plan.num_tokens) if plan is not None else 0,
            t1 - t0,
            t2 - t1,
            sum(t.prepare_s for t in timings),
            sum(t.forward_s for t in timings),
            sum(t.sample_s - t.wait_s for t in timings),
            t4 - t3,
            t4 - t0 - waited,
        )
