"""`LLM`: generate from Python, with the scheduler and the model runner in this process.

The two talk through the very messages the server sends over ZeroMQ (encoded and decoded with the wire
codec at every step), so what is tested here is what the processes run.
"""

from __future__ import annotations

import itertools
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, fields, replace

from common.config import EngineConfig
from common.messages import Logprobs, RequestRejected, RequestTokens, StageTimes, StepPlan, TokenizedRequest
from common.model_info import ModelInfo
from common.model_source import resolve_model
from common.sampling_params import InvalidParameter, SamplingParams
from common.wire import decode, encode
from gpu_worker.model_runner import LaunchedStep, ModelRunner
from scheduler.process import PLANS_IN_FLIGHT
from scheduler.scheduler import Scheduler


@dataclass(slots=True)
class CompletionOutput:
    prompt_token_ids: list[int]
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    text: str = ""
    logprobs: Logprobs | None = None  # when asked for (SamplingParams.logprobs)
    prompt_logprobs: Logprobs | None = None  # when asked for (SamplingParams.prompt_logprobs)


class LLM:
    def __init__(self, model: str | None = None, **engine_args):
        folder = resolve_model(model)
        self.config = EngineConfig(model=str(folder), **engine_args)
        self.info = ModelInfo.from_folder(folder, self.config.max_model_len)
        self.runner = ModelRunner(self.config, self.info)
        self.scheduler = Scheduler(self.config, self.info, self.runner.num_kv_blocks)
        self._tokenizer = None
        self._rids = itertools.count()
        self.plans_executed: list[StepPlan] = []  # every plan run, for tests and inspection
        self.record_plans = False
        # Plans outstanding before the oldest one's tokens are read, as the server runs (see generate).
        self.plans_in_flight = PLANS_IN_FLIGHT if self.runner.launches_async else 1

    @classmethod
    def from_config(cls, config: EngineConfig) -> LLM:
        """An LLM for a config made elsewhere (command-line flags); config.model is any source that
        resolve_model takes."""
        return cls(
            config.model or None, **{f.name: getattr(config, f.name) for f in fields(config) if f.name != "model"}
        )

    @property
    def tokenizer(self):
        if self._tokenizer is None:
            from transformers import AutoTokenizer

            self._tokenizer = AutoTokenizer.from_pretrained(self.config.model)
        return self._tokenizer

    # ------------------------------------------------------------------ request level

    def add_request(self, prompt_token_ids: list[int], sampling: SamplingParams) -> int:
        sampling.validate()
        rid = next(self._rids)
        reply = self.scheduler.add_request(
            TokenizedRequest(rid, list(prompt_token_ids), replace(sampling), StageTimes(arrival=time.time()))
        )
        if isinstance(reply, RequestRejected):
            raise InvalidParameter(reply.param or "prompt", reply.message)
        return rid

    def abort(self, rid: int) -> None:
        self.scheduler.abort_request(rid)

    def step(self) -> list[RequestTokens]:
        """Plan one step, run it, and return the tokens it produced ([] when idle). No overlap."""
        plan = self.scheduler.schedule()
        if plan is None:
            return []
        return self._finish(self._launch(plan))

    def _launch(self, plan: StepPlan) -> LaunchedStep:
        plan = decode(encode(plan))
        if self.record_plans:
            self.plans_executed.append(plan)
        return self.runner.launch(plan)

    def _finish(self, step: LaunchedStep) -> list[RequestTokens]:
        return self.scheduler.process_result(decode(encode(self.runner.finish(step))))

    # ------------------------------------------------------------------ batch level

    def generate(
        self,
        prompts: Sequence[str] | Sequence[list[int]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        on_step: Callable[[], None] | None = None,
    ) -> list[CompletionOutput]:
        """Generate for every prompt (text or token ids); outputs in prompt order."""
        if sampling_params is None:
            sampling_params = SamplingParams()
        params = (
            [sampling_params] * len(prompts) if isinstance(sampling_params, SamplingParams) else list(sampling_params)
        )
        outputs: dict[int, CompletionOutput] = {}
        order = []
        for prompt, sp in zip(prompts, params):
            ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
            rid = self.add_request(ids, sp)
            outputs[rid] = CompletionOutput(ids)
            order.append(rid)
        pending = set(order)
        # As the server runs: the next step is planned and launched before the previous one's tokens are
        # read back (see scheduler/process.py), at most self.plans_in_flight steps outstanding.
        in_flight: deque[LaunchedStep] = deque()
        depth = self.plans_in_flight
        while pending:
            plan = self.scheduler.schedule() if len(in_flight) < depth else None
            if plan is not None:
                in_flight.append(self._launch(plan))
            if not in_flight:
                raise RuntimeError("requests are unfinished but the scheduler planned nothing")
            if plan is not None and len(in_flight) < depth:
                continue
            for tokens in self._finish(in_flight.popleft()):
                if tokens.rid in outputs:
                    out = outputs[tokens.rid]
                    out.token_ids.extend(tokens.token_ids)
                    if tokens.prompt_logprobs is not None:
                        out.prompt_logprobs = tokens.prompt_logprobs
                    if tokens.logprobs is not None:
                        if out.logprobs is None:
                            out.logprobs = tokens.logprobs
                        else:
                            out.logprobs.extend(tokens.logprobs)
                    if tokens.finish_reason is not None:
                        out.finish_reason = tokens.finish_reason
                        pending.discard(tokens.rid)
            if on_step is not None:
                on_step()
        while in_flight:  # steps planned before the last finish was seen: their tokens are discarded
            self._finish(in_flight.popleft())
        if any(isinstance(p, str) for p in prompts):
            for out in outputs.values():
                out.text = self.tokenizer.decode(out.token_ids, skip_special_tokens=True)
        return [outputs[rid] for rid in order]
