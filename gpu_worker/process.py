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

On CUDA, replica r's rank t runs on cuda:((r - S)·N + t), S the first replica on its node
(--data-parallel-start-rank). Across nodes of one engine (--nnodes, common/nodes.py) the ranks on other nodes than
rank 0's get each plan by broadcast instead (gpu_worker/plan_broadcast.py), and each rank runs on its node's
cuda:(t mod ranks per node).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable

import zmq

from common.config import EngineConfig
from common.control import ControlServer
from common.engine_replica import EngineReplica
from common.garbage import freeze_startup_objects
from common.loop_progress import LoopProgress
from common.messages import LeaveGroup, StepPlan, StepResult, WorkerReady
from common.model_info import ModelInfo
from common.nodes import ONE_NODE, Nodes
from common.process import announce_ready, exit_child, init_child_process
from common.profiling import ProcessProfiler, ProcessStats, ProfileConfig, TorchProfiler
from common.startup import PhaseClock
from common.transport import Endpoints, pull_socket, push_socket, send
from gpu_worker.step_observer import StepObserver
from gpu_worker.step_queue import StepQueue

PLAN_BROADCAST_ENDPOINT = "inproc://broadcast-plans"  # a follower on another node than rank 0's: its plans
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
    nodes: Nodes = ONE_NODE,
) -> None:
    """`replica`: the engine this worker belongs to; `rank`: its tensor-parallel rank there (0: the only one,
    or the one the scheduler talks to); `nodes`: the nodes the ranks span, and this one's place."""
    role = replica.gpu_worker_rank_role(rank)
    init_child_process(role, log_level, parent_pid)
    endpoints = Endpoints(run_dir)
    ranks = config.tensor_parallel_size
    device_index = (replica.index - replica.start) * ranks + nodes.local_index(rank, ranks)
    leave_group: Callable[[], None] | None = None  # leaves the tensor-parallel process group
    plan_group = None  # rank 0 and the ranks on other nodes (gpu_worker/plan_broadcast.py)
    if config.load_format == "null":
        from gpu_worker.null_runner import NullRunner

        runner = NullRunner(config, info)
    else:
        # torch is imported here, in the child, never before spawn.
        from gpu_worker.builder import build_worker, resolve_device
        from gpu_worker.parallel import close_tensor_parallel, init_tensor_parallel

        device_type = resolve_device(config.device, device_index).type
        from gpu_worker.plan_broadcast import join_plan_group

        init_file = endpoints.tensor_parallel_init(replica.index)
        tp = init_tensor_parallel(rank, ranks, init_file, device_type, device_index, nodes)
        plan_group = join_plan_group(nodes, ranks)
        phases = PhaseClock(logging.getLogger(role)) if rank == 0 else None  # rank 0 speaks for all
        runner = build_worker(config, info, phases, tp, device_index)

        def release_graphs_and_leave() -> None:
            runner.release_graphs()  # first: NCCL's teardown waits on graphs that captured its collectives
            close_tensor_parallel(tp)

        leave_group = release_graphs_and_leave

    ctx = zmq.Context.instance()
    plans, results, relays = plan_sockets(ctx, endpoints, replica, rank, ranks, nodes, plan_group)
    worker = WorkerLoop(runner, plans, results, StepObserver(ProcessProfiler(profile, role, TorchProfiler)), relays)
    control = ControlServer(endpoints, role, stats=worker.stats, progress=worker.progress)
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


def plan_sockets(
    ctx: zmq.Context, endpoints: Endpoints, replica: EngineReplica, rank: int, ranks: int, nodes: Nodes, plan_group
) -> tuple[zmq.Socket, zmq.Socket | None, list]:
    """Where this rank's plans come from, where its results go (rank 0 only), and to whom rank 0 relays each
    plan: the ranks on its node through their sockets, those on other nodes by one broadcast."""
    r = replica.index
    remote = nodes.remote_ranks(ranks) if nodes.multi_node else []
    if rank == 0:
        plans = pull_socket(ctx, endpoints.worker_plans(r))
        results: zmq.Socket | None = push_socket(ctx, endpoints.scheduler_results(r))
        relays: list = [push_socket(ctx, endpoints.worker_rank_plans(r, t)) for t in range(1, ranks) if t not in remote]
        if plan_group is not None:
            from gpu_worker.plan_broadcast import PlanBroadcast

            relays.append(PlanBroadcast(plan_group))
        return plans, results, relays
    if rank in remote:
        from gpu_worker.plan_broadcast import PlanReceiver

        plans = pull_socket(ctx, PLAN_BROADCAST_ENDPOINT)
        PlanReceiver(plan_group, ctx, PLAN_BROADCAST_ENDPOINT, rank).start()
        return plans, None, []
    return pull_socket(ctx, endpoints.worker_rank_plans(r, rank)), None, []


class WorkerLoop:
    """`results`: None on a tensor-parallel rank other than 0 (its results are rank 0's). `relays`: on rank 0,
    one socket to each other rank, which gets every plan before rank 0 runs it. `observer`: profiling, the
    plans' trips and the step totals (step_observer.py)."""

    def __init__(
        self,
        runner,
        plans: zmq.Socket,
        results: zmq.Socket | None,
        observer: StepObserver,
        relays: list[zmq.Socket] | None = None,
    ):
        self.runner = runner
        self.plans = plans
        self.results = results
        self.relays = relays or []
        self.observer = observer
        self.activity = ProcessStats()
        # Turns while no step is in flight, and each step finished: a step that never ends is stuck, however
        # fast the loop polls around it (common/loop_progress.py).
        self.progress = LoopProgress()

    def stats(self) -> dict:
        return {**self.activity.summary(), **self.observer.stats()}

    def run(self, control: ControlServer) -> None:
        """Launch each plan the moment it arrives; finish (read back and send) a launched step the moment the
        device is done with it. Neither waits for the other: a step in flight is never finished early just
        because the next plan is not there yet (that would leave the device idle for the next launch's host
        work), and its result is never held back behind a launch the scheduler has not planned yet."""
        poller = zmq.Poller()
        poller.register(self.plans, zmq.POLLIN)
        steps = StepQueue(self.runner)
        self.progress.holds_work = lambda: len(steps) > 0
        while True:
            for request in control.pending():
                control.reply(request, self.observer.answer(request.kind))
            # A step in flight: look for the next plan without waiting (spinning until one of the two is
            # ready: either costs microseconds to check); none: wait for a plan.
            if not self.progress.idle_wait(poller.poll, 0 if steps else CONTROL_POLL_MS):
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
                if self.observer.ends_window(steps.oldest_step_id):
                    self._send(steps.finish_oldest())  # closes the profile window before anything else runs
                self.observer.before_launch(plan)
                results = steps.launch(plan)
                self.observer.after_launch(plan)
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
        if isinstance(plan, StepPlan):
            self.observer.on_plan(plan)
        return plan

    def _send(self, result: StepResult) -> None:
        self.observer.on_result(result)
        if self.results is not None:
            send(self.results, result, self.activity.sockets)
        self.progress.advance()
        self.observer.on_sent(result)

    def close(self) -> None:
        for sock in [self.plans, self.results, *self.relays]:
            if sock is not None:
                sock.close()
