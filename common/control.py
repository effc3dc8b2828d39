"""The control channel every process answers: health pings, stats, profiling commands, replica failures.

A thread of its own receives control requests, so a process busy in a long step still answers a ping
(the health check asks "is it alive?", not "is it idle?"); the answer carries how far the main loop has got
(common/loop_progress.py), so the launcher's watchdog also tells a stuck loop from a busy one. Commands that
must run on the process's main thread (starting or stopping a profiler, taking a failed engine replica out:
common/engine_replica.py) are queued for its loop, which answers them when it gets there.

    asker (a frontend, the launcher) ──ControlRequest(reply_to=asker)──▶ control-{role}
    control-replies-{asker} ◀──ControlReply── role              (reply_to "": nobody waits, no reply)
"""

from __future__ import annotations

import os
import threading
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

import zmq

from common.loop_progress import LoopProgress
from common.messages import ControlReply, ControlRequest
from common.transport import Endpoints, pull_socket, push_socket, recv, send

LAUNCHER = "launcher"  # asks for every process's stats at shutdown


def frontend_role(index: int) -> str:
    return f"frontend-{index}"


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
    thread) that hands a main-thread command over to it; without it such commands wait in `pending()`.
    `progress`: the main loop's, reported in every ping reply."""

    def __init__(
        self,
        endpoints: Endpoints,
        role: str,
        stats: Callable[[], dict] | None = None,
        on_command: Callable[[ControlRequest], None] | None = None,
        progress: LoopProgress | None = None,
    ):
        self.endpoints = endpoints
        self.role = role
        self.pid = os.getpid()
        self._stats = stats or dict
        self._progress = progress
        self._on_command = on_command
        # A deque (appends and pops are atomic): the main loop looks here every turn, and a GPU worker turns
        # every few microseconds while a step runs; an empty queue.Queue cost a lock and a raised Empty each time.
        self._queued: deque[ControlRequest] = deque()
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
                progress = self._progress.report() if self._progress is not None else {}
                replies.send(request.reply_to, ControlReply(self.role, self.pid, "ping", request.seq, progress))
            elif request.kind == "stats":
                replies.send(request.reply_to, ControlReply(self.role, self.pid, "stats", request.seq, self._stats()))
            elif self._on_command is not None:
                self._on_command(request)
            else:
                self._queued.append(request)

    def pending(self) -> list[ControlRequest]:
        """Commands for the main thread, in arrival order (call between steps)."""
        out = []
        while self._queued:
            out.append(self._queued.popleft())
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


@dataclass(frozen=True, slots=True)
class Stuck:
    """A process the watchdog gave up on: `silent` (no answer for `seconds`) or not (it answers, but its loop
    made no progress for `seconds` with work waiting)."""

    role: str
    silent: bool
    seconds: float


@dataclass(slots=True)
class _Heard:
    answered: float  # the last answer's arrival
    progressed: float  # the last answer whose turns had moved, or that had no work waiting
    turns: int | None = None


class Liveness:
    """What the watchdog heard from each process, and its verdicts (plain numbers in, no sockets).

    - Silence (`timeout_s`): the control thread answers even in the middle of a long step, so a role whose last
      answer is older than that is a process that cannot run at all (SIGSTOP, a deadlock holding the
      interpreter, swapped to death): as dead as one that exited. Any silence counts, not only while requests
      are pending: a stopped process also fails /health, and an idle server is the one that would otherwise
      hang its next request.
    - No progress (`iteration_timeout_s`): every answer says how many turns the main loop has made and whether
      it has work waiting (common/loop_progress.py); a role whose turns have not moved for that long while it
      had work waiting is stuck in one turn (a call that never returns, a device step that never ends). An idle
      loop is never stuck: it waits for input (and counts a turn at every wake-up anyway).
    0 turns a check off."""

    def __init__(self, roles: list[str], timeout_s: float, iteration_timeout_s: float, now: float):
        self.timeout_s = timeout_s
        self.iteration_timeout_s = iteration_timeout_s
        self._heard = {role: _Heard(now, now) for role in roles}

    def answered(self, role: str, payload: dict, now: float) -> None:
        heard = self._heard.get(role)
        if heard is None:
            return  # a role forgotten since it was pinged
        heard.answered = now
        turns = payload.get("turns")
        if turns is None or turns != heard.turns or not payload.get("work_waiting"):
            heard.progressed = now  # a process that reports no turns is never stuck by this check
        heard.turns = turns

    def stuck(self, now: float) -> list[Stuck]:
        out = []
        for role, heard in self._heard.items():
            if self.timeout_s and now - heard.answered > self.timeout_s:
                out.append(Stuck(role, True, now - heard.answered))
            elif self.iteration_timeout_s and now - heard.progressed > self.iteration_timeout_s:
                out.append(Stuck(role, False, now - heard.progressed))
        return out

    def forget(self, role: str) -> None:
        self._heard.pop(role, None)


class Watchdog:
    """The launcher's liveness check: `tick()` pings every role, reads the answers that came since, and returns
    the roles it gave up on (Liveness says when)."""

    def __init__(
        self,
        endpoints: Endpoints,
        roles: list[str],
        timeout_s: float,
        clock: Callable[[], float],
        iteration_timeout_s: float = 0.0,
    ):
        ctx: zmq.Context = zmq.Context.instance()
        self._clock = clock
        self.liveness = Liveness(roles, timeout_s, iteration_timeout_s, clock())
        self._inbox = pull_socket(ctx, endpoints.control_replies(WATCHDOG))
        self._outs = {role: push_socket(ctx, endpoints.control(role)) for role in roles}
        self._seq = 0

    def tick(self) -> list[Stuck]:
        while self._inbox.poll(0):
            reply: ControlReply = recv(self._inbox)
            self.liveness.answered(reply.role, reply.payload, self._clock())
        self._seq += 1
        for out in self._outs.values():
            send(out, ControlRequest("ping", self._seq, {}, WATCHDOG))
        return self.liveness.stuck(self._clock())

    def forget(self, roles: list[str]) -> None:
        """Stop watching `roles` (the processes of a failed engine replica, stopped by the launcher)."""
        for role in roles:
            self.liveness.forget(role)
            out = self._outs.pop(role, None)
            if out is not None:
                out.close(linger=0)

    def close(self) -> None:
        for sock in [self._inbox, *self._outs.values()]:
            sock.close(linger=0)
