"""How the HTTP layer talks to the engine processes: the EngineClient interface and its ZeroMQ form.

    app ── submit(GenerateRequest) ──▶ RequestStream ── events ──▶ app
           first event:  RequestAccepted  (then 200 and stream)   or  RequestRejected (then 4xx/503)
           then:         RequestOutput ... until one has finish_reason set
    app ── submit(TokenizeRequest / DetokenizeRequest) ──▶ one event: TextReply or RequestRejected

A stream can also end in a RequestRejected after it was accepted: when the frontend stops (every open
stream is failed at once, `fail_open_streams`, so each client gets an error event instead of silence), when
the request outlives its deadline (`request_timeout_s`: the stream ends and the request is aborted), or when
its engine replica fails (its tokenizer worker ends it: tokenizer_worker/process.py).

The HTTP layer knows nothing of sockets, and tests can give it a fake client.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
from abc import ABC, abstractmethod
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

import zmq
import zmq.asyncio

from common.config import MAX_GRAMMAR_BYTES
from common.control import ControlServer, frontend_role
from common.engine_replica import REPLICA_FAILED, REPLICA_JOINED, ReplicaFailure, ReplicaJoined, is_scheduler_role
from common.loop_progress import LoopProgress, tick_event_loop
from common.messages import (
    AbortRequest,
    ControlReply,
    ControlRequest,
    DetokenizeRequest,
    GenerateRequest,
    OutputBatch,
    RequestAccepted,
    RequestOutput,
    RequestRejected,
    TextReply,
    TokenizeRequest,
)
from common.profiling import NOT_ENABLED, EventLoopStats, ProcessProfiler
from common.request_ids import request_ids, tokenizer_of
from common.transport import Endpoints, pull_socket, push_socket
from common.wire import decode, encode
from frontend.replicas import EngineReplicas

log = logging.getLogger(__name__)

Event = RequestAccepted | RequestRejected | RequestOutput | TextReply
EngineRequest = GenerateRequest | TokenizeRequest | DetokenizeRequest


def is_final(event: Event) -> bool:
    return isinstance(event, (RequestRejected, TextReply)) or (
        isinstance(event, RequestOutput) and event.finish_reason is not None
    )


@dataclass(slots=True)
class EngineLimits:
    """What the HTTP layer may tell clients and check up front, learned when the engine started."""

    served_model_name: str
    max_model_len: int
    num_kv_blocks: int
    block_size: int
    max_num_seqs: int  # running requests, as the GPU worker chose them (the smallest replica's)
    # What a request that leaves a sampling field out gets instead of the API's default: the model's
    # generation_config.json values (common/model_info.py: generation_defaults; --generation-config).
    sampling_defaults: dict[str, float] = field(default_factory=dict)
    # The local folder holding the model's config and tokenizer (GET /v1/models' `root`, as vLLM's: clients such
    # as lm-eval load the tokenizer from it); for the embedded default model, its converted cache folder.
    model_root: str = ""
    max_grammar_bytes: int = MAX_GRAMMAR_BYTES  # --max-grammar-bytes: refused here, before the grammar travels on


REQUEST_TIMED_OUT = 504
SERVER_STOPPING = 503


class RequestStream:
    """Events of one request, in order. Iterate to get them; `abort()` when the client goes away.

    A deque and one waiter rather than an asyncio.Queue: a streamed token passes through here once, and the queue's
    bookkeeping (its bound, its unfinished-task count and event) was a tenth of the frontend's time per token."""

    def __init__(self, rid: int, client: EngineClient):
        self.rid = rid
        self._client = client
        self._events: deque[Event] = deque()
        self._waiter: asyncio.Future[None] | None = None  # the reader's, while it waits for an event
        self.finished = False
        timeout = client.request_timeout_s
        self._deadline = None if timeout is None else asyncio.get_running_loop().time() + timeout

    def put(self, event: Event) -> None:
        self._events.append(event)
        waiter = self._waiter
        if waiter is not None:
            self._waiter = None
            if not waiter.done():  # done: cancelled with its reader (a deadline passed, the client left)
                waiter.set_result(None)

    async def _get(self) -> Event:
        while not self._events:
            self._waiter = asyncio.get_running_loop().create_future()
            await self._waiter
        return self._events.popleft()

    async def next_event(self) -> Event:
        if self._deadline is None:
            event = await self._get()
        else:
            try:
                left = self._deadline - asyncio.get_running_loop().time()
                event = await asyncio.wait_for(self._get(), max(0.0, left))
            except asyncio.TimeoutError:
                await self.abort()
                return RequestRejected(
                    self.rid,
                    REQUEST_TIMED_OUT,
                    "the request did not finish within the server's "
                    f"--request-timeout of {self._client.request_timeout_s} s",
                )
        if is_final(event):
            self.finished = True
        return event

    def ready_events(self) -> list[Event]:
        """Events already queued, without waiting (a slow reader catches up in one go)."""
        events = []
        queued = self._events
        while queued and not self.finished:
            event = queued.popleft()
            if is_final(event):
                self.finished = True
            events.append(event)
        return events

    def __aiter__(self):
        return self

    async def __anext__(self) -> Event:
        if self.finished:
            raise StopAsyncIteration
        return await self.next_event()

    async def abort(self) -> None:
        if not self.finished:
            self.finished = True
            await self._client.abort(self.rid)


