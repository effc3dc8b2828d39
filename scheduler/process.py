"""The scheduler process: admits requests, plans steps, and keeps the GPU busy with one plan queued ahead.

    tokenizers ──TokenizedRequest/AbortRequest──▶ [PULL scheduler-{r}-requests]
    [PUSH worker-{r}-plans] ──StepPlan──▶ gpu_worker[r] ──StepResult──▶ [PULL scheduler-{r}-results]
    [PUSH tokenizer-{i}-tokens] ──RequestAccepted/Rejected, TokenBatch──▶ tokenizer[rid % N]
    grammars ──jobs──▶ compile worker (this process's child: compile_worker.py) ──▶ doorbell, polled with the sockets

r: the engine replica this scheduler belongs to (common/engine_replica.py); it knows no other replica.

Overlap: plan N+1 is sent before result N is read, so the worker starts step N+1 the moment it finishes
N, while the scheduler processes N's tokens and streams them. Hence at most PIPELINE_DEPTH plans are
outstanding (common/pipeline.py); the scheduler's request state is written so that this is safe (see
scheduler.py).
"""

from __future__ import annotations

import logging
import time

import zmq

from common.config import EngineConfig
from common.control import ControlServer, frontend_role
from common.engine_replica import EngineReplica
from common.garbage import freeze_startup_objects
from common.loop_progress import LoopProgress
from common.messages import (
    AbortRequest,
    StepResult,
    TokenBatch,
    TokenizedRequest,
    WorkerLimits,
)
from common.model_info import ModelInfo
from common.pipeline import PIPELINE_DEPTH
from common.process import announce_ready, exit_child, init_child_process
from common.profiling import ProcessProfiler, ProcessStats, ProfileConfig
from common.request_ids import columns_by_owner, tokenizer_of
from common.transport import Endpoints, pull_socket, push_socket, recv, send
from scheduler.scheduler import Scheduler
from scheduler.step_observer import ProfileWindow, SchedulerObserver

IDLE_POLL_MS = 100
log = logging.getLogger("scheduler")


def main(
    config: EngineConfig,
    info: ModelInfo,
    limits: WorkerLimits,
    num_tokenizers: int,
    num_frontends: int,
    run_dir: str,
    log_level: str,
    parent_pid: int,
    profile: ProfileConfig = ProfileConfig(),
    replica: EngineReplica = EngineReplica(),
) -> None:
    """limits: as the engine replica's GPU worker decided them (its WorkerReady)."""
    init_child_process(replica.scheduler_role, log_level, parent_pid)
    scheduler = Scheduler(config, info, limits)
    # The compile worker prepares the vocabulary now, not for the first grammar, and while the server serves: a
    # structured request that comes first waits for it (its compile timeout not yet counting, its wait bound counting),
    # nobody else does.
    scheduler.grammars.start()
    loop = SchedulerLoop(scheduler, Endpoints(run_dir), num_tokenizers, profile, num_frontends, replica)
    freeze_startup_objects()
    announce_ready(run_dir, replica.scheduler_role)
    try:
        loop.run()
    except SystemExit:
        pass
    exit_child()


