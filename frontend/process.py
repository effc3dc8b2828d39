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
import logging
import signal
import socket
from dataclasses import dataclass

import uvicorn

from common.control import frontend_role
from common.process import announce_ready, exit_child, init_child_process
from common.profiling import ProcessProfiler, ProfileConfig
from common.transport import Endpoints
from frontend.engine_client import EngineLimits

log = logging.getLogger(__name__)
GRACEFUL_SHUTDOWN_S = 3  # open streams get this long to end; the launcher kills what is left after 5 s


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


def main(spec: FrontendSpec, sock: socket.socket, run_dir: str, parent_pid: int, profile: ProfileConfig) -> None:
    role = frontend_role(spec.index)
    init_child_process(role, spec.log_level, parent_pid)
    try:
        asyncio.run(serve(spec, sock, run_dir, profile))
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
    app = build_app(client, api_key=spec.api_key, profiler=profiler)
    config = uvicorn.Config(
        app,
        log_level=spec.log_level,
        access_log=spec.log_level == "debug",
        timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_S,
    )
    server = AnnouncingServer(config, lambda: announce_ready(run_dir, role))
    try:
        await server.serve(sockets=[sock])
    finally:
        await client.close()


class AnnouncingServer(uvicorn.Server):
    """uvicorn's server, calling `on_listening` once it accepts connections."""

    def __init__(self, config: uvicorn.Config, on_listening):
        super().__init__(config)
        self.on_listening = on_listening

    async def startup(self, sockets=None) -> None:
        await super().startup(sockets)
        if self.started:
            self.on_listening()

    @contextlib.contextmanager
    def capture_signals(self):
        # SIGTERM, from the launcher, stops a frontend gracefully; Ctrl-C is the launcher's alone (ignored here
        # since init_child_process), so that no frontend exits before the launcher knows it is stopping.
        previous = signal.signal(signal.SIGTERM, self.handle_exit)
        try:
            yield
        finally:
            signal.signal(signal.SIGTERM, previous)