class EngineClient(ABC):
    limits: EngineLimits
    role: str = "frontend"  # this process's role: its own answers appear under it in /stats and profiling
    request_timeout_s: float | None = None  # set by the app from its HttpLimits
    # More for this frontend's stats, by key (the app's request counts): each called when stats are asked for.
    stats_sources: dict[str, Callable[[], dict]]
    replicas: EngineReplicas = EngineReplicas()  # the engine replicas serving (frontend/replicas.py)

    @abstractmethod
    async def submit(self, request: EngineRequest) -> RequestStream:
        """Send a request (its rid is set here) and return the stream of its events."""

    async def ask_tokenizer(self, request: TokenizeRequest | DetokenizeRequest) -> TextReply | RequestRejected:
        """/tokenize, /detokenize: a tokenizer worker answers (the frontend has no tokenizer of its own)."""
        return await (await self.submit(request)).next_event()

    @abstractmethod
    async def abort(self, rid: int) -> None: ...

    @abstractmethod
    def fail_open_streams(self, message: str) -> None:
        """End every open stream with a 503 RequestRejected (the frontend is stopping): each client's
        response ends with an error at once, so a graceful shutdown does not wait on streams that will
        never finish."""

    @abstractmethod
    async def control(self, kind: str, args: dict | None = None, timeout: float = 5.0) -> dict[str, ControlReply]:
        """Send a control request to every other process; replies by role ('scheduler', 'gpu_worker',
        'tokenizer-0', 'frontend-1', ...). Processes that did not answer within `timeout` are missing."""

    @property
    @abstractmethod
    def roles(self) -> list[str]:
        """Every other process of the server (this one answers for itself)."""

    def stats(self) -> dict | None:
        """The frontend process's own summary (busy, messages), like every process's stats; None when this
        client measures nothing."""
        return None


