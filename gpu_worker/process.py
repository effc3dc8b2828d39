"""The GPU worker process: build the worker (builder.py: model, KV store, limits, graphs, warm-up), announce it
(WorkerReady), then run plans in order.

scheduler[r] ──StepPlan──▶ [PULL worker-{r}-plans] ─ execute ─ [PUSH scheduler-{r}-results] ──StepResult──▶ scheduler[r]

r: the engine replica (common/engine_replica.py). With --tensor-parallel-size N, N of these processes are one
torch.distributed group (gpu_worker/parallel.py), each on its own device with its share of the model. Rank 0
("gpu_worker", or "gpu_worker-{r}" among replicas) is the one the scheduler knows; it relays each plan's bytes,
as received, to ranks 1..N-1 ("gpu_worker-rank{t}", "gpu_worker-{r}-rank{t}") before running it. Every rank
runs every plan and samples the same tokens (all of them need them, for their device's last-token slots);
only rank 0 sends StepResults:

    scheduler ──▶ gpu_worker ─┬─ worker-0-plans-rank1 ──▶ gpu_worker-rank1   (collectives in each forward)
        ▲             │       └─ worker-0-plans-rank2 ──▶ gpu_worker-rank2
        └─StepResult──┘

On CUDA, replica r's rank t runs on cuda:(r·N + t).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass

import zmq

from common.config import EngineConfig
from common.control import ControlServer
from common.engine_replica import EngineReplica
from common.garbage import freeze_startup_objects
from common.messages import LeaveGroup, StepPlan, StepResult, WorkerReady
from common.model_info import ModelInfo
from common.process import announce_ready, exit_child, init_child_process
from common.profiling import ProcessProfiler, ProcessStats, ProfileConfig, TorchProfiler, epoch_us
from common.startup import PhaseClock
from common.transport import Endpoints, pull_socket, push_socket, send
from gpu_worker.step_queue import StepQueue

CONTROL_POLL_MS = 100  # an idle worker wakes this often to answer control commands queued for its main thread


def main(
    config: EngineConfig,
    info: ModelInfo,
    run_dir: str,
    log_level: str,
    parent_pid: int,
    profile: ProfileConfig = ProfileConfig(),
    replica: EngineReplica = EngineReplica(),
    rank: int = 0,
) -> None:
    """`replica`: the engine this worker belongs to; `rank`: its tensor-parallel rank there (0: the only one,
    or the one the scheduler talks to)."""
    role = replica.gpu_worker_rank_role(rank)
    init_child_process(role, log_level, parent_pid)
    endpoints = Endpoints(run_dir)
    ranks = config.tensor_parallel_size
    device_index = replica.index * ranks + rank
    leave_group: Callable[[], None] | None = None  # leaves the tensor-parallel process group
    if config.load_format == "null":
        from gpu_worker.null_runner import NullRunner

        runner = NullRunner(config, info)
    else:
        # torch is imported here, in the child, never before spawn.
        from gpu_worker.builder import build_worker, resolve_device
        from gpu_worker.parallel import close_tensor_parallel, init_tensor_parallel

        device_type = resolve_device(config.device, device_index).type
        tp = init_tensor_parallel(rank, ranks, endpoints.tensor_parallel_init(replica.index), device_type, device_index)
        phases = PhaseClock(logging.getLogger(role)) if rank == 0 else None  # rank 0 speaks for all
        runner = build_worker(config, info, phases, tp, device_index)

        def release_graphs_and_leave() -> None:
            runner.release_graphs()  # first: NCCL's teardown waits on graphs that captured its collectives
            close_tensor_parallel(tp)

        leave_group = release_graphs_and_leave

    ctx = zmq.Context.instance()
    r = replica.index
    if rank == 0:
        plans = pull_socket(ctx, endpoints.worker_plans(r))
        results: zmq.Socket | None = push_socket(ctx, endpoints.scheduler_results(r))
        relays = [push_socket(ctx, endpoints.worker_rank_plans(r, t)) for t in range(1, ranks)]
    else:
        plans, results, relays = pull_socket(ctx, endpoints.worker_rank_plans(r, rank)), None, []
    worker = WorkerLoop(runner, plans, results, ProcessProfiler(profile, role, TorchProfiler), relays)
    control = ControlServer(endpoints, role, stats=worker.stats)
    freeze_startup_objects()  # torch, the model, the warm-up: ~200,000 objects no collection should traverse
    # The limits as decided for this device (gpu_worker/limits.py): the scheduler plans with them.
    announce_ready(run_dir, role, WorkerReady(role, os.getpid(), str(runner.device), str(runner.dtype), runner.limits))
    try:
        worker.run(control)  # returns on LeaveGroup (a follower rank of the in-process engine)
        if leave_group is not None:
            leave_group()
    except SystemExit:
        pass
    finally:
        worker.close()
    exit_child()


@dataclass(slots=True)
class StepTotals:
    steps: int = 0
    prepare_s: float = 0.0
    forward_s: float = 0.0
    sample_s: float = 0.0


class WorkerLoop:
    """`results`: None on a tensor-parallel rank other than 0 (its results are rank 0's). `relays`: on rank 0,
    one socket to each other rank, which gets every plan before rank 0 runs it."""

    def __init__(
        self,
        runner,
        plans: zmq.Socket,
        results: zmq.Socket | None,
        profiler: ProcessProfiler,
        relays: list[zmq.Socket] | None = None,
    ):
        self.runner = runner
        self.plans = plans
        self.results = results
        self.relays = relays or []
        self.profiler = profiler
        self.totals = StepTotals()
        self.activity = ProcessStats()
        # A --profile-steps window. The scheduler opens it on a plan (StepPlan.profile_steps); plans run in
        # order, one step each, so counting launches keeps the window on exactly those steps. The window's
        # last step is finished before any later one is launched, and the profiler stops there.
        self.profile_launches_left = 0
        self.profile_last_step: int | None = None
        self._plan_waits: dict[int, float] = {}  # step id -> its plan's trip (scheduler/step_chain.py)

    def stats(self) -> dict:
        return {**self.activity.summary(), **dataclasses.asdict(self.totals)}

    def run(self, control: ControlServer) -> None:
        """Launch each plan the moment it arrives; finish (read back and send) a launched step the moment the
        device is done with it. Neither waits for the other: a step in flight is never finished early just
        because the next plan is not there yet (that would leave the device idle for the next launch's host
        work), and its result is never held back behind a launch the scheduler has not planned yet."""
        poller = zmq.Poller()
        poller.register(self.plans, zmq.POLLIN)
        steps = StepQueue(self.runner)
        while True:
            for request in control.pending():
                control.reply(request, self.profiler.answer(request.kind))
            # A step in flight: look for the next plan without waiting (spinning until one of the two is
            # ready: either costs microseconds to check); none: wait for a plan.
            if not poller.poll(timeout=0 if steps else CONTROL_POLL_MS):
                if steps and steps.oldest_is_done():
                    with self.activity.busy():
                        self._send(steps.finish_oldest())
                continue
            with self.activity.busy():
                plan = self._receive()
                if isinstance(plan, LeaveGroup):
                    while steps:  # every launched collective completes on every rank before the group goes
                        self._send(steps.finish_oldest())
                    return
                if steps and steps.oldest_step_id == self.profile_last_step:
                    self._send(steps.finish_oldest())  # closes the profile window before anything else runs
                if plan.profile_steps:
                    self.profiler.start()
                    self.profile_launches_left = plan.profile_steps
                if self.profile_launches_left:
                    self.profile_launches_left -= 1
                    if self.profile_launches_left == 0:
                        self.profile_last_step = plan.step_id
                started = epoch_us()
                results = steps.launch(plan)
                self._mark_step(plan, started)
                for result in results:
                    self._send(result)

    def _receive(self) -> StepPlan | LeaveGroup:
        """The next plan (or, to a follower rank of the in-process engine, the word to leave). Its bytes go to
        the other ranks first, as received (no second encoding), so every rank runs every plan, in the same
        order."""
        data = self.plans.recv(copy=True)
        for relay in self.relays:
            relay.send(data)
        plan: StepPlan | LeaveGroup = self.activity.sockets.decode(data)
        if isinstance(plan, StepPlan) and plan.sent_time:
            self._plan_waits[plan.step_id] = max(0.0, time.time() - plan.sent_time)
        return plan

    def _mark_step(self, plan: StepPlan, started: float) -> None:
        """The step's marker in the trace (launch; on a CPU, the whole step): the scheduler's plan of the same
        step id says how its tokens split into prefill and decode."""
        if not self.profiler.active:
            return
        args = {
            "step_id": plan.step_id,
            "tokens": sum(plan.num_tokens),
            "rids": plan.rids,
        }
        self.profiler.mark(f"step {plan.step_id}", started, args)

    def _send(self, result: StepResult) -> None:
        result.timings.plan_wait_s = self._plan_waits.pop(result.step_id, 0.0)
        if self.results is not None:
            send(self.results, result, self.activity.sockets)
        self.totals.steps += 1
        self.totals.prepare_s += result.timings.prepare_s
        self.totals.forward_s += result.timings.forward_s
        self.totals.sample_s += result.timings.sample_s
        if result.step_id == self.profile_last_step:
            self.profile_last_step = None
            self.profiler.stop()  # after the result is sent: writing the trace delays no one

    def close(self) -> None:
        for sock in [self.plans, self.results, *self.relays]:
            if sock is not None:
                sock.close()
