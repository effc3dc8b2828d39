"""The tokenizer worker's process: its sockets, its loop, its counters.

    frontend[k] ──tokenizer-{i}-requests──▶ ┌───────────────┐ ──scheduler-{r}-requests──▶ scheduler[r]
                                            │ tokenizer[i]  │
    frontend[k] ◀──frontend-{k}-outputs──── └───────────────┘ ◀──tokenizer-{i}-tokens──── every scheduler

A tokenized request goes to the engine replica its router picks (router.py), which it keeps for its life; if
that replica fails, the launcher says so (a ReplicaFailure on the control channel) and the request ends with a
503 `replica_failed`; a replica that joins (a headless node's: ReplicaJoined) is routed to from then on.
Aborts from the frontend go to the scheduler on the socket their request took, so they cannot overtake it.
Outputs go to the frontend that holds the request (rid % K): one OutputBatch per frontend per step.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import zmq

from common.control import ControlServer
from common.engine_replica import (
    NO_REPLICA,
    REPLICA_FAILED,
    REPLICA_FAILED_STATUS,
    REPLICA_JOINED,
    ReplicaFailure,
    ReplicaJoined,
)
from common.garbage import freeze_startup_objects
from common.loop_progress import LoopProgress
from common.messages import (
    AbortRequest,
    DetokenizeRequest,
    GenerateRequest,
    OutputBatch,
    RequestAccepted,
    RequestRejected,
    TokenBatch,
    TokenizedRequest,
    TokenizeRequest,
)
from common.process import announce_ready, exit_child, init_child_process
from common.profiling import ProcessProfiler, ProcessStats, ProfileConfig
from common.request_ids import columns_by_owner, frontend_of
from common.transport import Endpoints, pull_socket, push_socket, send
from tokenizer_worker.background_encoder import BackgroundEncoder, EncodeJob
from tokenizer_worker.router import ReplicaRouter
from tokenizer_worker.tokenizer import Tokenizer
from tokenizer_worker.worker import TokenizerWorker

log = logging.getLogger(__name__)

# An idle loop wakes this often to answer control commands queued for the main thread.
CONTROL_POLL_MS = 100
# Messages taken from one socket before looking at the other, so neither direction starves.
MAX_MESSAGES_PER_TURN = 64


@dataclass(slots=True)
class WorkerStats:
    requests: int = 0
    rejected: int = 0
    aborted: int = 0
    stop_string_aborts: int = 0
    tokens_detokenized: int = 0
    tokenize_s: float = 0.0  # on the loop
    detokenize_s: float = 0.0
    prompts_encoded_off_loop: int = 0  # long prompts handed to the encoding thread


class TokenizerProcess:
    def __init__(
        self,
        index: int,
        tokenizer: Tokenizer,
        endpoints: Endpoints,
        num_frontends: int,
        profile: ProfileConfig,
        router: ReplicaRouter,
    ):
        self.role = f"tokenizer-{index}"
        self.run_dir = endpoints.run_dir
        self.worker = TokenizerWorker(tokenizer)
        self.router = router
        self.stats = WorkerStats()
        self.activity = ProcessStats()
        self.profiler = ProcessProfiler(profile, self.role)
        ctx = zmq.Context.instance()
        self.from_frontend = pull_socket(ctx, endpoints.tokenizer_requests(index))
        self.from_scheduler = pull_socket(ctx, endpoints.tokenizer_tokens(index))
        self.to_schedulers = [push_socket(ctx, endpoints.scheduler_requests(r)) for r in range(len(router.in_flight))]
        self.to_frontends = [push_socket(ctx, endpoints.frontend_outputs(k)) for k in range(num_frontends)]
        self.encoder = BackgroundEncoder(tokenizer.encode_releasing_gil, ctx)
        self.progress = LoopProgress()
        self.control = ControlServer(endpoints, self.role, stats=self.stats_snapshot, progress=self.progress)

    def stats_snapshot(self) -> dict:
        return {
            **self.activity.summary(),
            **dataclasses.asdict(self.stats),
            "active_requests": len(self.worker.requests),
            "prompts_encoding": self.encoder.in_flight,
            "replicas_in_flight": list(self.router.in_flight),
            "replicas_routed": list(self.router.routed),
        }

    def run(self) -> None:
        freeze_startup_objects()
        announce_ready(self.run_dir, self.role)
        log.info("ready: %d ids in the vocabulary", self.worker.tokenizer.vocab_size)
        poller = zmq.Poller()
        poller.register(self.from_scheduler, zmq.POLLIN)
        poller.register(self.from_frontend, zmq.POLLIN)
        poller.register(self.encoder.wake, zmq.POLLIN)
        while True:
            ready = dict(self.progress.idle_wait(poller.poll, CONTROL_POLL_MS))
            with self.activity.busy():
                # Tokens first: they are what clients are waiting on.
                if self.from_scheduler in ready:
                    self._drain(self.from_scheduler, self._on_scheduler_message)
                if self.from_frontend in ready:
                    self._drain(self.from_frontend, self._on_frontend_message)
                if self.encoder.wake in ready:
                    for rid, ids in self.encoder.finished():
                        reply = self.worker.finish_encoding(rid, ids)
                        if reply is not None:  # None: aborted while it was encoded
                            self._forward_tokenized(reply)
                for command in self.control.pending():
                    if command.kind == REPLICA_FAILED:
                        self._on_replica_failed(ReplicaFailure.from_request(command))
                    elif command.kind == REPLICA_JOINED:
                        self.router.add(ReplicaJoined.from_request(command).replica)
                    else:
                        self.control.reply(command, self.profiler.answer(command.kind))

    def close(self) -> None:
        self.encoder.close()
        for sock in (self.from_frontend, self.from_scheduler, *self.to_schedulers, *self.to_frontends):
            sock.close(linger=0)

    # ------------------------------------------------------------------ messages

    def _on_frontend_message(self, message: Any) -> None:
        if isinstance(message, GenerateRequest):
            started = time.perf_counter()
            reply = self.worker.add_request(message)
            self.stats.tokenize_s += time.perf_counter() - started
            if isinstance(reply, EncodeJob):
                self.stats.prompts_encoded_off_loop += 1
                self.encoder.submit(reply)
            else:
                self._forward_tokenized(reply)
        elif isinstance(message, (TokenizeRequest, DetokenizeRequest)):
            self._send(self._frontend_of(message.rid), self.worker.answer_text_request(message))
        elif isinstance(message, AbortRequest):
            if self.worker.drop(message.rid):  # untracked: it already ended, the scheduler has let it go
                self.stats.aborted += 1
                self._send(self._scheduler_of(message.rid), message)
                self.router.release(message.rid)
        else:
            log.warning("unexpected %s from the frontend, dropped", type(message).__name__)

    def _forward_tokenized(self, reply: TokenizedRequest | RequestRejected) -> None:
        if isinstance(reply, RequestRejected):
            self.stats.rejected += 1
            self._send(self._frontend_of(reply.rid), reply)
        elif not self.router.serving:  # every replica is on a node that is lost or has not joined (yet)
            self.worker.drop(reply.rid)
            message = "no engine replica is serving: the nodes that serve them have not joined, or were lost"
            self._send(
                self._frontend_of(reply.rid),
                RequestRejected(reply.rid, REPLICA_FAILED_STATUS, message, code=NO_REPLICA),
            )
        else:
            self.stats.requests += 1
            replica = self.router.route(reply.rid, reply.prompt_token_ids, reply.cache_salt)
            self._send(self.to_schedulers[replica], reply)

    def _on_scheduler_message(self, message: Any) -> None:
        if isinstance(message, TokenBatch):
            started = time.perf_counter()
            outputs, aborts = self.worker.process_tokens(message)
            self.stats.detokenize_s += time.perf_counter() - started
            self.stats.tokens_detokenized += len(outputs.token_ids)
            self.stats.stop_string_aborts += len(aborts)
            for abort in aborts:
                self._send(self._scheduler_of(abort.rid), abort)
            for rid in outputs.finish_reasons:
                self.router.release(rid)
            if outputs.rids:
                for index, part in split_by_frontend(outputs, len(self.to_frontends)).items():
                    self._send(self.to_frontends[index], part)
        elif isinstance(message, RequestAccepted):
            self._send(self._frontend_of(message.rid), message)
        elif isinstance(message, RequestRejected):
            self.worker.drop(message.rid)
            self.router.release(message.rid)
            self._send(self._frontend_of(message.rid), message)
        else:
            log.warning("unexpected %s from the scheduler, dropped", type(message).__name__)

    def _on_replica_failed(self, failure: ReplicaFailure) -> None:
        """End every request routed to the failed replica (its client gets the error now, not silence), and
        route nothing more there. Its late messages, if any, are for requests no longer tracked: dropped."""
        rids = self.router.remove(failure.replica)
        log.warning("engine replica %d failed (%s): ending its %d requests", failure.replica, failure.reason, len(rids))
        for rid in rids:
            self.worker.drop(rid)
            rejection = RequestRejected(rid, REPLICA_FAILED_STATUS, failure.client_message(), code=REPLICA_FAILED)
            self._send(self._frontend_of(rid), rejection)

    # ------------------------------------------------------------------ sockets

    def _scheduler_of(self, rid: int) -> zmq.Socket:
        """The scheduler of the replica that holds a tracked request (routed when it was tokenized)."""
        replica = self.router.owner(rid)
        assert replica is not None, f"request {rid} is tracked but was never routed"
        return self.to_schedulers[replica]

    def _frontend_of(self, rid: int) -> zmq.Socket:
        return self.to_frontends[frontend_of(rid, len(self.to_frontends))]

    def _drain(self, sock: zmq.Socket, handle: Callable[[Any], None]) -> None:
        for _ in range(MAX_MESSAGES_PER_TURN):
            try:
                data = sock.recv(zmq.NOBLOCK)
            except zmq.Again:
                return
            try:
                message = self.activity.sockets.decode(data)
            except ValueError as exc:  # WireError, or msgpack's own errors: not one of our messages
                log.warning("undecodable message dropped: %s", exc)
                continue
            handle(message)

    def _send(self, sock: zmq.Socket, message: Any) -> None:
        send(sock, message, self.activity.sockets)


def split_by_frontend(batch: OutputBatch, num_frontends: int) -> dict[int, OutputBatch]:
    """The batch's entries grouped by the frontend that holds each request (request_ids.frontend_of), each group in
    the batch's order: one message per frontend per step. The batch itself when one frontend holds them all."""
    if num_frontends == 1:
        return {0: batch}
    owners = [frontend_of(rid, num_frontends) for rid in batch.rids]
    parts = {
        index: OutputBatch(batch.sampled_time, batch.detokenized_time, rids, texts, tokens)
        for index, (rids, texts, tokens) in columns_by_owner(owners, batch.rids, batch.texts, batch.token_ids).items()
    }
    for rid, reason in batch.finish_reasons.items():
        parts[frontend_of(rid, num_frontends)].finish_reasons[rid] = reason
    for extra in batch.extras:
        parts[frontend_of(extra.rid, num_frontends)].extras.append(extra)
    return parts


def main(
    index: int,
    model_folder: str,
    num_frontends: int,
    run_dir: str,
    log_level: str,
    parent_pid: int,
    profile: ProfileConfig = ProfileConfig(),
    chat_template: str | None = None,
    num_replicas: int = 1,
    block_size: int = 16,
    serving: list[int] | None = None,
) -> None:
    """Entry point of tokenizer worker `index`, started by the launcher with the spawn context; `chat_template`:
    the --chat-template's text, for chat requests instead of the tokenizer's own; `num_replicas`: the engine
    replicas it routes requests to, whose KV blocks hold `block_size` tokens; `serving`: those that serve from the
    start (default: all; a headless node's join later)."""
    init_child_process(f"tokenizer-{index}", log_level, parent_pid)
    process: TokenizerProcess | None = None
    try:
        tokenizer = Tokenizer.load(model_folder, chat_template)
        router = ReplicaRouter(num_replicas, block_size, serving=serving)
        process = TokenizerProcess(index, tokenizer, Endpoints(run_dir), num_frontends, profile, router)
        process.run()
    except SystemExit:  # SIGTERM from the launcher
        pass
    finally:
        if process is not None:
            process.close()
    exit_child()