class ZmqEngineClient(EngineClient):
    """Frontend `index` of `num_frontends`: its requests get ids `n * num_frontends + index`, and their outputs
    come back on its own socket (common/request_ids.py). Create it on the thread that runs the event loop
    (its busy time is that thread's CPU time), and `start()` it inside that loop."""

    def __init__(
        self,
        endpoints: Endpoints,
        index: int,
        num_frontends: int,
        num_tokenizers: int,
        limits: EngineLimits,
        roles: list[str],
        profiler: ProcessProfiler | None = None,
        replicas: EngineReplicas | None = None,
    ):
        """`replicas`: as the launcher knows them at start (default: one per scheduler in `roles`, all serving)."""
        self.limits = limits
        self.role = frontend_role(index)
        self.stats_sources = {}
        self.activity = EventLoopStats()
        self._endpoints = endpoints
        self._profiler = profiler
        self._roles = [role for role in roles if role != self.role]
        self.replicas = replicas or EngineReplicas(sum(1 for role in roles if is_scheduler_role(role)))
        self._num_tokenizers = num_tokenizers
        self._rids = request_ids(index, num_frontends)
        self._streams: dict[int, RequestStream] = {}
        self._ctx = zmq.asyncio.Context.instance()
        self._to_tokenizers = [push_socket(self._ctx, endpoints.tokenizer_requests(i)) for i in range(num_tokenizers)]
        self._outputs = pull_socket(self._ctx, endpoints.frontend_outputs(index))
        self._control_out = {role: push_socket(self._ctx, endpoints.control(role)) for role in self._roles}
        self._control_in = pull_socket(self._ctx, endpoints.control_replies(self.role))
        self._control_seq = itertools.count(1)
        self._control_waiters: dict[int, tuple[asyncio.Future, dict]] = {}
        self._control_server: ControlServer | None = None
        self._tasks: list[asyncio.Task] = []
        self._stopping: str | None = None  # set once the frontend stops: later requests are refused at once
        self.event_loop = ""  # the running loop's kind, set by start()
        self.http_parser = ""  # the frontend's HTTP parser, "httptools" or "h11" (frontend/http_protocol.py)

    @property
    def roles(self) -> list[str]:
        return list(self._roles)

    def start(self) -> None:
        """Start the receive loops and answer this process's control socket; call from inside the event loop."""
        progress = LoopProgress()  # the event loop's turns, for the launcher's watchdog
        self._tasks = [
            asyncio.create_task(self._receive_outputs()),
            asyncio.create_task(self._receive_control()),
            asyncio.create_task(tick_event_loop(progress)),
        ]
        loop = asyncio.get_running_loop()
        self.event_loop = type(loop).__module__.partition(".")[0]  # "uvloop" or "asyncio"
        self._control_server = ControlServer(
            self._endpoints,
            self.role,
            stats=self.stats,
            on_command=lambda request: loop.call_soon_threadsafe(self._answer_command, request),
            progress=progress,
        )

    def stats(self) -> dict:
        # requests_open: requests this frontend still routes outputs to. Every way a request ends (finished,
        # refused, aborted by its client, timed out, failed at shutdown) removes it: at rest this is 0.
        extra = {key: source() for key, source in self.stats_sources.items()}
        return {
            **self.activity.summary(),
            "requests_open": len(self._streams),
            "event_loop": self.event_loop,
            "http_parser": self.http_parser,
            **extra,
        }

    async def submit(self, request: EngineRequest) -> RequestStream:
        request.rid = next(self._rids)
        message = self.activity.sockets.encode(request)  # first: a request that cannot be encoded leaves no stream
        stream = RequestStream(request.rid, self)
        if self._stopping is not None:
            stream.put(RequestRejected(request.rid, SERVER_STOPPING, self._stopping))
            return stream
        self._streams[request.rid] = stream
        await self._tokenizer_for(request.rid).send(message, copy=False)
        return stream

    def fail_open_streams(self, message: str) -> None:
        self._stopping = message
        streams, self._streams = self._streams, {}
        for rid, stream in streams.items():
            stream.put(RequestRejected(rid, SERVER_STOPPING, message))

    async def abort(self, rid: int) -> None:
        if self._streams.pop(rid, None) is not None:
            await self._tokenizer_for(rid).send(self.activity.sockets.encode(AbortRequest(rid)), copy=False)

    def _tokenizer_for(self, rid: int) -> zmq.asyncio.Socket:
        # A request keeps one tokenizer worker for its life: its incremental detokenizer lives there.
        return self._to_tokenizers[tokenizer_of(rid, self._num_tokenizers)]

    async def _receive_outputs(self) -> None:
        while True:
            message = self.activity.sockets.decode(await self._outputs.recv())
            if isinstance(message, OutputBatch):
                # streamed_time is stamped when the HTTP layer hands an output to its client (generation.py).
                for output in message.outputs():
                    self._deliver(output.rid, output, final=output.finish_reason is not None)
            else:
                self._deliver(message.rid, message, final=is_final(message))

    def _deliver(self, rid: int, event: Event, final: bool) -> None:
        stream = self._streams.pop(rid, None) if final else self._streams.get(rid)
        if stream is not None:  # None: aborted by the client, late events are dropped
            stream.put(event)

    async def control(self, kind: str, args: dict | None = None, timeout: float = 5.0) -> dict[str, ControlReply]:
        seq = next(self._control_seq)
        future: asyncio.Future = asyncio.get_running_loop().create_future()
        replies: dict[str, ControlReply] = {}
        self._control_waiters[seq] = (future, replies)
        if not self._roles:
            future.set_result(None)
        for role in list(self._roles):
            await self._control_out[role].send(encode(ControlRequest(kind, seq, args or {}, self.role)), copy=False)
        try:
            await asyncio.wait_for(future, timeout)
        except asyncio.TimeoutError:
            pass
        finally:
            self._control_waiters.pop(seq, None)
        return replies

    async def _receive_control(self) -> None:
        while True:
            reply: ControlReply = decode(await self._control_in.recv())
            waiter = self._control_waiters.get(reply.seq)
            if waiter is None:
                continue  # late reply to a request that timed out
            future, replies = waiter
            replies[reply.role] = reply
            if len(replies) == len(self._roles) and not future.done():
                future.set_result(None)

    def _answer_command(self, request: ControlRequest) -> None:
        """A profiling command from another process (another frontend's /start_profile, the scheduler's
        --profile-steps window), or the launcher's word that an engine replica failed; run on the event loop's
        thread."""
        if request.kind == REPLICA_FAILED:
            self._take_out(ReplicaFailure.from_request(request))
            return
        if request.kind == REPLICA_JOINED:
            self._take_in(ReplicaJoined.from_request(request))
            return
        payload = self._profiler.answer(request.kind) if self._profiler is not None else {"error": NOT_ENABLED}
        self._control_server.reply(request, payload)

    def _take_out(self, failure: ReplicaFailure) -> None:
        """The failed replica's processes are gone: asked anything, they would only make the asker wait out its
        timeout. (Its requests are ended by the tokenizer workers, which know where each one went.)"""
        self.replicas = self.replicas.without(failure)
        self._roles = [role for role in self._roles if role not in failure.roles]

    def _take_in(self, joined: ReplicaJoined) -> None:
        """A headless node's replica serves (again): its processes answer /health and /stats from now on."""
        self.replicas = self.replicas.joined(joined)
        for role in joined.roles:
            if role not in self._control_out:
                self._control_out[role] = push_socket(self._ctx, self._endpoints.control(role))
            if role not in self._roles:
                self._roles.append(role)

    async def close(self) -> None:
        for task in self._tasks:
            task.cancel()
