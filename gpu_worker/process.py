"""The GPU worker process: load the model, allocate the KV store, warm up, then run plans in order.

    scheduler ──StepPlan──▶ [PULL worker-plans] ─ execute ─ [PUSH scheduler-results] ──StepResult──▶ scheduler
"""

from __future__ import annotations

import logging
import time

import zmq

from common.config import EngineConfig
from common.control import ControlServer
from common.messages import StepPlan
from common.model_info import ModelInfo
from common.process import announce_ready, init_child_process
from common.transport import Endpoints, pull_socket, push_socket, recv, send

ROLE = "gpu_worker"
log = logging.getLogger(ROLE)


def main(config: EngineConfig, info: ModelInfo, run_dir: str, log_level: str, parent_pid: int) -> None:
    init_child_process(ROLE, log_level, parent_pid)
    from gpu_worker.model_runner import ModelRunner  # torch is imported here, in the child, never before spawn

    endpoints = Endpoints(run_dir)
    runner = ModelRunner(config, info, progress=True)
    log.info("model on %s (%s), %d KV blocks of %d tokens", runner.device, runner.dtype,
             runner.num_kv_blocks, config.block_size)

    ctx = zmq.Context.instance()
    plans = pull_socket(ctx, endpoints.worker_plans)
    results = push_socket(ctx, endpoints.scheduler_results)
    stats = WorkerStats()
    control = ControlServer(endpoints, ROLE, stats=stats.as_dict)
    announce_ready(run_dir, ROLE, {"num_kv_blocks": runner.num_kv_blocks, "device": str(runner.device),
                                   "dtype": str(runner.dtype)})
    try:
        serve(runner, plans, results, control, stats)
    except SystemExit:
        pass
    finally:
        plans.close()
        results.close()


class WorkerStats:
    def __init__(self):
        self.started = time.time()
        self.steps = 0
        self.busy_s = 0.0
        self.prepare_s = 0.0
        self.forward_s = 0.0
        self.sample_s = 0.0

    def as_dict(self) -> dict:
        return {"steps": self.steps, "uptime_s": time.time() - self.started, "busy_s": self.busy_s,
                "prepare_s": self.prepare_s, "forward_s": self.forward_s, "sample_s": self.sample_s}


def serve(runner, plans: zmq.Socket, results: zmq.Socket, control: ControlServer, stats: WorkerStats) -> None:
    poller = zmq.Poller()
    poller.register(plans, zmq.POLLIN)
    while True:
        for request in control.pending():
            control.reply(request, {"error": f"{request.kind} is not supported by {ROLE}"})
        if not poller.poll(timeout=100):
            continue
        plan: StepPlan = recv(plans)
        start = time.perf_counter()
        result = runner.execute(plan)
        send(results, result)
        stats.steps += 1
        stats.busy_s += time.perf_counter() - start
        stats.prepare_s += result.timings.prepare_s
        stats.forward_s += result.timings.forward_s
        stats.sample_s += result.timings.sample_s
