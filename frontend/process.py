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
from dataclasses import dataclass, field

import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

from common.control import frontend_role
from common.garbage import freeze_startup_objects
from common.process import announce_ready, exit_child, init_child_process
from common.profiling import ProcessProfiler, ProfileConfig
from common.transport import Endpoints
from frontend.engine_client import EngineClient, EngineLimits
from frontend.limits import HttpLimits

log = logging.getLogger(__name__)
GRACEFUL_SHUTDOWN_S = 3  # responses get this long to end; the launcher kills what is left after 5 s
MAX_HEADER_BYTES = 64 * 1024  # a request's line and headers; more: 400 and the connection closed (h11)
STOPPING = "the server is stopping"
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


def event_loop_runner(choice: str):
    """`asyncio.run` or `uvloop.run`. uvloop: every streamed chunk is a socket write and a few loop callbacks,
    which libuv does in C (on the GPU machine the standard loop's `transport.write` alone was 15 % of a busy
    frontend's time, docs/benchmarks.md)."""
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
    try:
        event_loop_runner(spec.event_loop)(serve(spec, sock, run_dir, profile))
    except SystemExit:  # SIGTERM from the launcher
        pass
    exit_child()


async def serve(spec: FrontendSpec, sock: socket.socket, run_dir: str, profile: ProfileConfig) -> None:
    from frontend.app import build_app
    from frontend.engine_client import ZmqEngineClient

    role = frontend_role(spec.index)
    endpoints = Endpoints(run_dir)
    profiler = ProcessProfiler(profile, role) if profile.dir is not None else None
    client = ZmqEngineClient(endpoints, spec.index, spec.count, spec.num_tokenizers, spec.limits, spec.roles, profiler)
    client.start()
    app = build_app(client, api_key=spec.api_key, profiler=profiler, limits=spec.http)
    raise_open_file_limit()
    ReadDeadlineProtocol.timeout_headers_s = spec.http.timeout_headers_s
    ReadDeadlineProtocol.timeout_body_s = spec.http.timeout_body_s
    config = uvicorn.Config(
        app,
        http=ReadDeadlineProtocol,
        log_level=spec.log_level,
        access_log=spec.log_level == "debug",
        timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_S,
        limit_concurrency=spec.http.max_connections,
        timeout_keep_alive=spec.http.timeout_keep_alive_s,  # type: ignore[arg-type]
        h11_max_incomplete_event_size=MAX_HEADER_BYTES,
    )
    server = AnnouncingServer(config, lambda: announce_ready(run_dir, role), client)
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
    thousands of dead connections waiting in between (docs/benchmarks.md, the soak). Collected every few
    seconds, that garbage never piles up."""
    while True:
        await asyncio.sleep(period_s)
        gc.collect()


class ReadDeadlineProtocol(H11Protocol):
    """uvicorn's HTTP/1.1 protocol, plus deadlines for reading a request, so that a client that trickles its
    bytes (slowloris) or stops sending cannot hold a socket, or a task waiting on a body, forever:

        connection opened, or the previous response ended ── timeout_headers_s ──▶ the request's headers
        the request's headers ───────────────────────────── timeout_body_s ────▶ the end of its body

    A deadline missed closes the connection (an app waiting on the body sees the client leave). Idle
    keep-alive connections are uvicorn's own timeout_keep_alive."""

    timeout_headers_s = 10.0
    timeout_body_s = 30.0
    _read_deadline: asyncio.TimerHandle | None = None
    _body_clock_of: object = None  # the request cycle whose body the deadline is timing

    def connection_made(self, transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm_read_deadline(self.timeout_headers_s)

    def data_received(self, data: bytes) -> None:
        if self._read_deadline is None and self._waiting_for_headers():
            self._arm_read_deadline(self.timeout_headers_s)  # a keep-alive connection's next request: its own clock
        super().data_received(data)
        if self._reading_body():
            if self._body_clock_of is not self.cycle:  # a request whose headers are in: its body's clock starts
                self._body_clock_of = self.cycle
                self._arm_read_deadline(self.timeout_body_s)
        elif not self._waiting_for_headers():
            self._disarm_read_deadline()  # the request is read whole

    def on_response_complete(self) -> None:
        self._disarm_read_deadline()
        super().on_response_complete()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm_read_deadline()
        super().connection_lost(exc)

    def _waiting_for_headers(self) -> bool:
        return self.cycle is None or self.cycle.response_complete

    def _reading_body(self) -> bool:
        return self.cycle is not None and self.cycle.more_body and not self.cycle.response_complete

    def _arm_read_deadline(self, seconds: float) -> None:
        self._disarm_read_deadline()
        self._read_deadline = self.loop.call_later(seconds, self._read_late)

    def _disarm_read_deadline(self) -> None:
        if self._read_deadline is not None:
            self._read_deadline.cancel()
            self._read_deadline = None

    def _read_late(self) -> None:
        self._read_deadline = None
        if (self._waiting_for_headers() or self._reading_body()) and not self.transport.is_closing():
            self.transport.close()


class AnnouncingServer(uvicorn.Server):
    """uvicorn's server, calling `on_listening` once it accepts connections; on shutdown, it ends every
    open stream with an error event first, so the graceful wait ends as soon as those are written."""

    def __init__(self, config: uvicorn.Config, on_listening, client: EngineClient):
        super().__init__(config)
        self.on_listening = on_listening
        self.client = client

    async def startup(self, sockets=None) -> None:
        await super().startup(sockets)
        if self.started:
            freeze_startup_objects()
            self.on_listening()

    async def shutdown(self, sockets=None) -> None:
        self.client.fail_open_streams(STOPPING)
        await super().shutdown(sockets)

    @contextlib.contextmanager
    def capture_signals(self):
        # SIGTERM, from the launcher, stops a frontend gracefully; Ctrl-C is the launcher's alone (ignored here
        # since init_child_process), so that no frontend exits before the launcher knows it is stopping.
        previous = signal.signal(signal.SIGTERM, self.handle_exit)
        try:
            yield
        finally:
            signal.signal(signal.SIGTERM, previous)
