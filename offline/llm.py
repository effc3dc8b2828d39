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
    check_cache_salt,
)
from common.model_info import ModelInfo, generation_defaults
from common.model_source import resolve_model
from common.sampling_params import InvalidParameter, SamplingParams
from common.wire import decode, encode
from gpu_worker.builder import build_worker
from gpu_worker.parallel import SINGLE
from gpu_worker.step_queue import StepQueue
from offline.generate_observer import GenerateObserver
from scheduler.scheduler import Scheduler
from tokenizer_worker.tokenizer import Tokenizer
from tokenizer_worker.worker import TokenizerWorker

NO_OBSERVER = GenerateObserver()


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


class LLM:
    """With tensor_parallel_size N > 1 this process is rank 0 and spawns ranks 1..N-1
    (offline/follower_ranks.py); `close()` (or leaving a `with` block) stops them."""

    def __init__(self, model: str | None = None, **engine_args):
        folder = resolve_model(model)
        self.config = EngineConfig(model=str(folder), **engine_args)
        if self.config.adaptive_prefill_budget is None:  # in process, throughput first: the fixed budget
            self.config.adaptive_prefill_budget = False
        self.info = ModelInfo.from_folder(folder, self.config.max_model_len)
        self._followers = None
        if self.config.tensor_parallel_size > 1:
            from offline.follower_ranks import FollowerRanks

            self._followers = FollowerRanks(self.config, self.info)
        try:
            tp = SINGLE if self._followers is None else self._followers.tp
            self.runner = build_worker(self.config, self.info, tp=tp)
            if self._followers is not None:
                self._followers.wait_ready()
        except BaseException:
            self.close(failed=True)
            raise
        self.scheduler = Scheduler(self.config, self.info, self.runner.limits)  # as the runner decided them
        self._tokenizer: Tokenizer | None = None
        self._rids = itertools.count()
        self.plans_executed: list[StepPlan] = []  # every plan run, for tests and inspection
        self.record_plans = False
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

    def add_request(
        self, prompt_token_ids: list[int], sampling: SamplingParams, priority: int = 0, cache_salt: str | None = None
    ) -> int:
        """priority: under scheduling_policy="priority", lower is served first (vLLM's). cache_salt: its prefix-cache
        entries are shared only with requests of the same salt (vLLM's)."""
        # What the server's frontend and tokenizer workers check; the scheduler checks the rest.
        sampling.validate()
        if not prompt_token_ids:
            raise InvalidParameter("prompt", "the prompt is empty")
        check_cache_salt(cache_salt)
        if sampling.structured is not None:
            sampling.structured.check_size(self.config.max_grammar_bytes)
        rid = next(self._rids)
        times = StageTimes(arrival=time.time())
        reply = self.scheduler.add_request(
            TokenizedRequest(rid, list(prompt_token_ids), replace(sampling), times, priority, cache_salt)
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
        for out in step_outputs.outputs():
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
        cache_salt: Sequence[str | None] | None = None,
        observer: GenerateObserver = NO_OBSERVER,
    ) -> list[CompletionOutput]:
        """Generate for every prompt (text or token ids); outputs in prompt order, with their text where a prompt
        was text (or `text` asks for it). on_step: called after each step's results are collected. priority: each
        prompt's, under scheduling_policy="priority". cache_salt: each prompt's (vLLM's): prefix-cache entries are
        shared only among prompts of the same salt. observer: watches each pass of the loop (a benchmark's)."""
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
            salt = None if cache_salt is None else cache_salt[i]
            rid = self.add_request(ids, sp, 0 if priority is None else priority[i], salt)
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
        while pending:
            observer.started()
            plan = self.scheduler.schedule()
            observer.planned()
            if plan is not None:
                sent = self._sent(plan)
                observer.sent()
                results = steps.launch(sent)
            elif steps:
                results = [steps.finish_oldest()]
            else:
                raise RuntimeError("requests are unfinished but the scheduler planned nothing")
            observer.ran()
            for result in results:
                batch = self._process(result)
                self._collect(batch, outputs, pending, sampling_of)
                if texts is not None:
                    self._collect_text(texts, batch, outputs, pending)
                if on_step is not None:
                    on_step()
            observer.ended(plan, results)
        while steps:  # steps planned before the last finish was seen: their tokens are discarded
            self._process(steps.finish_oldest())
        return [outputs[rid] for rid in order]
