"""Tensor-parallel ranks 1..N-1 for the in-process engine, whose own process is rank 0.

Each is a spawned GPU worker process (gpu_worker/process.py, the server's own loop); `send` hands it a
plan's bytes before rank 0 runs that plan, as the server's rank 0 relays them. The followers die with
this process (PR_SET_PDEATHSIG) if `close` is never called.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import shutil
import time

import zmq

from common.config import EngineConfig
from common.engine_replica import EngineReplica
from common.messages import LeaveGroup
from common.model_info import ModelInfo, check_tensor_parallel
from common.profiling import ProfileConfig
from common.transport import Endpoints, make_run_dir, pull_socket, push_socket, recv
from common.wire import encode
from gpu_worker.builder import resolve_device
from gpu_worker.parallel import TensorParallel, close_tensor_parallel, dist_backend, init_tensor_parallel

READY_POLL_MS = 200
ENGINE = EngineReplica()  # the in-process engine is one replica: its own process is rank 0


class FollowerRanks:
    def __init__(self, config: EngineConfig, info: ModelInfo, log_level: str = "warning"):
        from gpu_worker import process as gpu_process

        check_tensor_parallel(config.model, config.tensor_parallel_size)  # before any rank starts
        self.run_dir = make_run_dir()
        endpoints = Endpoints(self.run_dir)
        ctx = zmq.Context.instance()
        self._ready = pull_socket(ctx, endpoints.launcher_ready)
        spawn = mp.get_context("spawn")
        ranks = range(1, config.tensor_parallel_size)
        self.processes = {
            ENGINE.gpu_worker_rank_role(rank): spawn.Process(
                target=gpu_process.main,
                args=(config, info, self.run_dir, log_level, os.getpid(), ProfileConfig(), ENGINE, rank),
                name=ENGINE.gpu_worker_rank_role(rank),
                daemon=True,
            )
            for rank in ranks
        }
        for process in self.processes.values():
            process.start()
        self._serving = False  # every follower warmed up and running plans
        self._relays = [push_socket(ctx, endpoints.worker_rank_plans(ENGINE.index, rank)) for rank in ranks]
        device_type = resolve_device(config.device).type
        self.tp: TensorParallel = init_tensor_parallel(
            0, config.tensor_parallel_size, endpoints.tensor_parallel_init(ENGINE.index), device_type
        )

    def wait_ready(self) -> None:
        """Block until every follower has warmed up (rank 0 must be warming up alongside: their collectives
        pair up)."""
        waiting = set(self.processes)
        while waiting:
            self.check_alive()
            if self._ready.poll(timeout=READY_POLL_MS):
                waiting.discard(recv(self._ready).role)
        self._serving = True

    def check_alive(self) -> None:
        for role, process in self.processes.items():
            if process.exitcode is not None:
                raise RuntimeError(
                    f"tensor-parallel rank {role} (pid {process.pid}) died with exit code {process.exitcode}"
                )

    def send(self, plan_bytes: bytes) -> None:
        for relay in self._relays:
            relay.send(plan_bytes)

    def close(self, together: bool = True) -> None:
        """Every rank leaves the process group together, then the followers exit. If a follower never got to
        serving or died, or `together` is False (rank 0 failed, maybe halfway through a step), the followers
        are stopped and rank 0 leaves alone where the backend allows it (gloo); NCCL's teardown would wait
        forever for the missing ranks, so that group is left to the process's exit."""
        alive = all(process.exitcode is None for process in self.processes.values())
        everyone = together and self._serving and alive
        if everyone:
            self.send(encode(LeaveGroup()))
            close_tensor_parallel(self.tp)
        else:
            for process in self.processes.values():
                if process.exitcode is None:
                    process.terminate()
            if dist_backend(self.tp) != "nccl":
                close_tensor_parallel(self.tp)
        deadline = time.monotonic() + 5
        for process in self.processes.values():
            process.join(timeout=max(0.0, deadline - time.monotonic()))
            if process.exitcode is None:
                process.kill()
                process.join()
        for sock in [self._ready, *self._relays]:
            sock.close()
        shutil.rmtree(self.run_dir, ignore_errors=True)
