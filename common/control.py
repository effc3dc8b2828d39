"""The control channel every process answers: health pings, stats, profiling commands.

A thread of its own receives control requests, so a process busy in a long step still answers a ping
(the health check asks "is it alive?", not "is it idle?"). Commands that must run on the process's main
thread (starting or stopping a profiler) are queued for its loop, which answers them when it gets there.
"""

from __future__ import annotations

import os
import queue
import threading
from collections.abc import Callable

import zmq

from common.messages import ControlReply, ControlRequest
from common.transport import Endpoints, pull_socket, push_socket, recv, send

# The launcher process's role. It answers only profiling commands (the --profile-steps window), from its
# event loop (frontend/engine_client.py); /health and /stats need no socket to reach it.
FRONTEND_ROLE = "frontend"


class ControlServer:
    def __init__(self, endpoints: Endpoints, role: str, stats: Callable[[], dict] | None = None):
        self.endpoints = endpoints
        self.role = role
        self.pid = os.getpid()
        self._stats = stats or dict
        self._queued: queue.Queue[ControlRequest] = queue.Queue()
        self._ctx: zmq.Context = zmq.Context.instance()
        self._main_reply_socket: zmq.Socket | None = None
        self._inbox = pull_socket(self._ctx, endpoints.control(role))  # bound now: ready means reachable
        threading.Thread(target=self._serve, name=f"{role}-control", daemon=True).start()

    def _serve(self) -> None:
        replies = push_socket(self._ctx, self.endpoints.control_replies)
        while True:
            try:
                request: ControlRequest = recv(self._inbox)
            except zmq.ContextTerminated:
                return
            if request.kind == "ping":
                send(replies, ControlReply(self.role, self.pid, "ping", request.seq))
            elif request.kind == "stats":
                send(replies, ControlReply(self.role, self.pid, "stats", request.seq, self._stats()))
            else:
                self._queued.put(request)

    def pending(self) -> list[ControlRequest]:
        """Commands for the main thread, in arrival order (call between steps)."""
        out = []
        while True:
            try:
                out.append(self._queued.get_nowait())
            except queue.Empty:
                return out

    def reply(self, request: ControlRequest, payload: dict | None = None) -> None:
        """Answer a queued command, from the main thread."""
        if self._main_reply_socket is None:
            self._main_reply_socket = push_socket(self._ctx, self.endpoints.control_replies)
        send(self._main_reply_socket, ControlReply(self.role, self.pid, request.kind, request.seq, payload or {}))
