"""A scripted EngineClient for testing the HTTP layer without engine processes.

Each request is answered from `FakeEngineClient.script`: accepted (or rejected, or never answered),
then its outputs with stage times at fixed offsets from the request's arrival, so latency metrics are
known in advance:

    arrival  +0.010 tokenized  +0.020 queued  +0.050 first scheduled
    output i: sampled at arrival + 0.1 * (i + 1), detokenized 1 ms later, streamed 2 ms later

Everything the app did is recorded (requests, aborts, control calls); threading events let tests that
run the app in a server thread wait for them without sleeping.
"""

from __future__ import annotations

import itertools
import threading
from dataclasses import dataclass, field

from common.messages import (
    ControlReply,
    DetokenizeRequest,
    GenerateRequest,
    RequestAccepted,
    RequestOutput,
    RequestRejected,
    StageTimes,
    TextReply,
    TokenizeRequest,
)
from common.scheduler_stats import SchedulerStats
from frontend.engine_client import EngineClient, EngineLimits, RequestStream

TOKENIZED_AFTER = 0.010
QUEUED_AFTER = 0.020
FIRST_SCHEDULED_AFTER = 0.050
OUTPUT_EVERY = 0.1
DETOKENIZED_AFTER_SAMPLED = 0.001
STREAMED_AFTER_SAMPLED = 0.002

SCHEDULER_STATS = SchedulerStats(
    num_running=3,
    num_waiting=2,
    kv_blocks_total=64,
    kv_blocks_free=40,
    kv_blocks_cached=5,
    kv_blocks_used=19,
    steps=100,
    prompt_tokens_computed=300,
    decode_tokens_computed=200,
    generated_tokens=210,
    prompt_tokens_admitted=400,
    cache_hit_tokens=100,
    preemptions=1,
    last_step_prefill_tokens=7,
    last_step_decode_tokens=3,
).to_payload()


@dataclass
class Script:
    """How the fake engine answers requests."""

    outputs: list[tuple[str, list[int]]] = field(
        default_factory=lambda: [("Hello", [11]), (",", [12]), (" world", [13])]
    )
    finish_reason: str | None = "stop"  # None: the request stays open after its outputs until aborted
    stop_reason: int | str | None = None  # the last output's (a stop string or stop token id)
    reject: RequestRejected | None = None  # answer this (its rid is filled in) instead of accepting
    answer: bool = True  # False: never send a verdict (a request stuck before the scheduler)
    prompt_tokens: int = 5
    num_cached_tokens: int = 2


class FakeEngineClient(EngineClient):
    def __init__(self, limits: EngineLimits | None = None, silent_roles: tuple[str, ...] = ()):
        self.limits = limits or EngineLimits(
            "fake-model", max_model_len=128, num_kv_blocks=64, block_size=16, max_num_seqs=32
        )
        self.stats_sources = {}
        self.script = Script()
        self.silent_roles = set(silent_roles)
        self.scheduler_stats = dict(SCHEDULER_STATS)
        self.submitted: list[GenerateRequest] = []
        self.aborted: list[int] = []
        self.control_calls: list[tuple[str, dict, float]] = []
        self.control_answers: dict[str, dict] = {}  # kind -> every process's payload (default: its role)
        self.request_seen = threading.Event()
        self.abort_seen = threading.Event()
        self._rids = itertools.count(1)
        self.streams: dict[int, RequestStream] = {}

    @property
    def roles(self) -> list[str]:
        return ["tokenizer-0", "scheduler", "gpu_worker"]

    async def submit(self, request: GenerateRequest | TokenizeRequest | DetokenizeRequest) -> RequestStream:
        request.rid = next(self._rids)
        self.submitted.append(request)
        stream = RequestStream(request.rid, self)
        self.streams[request.rid] = stream
        for event in self._events(request):
            stream.put(event)
        self.request_seen.set()
        return stream

    def _events(self, request: GenerateRequest | TokenizeRequest | DetokenizeRequest) -> list:
        if isinstance(request, TokenizeRequest):  # a character's code point is its token id
            text = request.prompt or "".join(m["content"] for m in request.chat_messages)
            return [TextReply(request.rid, [ord(c) for c in text], "")]
        if isinstance(request, DetokenizeRequest):
            return [TextReply(request.rid, request.token_ids, "".join(chr(t) for t in request.token_ids))]
        script, rid, arrival = self.script, request.rid, request.arrival_time
        if not script.answer:
            return []
        if script.reject is not None:
            reject = script.reject
            return [RequestRejected(rid, reject.status, reject.message, reject.param, reject.code)]
        times = StageTimes(arrival, arrival + TOKENIZED_AFTER, arrival + QUEUED_AFTER, 0.0)
        events: list = [RequestAccepted(rid, script.prompt_tokens, times)]
        for i, (text, token_ids) in enumerate(script.outputs):
            sampled = arrival + OUTPUT_EVERY * (i + 1)
            last = i == len(script.outputs) - 1
            events.append(
                RequestOutput(
                    rid,
                    text,
                    list(token_ids),
                    sampled,
                    sampled + DETOKENIZED_AFTER_SAMPLED,
                    finish_reason=script.finish_reason if last else None,
                    first_scheduled=arrival + FIRST_SCHEDULED_AFTER if i == 0 else 0.0,
                    num_cached_tokens=script.num_cached_tokens if i == 0 else 0,
                    streamed_time=sampled + STREAMED_AFTER_SAMPLED,
                    stop_reason=script.stop_reason if last else None,
                )
            )
        return events

    def fail_open_streams(self, message: str) -> None:
        for rid, stream in self.streams.items():
            if not stream.finished:
                stream.put(RequestRejected(rid, 503, message))
        self.streams.clear()

    async def abort(self, rid: int) -> None:
        self.aborted.append(rid)
        self.abort_seen.set()

    async def control(self, kind: str, args: dict | None = None, timeout: float = 5.0) -> dict[str, ControlReply]:
        self.control_calls.append((kind, args or {}, timeout))
        replies = {}
        for pid, role in enumerate(self.roles, start=1000):
            if role in self.silent_roles:
                continue  # the real client waits `timeout`, then leaves it out
            payload = self.control_answers.get(kind, {"role": role})
            if kind == "stats" and role == "scheduler":
                payload = self.scheduler_stats
            replies[role] = ControlReply(role, pid, kind, len(self.control_calls), dict(payload))
        return replies
