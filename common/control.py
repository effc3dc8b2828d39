"""The control channel every process answers: health pings, stats, profiling commands.

A thread of its own receives control requests, so a process busy in a long step still answers a ping
(the health check asks "is it alive?", not "is it idle?"). Commands that must run on the process's main
thread (starting or stopping a profiler) are queued for its loop, which answers them when it gets there.

    asker (a frontend, the launcher) ──ControlRequest(reply_to=asker)──▶ control-{role}
    control-replies-{asker} ◀──ControlReply── role              (reply_to "": nobody waits, no reply)
"""

from __future__ import annotations

import os
import queue
import threading
from collections.abc import Callable

import zmq

from common.messages import ControlReply, ControlRequest
from common.transport import Endpoints, pull_socket, push_socket, recv, send

LAUNCHER = "launcher"  # asks for every process's stats at shutdown


def frontend_role(index: int) -> str:
    return f"frontend-{index}"


def gpu_worker_role(rank: int) -> str:
    """Tensor-parallel rank 0 is the GPU worker the scheduler talks to; the others follow it."""
    return "gpu_worker" if rank == 0 else f"gpu_worker-rank{rank}"


class ReplySockets:
    """One PUSH socket per asker, made on first use. ZeroMQ sockets belong to one thread: one of these each."""

    def __init__(self, ctx: zmq.Context, endpoints: Endpoints):
        self._ctx = ctx
        self._endpoints = endpoints
        self._sockets: dict[str, zmq.Socket] = {}

    def send(self, asker: str, reply: ControlReply) -> None:
        if not asker:
            return  # nobody waits for this answer
        sock = self._sockets.get(asker)
        if sock is None:
            sock = self._sockets[asker] = push_socket(self._ctx, self._endpoints.control_replies(asker))
        send(sock, reply)


class ControlServer:
    """`on_command`: for a process whose main thread is an event loop, a callable (invoked on the control
    thread) that hands a main-thread command over to it; without it such commands wait in `pending()`."""

    def __init__(
        self,
        endpoints: Endpoints,
        role: str,
        stats: Callable[[], dict] | None = None,
        on_command: Callable[[ControlRequest], None] | None = None,
    ):
        self.endpoints = endpoints
        self.role = role
        self.pid = os.getpid()
        self._stats = stats or dict
        self._on_command = on_command
        self._queued: queue.Queue[ControlRequest] = queue.Queue()
        self._ctx: zmq.Context = zmq.Context.instance()
        self._main_replies = ReplySockets(self._ctx, endpoints)
        self._inbox = pull_socket(self._ctx, endpoints.control(role))  # bound now: ready means reachable
        threading.Thread(target=self._serve, name=f"{role}-control", daemon=True).start()

    def _serve(self) -> None:
        replies = ReplySockets(self._ctx, self.endpoints)
        while True:
            try:
                request: ControlRequest = recv(self._inbox)
            except zmq.ContextTerminated:
                return
            if request.kind == "ping":
                replies.send(request.reply_to, ControlReply(self.role, self.pid, "ping", request.seq))
            elif request.kind == "stats":
                replies.send(request.reply_to, ControlReply(self.role, self.pid, "stats", request.seq, self._stats()))
            elif self._on_command is not None:
                self._on_command(request)
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
        self._main_replies.send(
            request.reply_to, ControlReply(self.role, self.pid, request.kind, request.seq, payload or {})
        )


def ask_all(endpoints: Endpoints, asker: str, roles: list[str], kind: str, timeout_s: float) -> dict[str, ControlReply]:
    """Send `kind` to every role and collect the answers that come within `timeout_s` (blocking; the
    launcher's way, outside any event loop). Roles that did not answer are missing."""
    import time

    ctx: zmq.Context = zmq.Context.instance()
    inbox = pull_socket(ctx, endpoints.control_replies(asker))
    outs = [push_socket(ctx, endpoints.control(role)) for role in roles]
    try:
        for out in outs:
            send(out, ControlRequest(kind, 1, {}, asker))
        replies: dict[str, ControlReply] = {}
        deadline = time.monotonic() + timeout_s
        while len(replies) < len(roles):
            left_ms = int(1000 * (deadline - time.monotonic()))
            if left_ms <= 0 or not inbox.poll(left_ms):
                break
            reply: ControlReply = recv(inbox)
            replies[reply.role] = reply
        return replies
    finally:
        for sock in [inbox, *outs]:
            sock.close(linger=0)


WATCHDOG = "watchdog"  # the launcher's asker name for liveness pings


class Watchdog:
    """The launcher's liveness check: `tick()` pings every role and reads the answers that came since; a
    role whose last answer is older than `timeout_s` is returned as stuck. The control thread answers even in
    the middle of a long step, so silence means a process that cannot run at all (SIGSTOP, a deadlock
    holding the interpreter, swapped to death): as dead as one that exited. Any silence counts, not only
    while requests are pending: a stopped process also fails /health, and an idle server is the one that
    would otherwise hang its next request."""

    def __init__(self, endpoints: Endpoints, roles: list[str], timeout_s: float, clock: Callable[[], float]):
        ctx: zmq.Context = zmq.Context.instance()
        self.timeout_s = timeout_s
        self._clock = clock
        self._inbox = pull_socket(ctx, endpoints.control_replies(WATCHDOG))
        self._outs = {role: push_socket(ctx, endpoints.control(role)) for role in roles}
        now = clock()
        self._last_answer = dict.fromkeys(roles, now)
        self._seq = 0

    def tick(self) -> list[str]:
        while self._inbox.poll(0):
            reply: ControlReply = recv(self._inbox)
            self._last_answer[reply.role] = self._clock()
        self._seq += 1
        for out in self._outs.values():
            send(out, ControlRequest("ping", self._seq, {}, WATCHDOG))
        now = self._clock()
        return [role for role, seen in self._last_answer.items() if now - seen > self.timeout_s]

    def silent_for(self, role: str) -> float:
        return self._clock() - self._last_answer[role]

    def close(self) -> None:
        for sock in [self._inbox, *self._outs.values()]:
            sock.close(linger=0)
