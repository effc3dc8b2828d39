"""A frontend process: uvicorn serving the HTTP app on the listening socket the launcher shares with every
frontend, and the engine client that carries its requests to the tokenizer workers.

    launcher ── bound socket, FrontendSpec ──▶ frontend[k] ── accepts connections on the shared socket
                                               frontend[k] ◀── frontend-{k}-outputs ── tokenizer workers

K frontends (--api-server-count) spread HTTP parsing, validation, JSON encoding and stream writing over K
cores; the kernel hands each new connection to whichever of them accepts it first, so a busy one takes
fewer. A request lives in the frontend that accepted it: its outputs come back there (common/request_ids.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import resource
import signal
import socket
import sys
import threading
from dataclasses import dataclass, field

import uvicorn

from common.control import frontend_role
from common.garbage import freeze_startup_objects
from common.process import announce_ready, exit_child, init_child_process
from common.profiling import ProcessProfiler, ProfileConfig
from common.transport import Endpoints
from frontend.body_parse import GIL_SWITCH_INTERVAL_S
from frontend.engine_client import EngineClient, EngineLimits
from frontend.heap import heap_for_bodies, keep_freed_heap, pre_fault_heap
from frontend.http_protocol import MAX_HEADER_BYTES, ConnectionCap, protocol_class
from frontend.limits import HttpLimits
from frontend.replicas import EngineReplicas
from frontend.stopping import STOPPING, STOPPING_ANSWERED_S, StoppingGate

log = logging.getLogger(__name__)
GRACEFUL_SHUTDOWN_S = 3  # responses get this long to end; the launcher kills what is left after 5 s
GARBAGE_COLLECTION_PERIOD_S = 10.0


@dataclass(frozen=True, slots=True)
class FrontendSpec:
    """What the launcher tells each frontend process."""

    index: int
    count: int
    num_tokenizers: int
    limits: EngineLimits
    roles: list[str]  # every process of the server, frontends included
    api_key: str | None
    log_level: str
    http: HttpLimits = field(default_factory=HttpLimits)
    event_loop: str = "auto"  # "uvloop" | "asyncio" | "auto": uvloop where installed
    http_parser: str = "auto"  # "httptools" | "h11" | "auto": httptools where installed (frontend/http_protocol.py)
    tool_call_parser: str | None = None  # "auto" tool choice's (frontend/tool_calls.py); None: off
    reasoning_parser: str | None = None  # frontend/reasoning.py; None: the thinking is content
    replicas: EngineReplicas = field(default_factory=EngineReplicas)  # every engine replica, and those not serving


def event_loop_runner(choice: str):
    """`asyncio.run` or `uvloop.run`. uvloop: every streamed chunk is a socket write and a few loop callbacks,
    which libuv does in C (on the GPU machine the standard loop's `transport.write` alone was 15 % of a busy
    frontend's time, docs/notes/benchmark-history.md)."""
    if choice == "asyncio":
        return asyncio.run
    try:
        import uvloop
    except ImportError:
        if choice == "uvloop":
            raise
        return asyncio.run
    return uvloop.run


def main(spec: FrontendSpec, sock: socket.socket, run_dir: str, parent_pid: int, profile: ProfileConfig) -> None:
    role = frontend_role(spec.index)
    init_child_process(role, spec.log_level, parent_pid)
    prepare_for_large_bodies(spec.http)
    try:
        event_loop_runner(spec.event_loop)(serve(spec, sock, run_dir, profile))
    except SystemExit:  # SIGTERM from the launcher
        pass
    exit_child()


def prepare_for_large_bodies(limits: HttpLimits) -> None:
    """From the first burst of large request bodies on: the heap their buffers take faulted in at start and kept
    (frontend/heap.py), and the event loop's turn at the GIL soon while the parsing thread reads them
    (frontend/body_parse.py). Call it on the main thread, before the loop runs."""
    if keep_freed_heap():
        pre_fault_heap(heap_for_bodies(limits.max_request_body_bytes))
    sys.setswitchinterval(GIL_SWITCH_INTERVAL_S)


async def serve(spec: FrontendSpec, sock: socket.socket, run_dir: str, profile: ProfileConfig) -> None:
    from frontend.app import build_app
    from frontend.engine_client import ZmqEngineClient

    role = frontend_role(spec.index)
    endpoints = Endpoints(run_dir)
    profiler = ProcessProfiler(profile, role) if profile.dir is not None else None
    client = ZmqEngineClient(
        endpoints, spec.index, spec.count, spec.num_tokenizers, spec.limits, spec.roles, profiler, spec.replicas
    )
    client.start()
    app = build_app(
        client,
        api_key=spec.api_key,
        profiler=profiler,
        limits=spec.http,
        tool_call_parser=spec.tool_call_parser,
        reasoning_parser=spec.reasoning_parser,
    )
    raise_open_file_limit()
    protocol = protocol_class(spec.http_parser)
    protocol.timeout_headers_s = spec.http.timeout_headers_s
    protocol.timeout_body_s = spec.http.timeout_body_s
    client.http_parser = protocol.parser_name
    gate = StoppingGate(ConnectionCap(app, spec.http.max_connections))
    config = uvicorn.Config(
        gate,
        http=protocol,
        log_level=spec.log_level,
        access_log=spec.log_level == "debug",
        timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_S,
        timeout_keep_alive=spec.http.timeout_keep_alive_s,  # type: ignore[arg-type]
        h11_max_incomplete_event_size=MAX_HEADER_BYTES,  # h11's own bound; http_protocol.py counts for httptools
    )
    server = AnnouncingServer(config, lambda: announce_ready(run_dir, role), client, gate)
    collector = asyncio.create_task(collect_request_garbage())
    try:
        await server.serve(sockets=[sock])
    finally:
        collector.cancel()
        await client.close()


def raise_open_file_limit() -> None:
    """Connections are file descriptors: with the common soft limit of 1,024, a thousand idle sockets would
    starve everything else (ZeroMQ's included) before --max-connections could act. The hard limit is ours
    to take."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != hard:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))


async def collect_request_garbage(period_s: float = GARBAGE_COLLECTION_PERIOD_S) -> None:
    """A full collection every `period_s`. Requests and connections leave garbage in reference cycles (an
    asyncio transport refers to itself through a bound method, uvicorn's protocol and h11 state to its
    transport, FastAPI's exit stack per request, a cancelled task's traceback), and it outlives the young
    collections while the request runs. CPython collects its oldest generation only after ten middle ones
    and once a quarter of its size is waiting: in a frontend that is a few full collections an hour, with
    thousands of dead connections waiting in between (docs/notes/benchmark-history.md, the soak). Collected every few
    seconds, that garbage never piles up."""
    while True:
        await asyncio.sleep(period_s)
        gc.collect()


class AnnouncingServer(uvicorn.Server):
    """uvicorn's server, calling `on_listening` once it accepts connections. Told to stop, it ends every open
    stream with an error event and answers every request with a 503 for STOPPING_ANSWERED_S before uvicorn's
    shutdown closes the listening socket (frontend/stopping.py); the graceful wait then ends as soon as the
    responses under way are written."""

    def __init__(self, config: uvicorn.Config, on_listening, client: EngineClient, gate: StoppingGate):
        super().__init__(config)
        self.on_listening = on_listening
        self.client = client
        self.gate = gate
        self._loop: asyncio.AbstractEventLoop | None = None

    async def startup(self, sockets=None) -> None:
        await super().startup(sockets)
        if self.started:
            self._loop = asyncio.get_running_loop()
            freeze_startup_objects()
            self.on_listening()

    def handle_exit(self, sig, frame) -> None:
        if self._loop is None or self.gate.stopping:  # not serving yet, or told twice: uvicorn's own way
            super().handle_exit(sig, frame)
            return
        self.gate.stopping = True
        # A signal handler may run between any two steps of the loop: the rest runs on the loop itself.
        self._loop.call_soon_threadsafe(self._stop_answering_later)

    def _stop_answering_later(self) -> None:
        self.client.fail_open_streams(STOPPING)
        self._loop.call_later(STOPPING_ANSWERED_S, setattr, self, "should_exit", True)

    async def shutdown(self, sockets=None) -> None:
        self.client.fail_open_streams(STOPPING)
        await super().shutdown(sockets)

    @contextlib.contextmanager
    def capture_signals(self):
        # SIGTERM, from the launcher, stops a frontend gracefully; Ctrl-C is the launcher's alone (ignored here
        # since init_child_process), so that no frontend exits before the launcher knows it is stopping.
        if threading.current_thread() is not threading.main_thread():  # a test's server: stopped by its caller
            yield
            return
        previous = signal.signal(signal.SIGTERM, self.handle_exit)
        try:
            yield
        finally:
            signal.signal(signal.SIGTERM, previous)