class SchedulerLoop:
    def __init__(
        self,
        scheduler: Scheduler,
        endpoints: Endpoints,
        num_tokenizers: int,
        profile: ProfileConfig = ProfileConfig(),
        num_frontends: int = 1,
        replica: EngineReplica = EngineReplica(),
    ):
        self.scheduler = scheduler
        self.endpoints = endpoints
        role = replica.scheduler_role
        ctx: zmq.Context = zmq.Context.instance()
        self.requests = pull_socket(ctx, endpoints.scheduler_requests(replica.index))
        self.results = pull_socket(ctx, endpoints.scheduler_results(replica.index))
        self.plans = push_socket(ctx, endpoints.worker_plans(replica.index))
        self.tokenizers = [push_socket(ctx, endpoints.tokenizer_tokens(i)) for i in range(num_tokenizers)]
        self.progress = LoopProgress()
        self.control = ControlServer(endpoints, role, stats=self.stats, progress=self.progress)
        self.activity = ProcessStats()
        self.profiler = ProcessProfiler(profile, role)
        window = None
        if profile.steps:
            others: list[str] = []
            if replica.index == 0:  # every replica profiles its own window; replica 0 alone tells the others
                others = [f"tokenizer-{i}" for i in range(num_tokenizers)]
                others += [frontend_role(k) for k in range(num_frontends)]
            window = ProfileWindow(profile.steps, self.profiler, endpoints, others)
        self.observer = SchedulerObserver(scheduler, self.profiler, window)  # profiling, the step chain
        self.in_flight = 0
        self.last_log = 0.0

    def run(self) -> None:
        poller = zmq.Poller()
        poller.register(self.requests, zmq.POLLIN)
        poller.register(self.results, zmq.POLLIN)
        doorbell = self.scheduler.grammars.doorbell  # rung when a grammar is compiled (scheduler/grammars.py)
        if doorbell is not None:
            poller.register(doorbell, zmq.POLLIN)
        while True:
            for command in self.control.pending():
                self.control.reply(command, self.profiler.answer(command.kind))
            # Wait (idle) for whichever comes first: a step's result, or new requests. Requests arriving
            # while a step runs are queued (and answered) at once, ready for the next plan.
            ready = dict(self.progress.idle_wait(poller.poll, IDLE_POLL_MS))
            with self.activity.busy():
                outputs = self._drain_results() if self.results in ready else []
                if self.requests in ready:
                    self._drain_requests()
                if doorbell in ready or self.scheduler.grammars.overdue():
                    for verdict in self.scheduler.take_grammar_verdicts():
                        send(self._tokenizer_of(verdict.rid), verdict, self.activity.sockets)
                # The next plan before the tokens stream out: the worker may be about to run out of plans,
                # and nobody notices the tokens a fraction of a millisecond later.
                self._send_plans()
                self.observer.wake_up_done()  # no later plan answers this wake-up's results
                self._stream(outputs)
                self.scheduler.top_up_free_blocks()  # for the next plan, off its chain
            self._maybe_log()

    def _drain_results(self) -> list[TokenBatch]:
        """Every result that has arrived, processed; the tokens they produced, to stream."""
        batches: list[TokenBatch] = []
        while self.in_flight:
            try:
                result: StepResult = recv(self.results, zmq.NOBLOCK, stats=self.activity.sockets)
            except zmq.Again:
                break
            self.in_flight -= 1
            self.observer.before_result(result)
            batches.append(self.scheduler.process_result(result))
            self.observer.after_result(result)
        return batches

    def _send_plans(self) -> None:
        while self.in_flight < PIPELINE_DEPTH:
            self.observer.before_plan()
            plan = self.scheduler.schedule(ahead=self.in_flight > 0)
            if plan is None:
                break
            self.observer.on_plan(plan)
            plan.sent_time = time.time()
            send(self.plans, plan, self.activity.sockets)
            self.observer.after_plan(plan)
            if log.isEnabledFor(logging.DEBUG):
                s = self.scheduler.stats
                log.debug(
                    "step %d: %d prefill + %d decode tokens, %d admitted, %d running, %d finishing, %d waiting",
                    plan.step_id,
                    s.last_step_prefill_tokens,
                    s.last_step_decode_tokens,
                    len(plan.new_requests),
                    len(self.scheduler.running),
                    len(self.scheduler.finishing),
                    len(self.scheduler.waiting),
                )
            self.in_flight += 1

    def _drain_requests(self) -> None:
        while True:
            try:
                message = recv(self.requests, zmq.NOBLOCK, self.activity.sockets)
            except zmq.Again:
                return
            if isinstance(message, TokenizedRequest):
                verdict = self.scheduler.add_request(message)
                if verdict is not None:  # None: its grammar is being compiled; the verdict comes with it
                    send(self._tokenizer_of(message.rid), verdict, self.activity.sockets)
            elif isinstance(message, AbortRequest):
                # The tokenizer worker already ended the request for its client; only the blocks remain.
                self.scheduler.abort_request(message.rid, message.reason)

    def _stream(self, batches: list[TokenBatch]) -> None:
        for batch in batches:
            if not batch.rids:
                continue
            for index, part in split_by_tokenizer(batch, len(self.tokenizers)).items():
                send(self.tokenizers[index], part, self.activity.sockets)

    def _tokenizer_of(self, rid: int) -> zmq.Socket:
        return self.tokenizers[tokenizer_of(rid, len(self.tokenizers))]

    def _maybe_log(self) -> None:
        now = time.time()
        if now - self.last_log < 10 or not self.scheduler.has_unfinished():
            return
        self.last_log = now
        s = self.scheduler.stats
        log.info(
            "running %d, waiting %d, KV blocks free %d/%d, last step %d prefill + %d decode tokens, "
            "prefix cache hit rate %.1f%%, preemptions %d",
            len(self.scheduler.running),
            len(self.scheduler.waiting),
            self.scheduler.blocks.num_free,
            self.scheduler.blocks.num_blocks,
            s.last_step_prefill_tokens,
            s.last_step_decode_tokens,
            100 * s.cache_hit_rate,
            s.preemptions,
        )

    def stats(self) -> dict:
        return {**self.activity.summary(), **self.scheduler.snapshot().to_payload(), **self.observer.stats()}


def split_by_tokenizer(batch: TokenBatch, num_tokenizers: int) -> dict[int, TokenBatch]:
    """The batch's entries grouped by the tokenizer worker that owns each request (request_ids.tokenizer_of),
    each group in the batch's order; the batch itself when one worker owns them all."""
    if num_tokenizers == 1:
        return {0: batch}
    owners = [tokenizer_of(rid, num_tokenizers) for rid in batch.rids]
    parts = {
        index: TokenBatch(batch.sampled_time, rids, tokens)
        for index, (rids, tokens) in columns_by_owner(owners, batch.rids, batch.token_ids).items()
    }
    for rid, reason in batch.finish_reasons.items():
        parts[tokenizer_of(rid, num_tokenizers)].finish_reasons[rid] = reason
    for first in batch.firsts:
        parts[tokenizer_of(first.rid, num_tokenizers)].firsts.append(first)
    for item in batch.logprobs:
        parts[tokenizer_of(item.rid, num_tokenizers)].logprobs.append(item)
    return parts
