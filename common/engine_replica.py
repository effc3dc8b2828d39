"""Data-parallel engine replicas: who is who.

    tokenizer workers ──route (tokenizer_worker/router.py)──▶ replica r:  scheduler-r ──plans──▶ gpu_worker-r

A replica is one engine: a scheduler and its GPU worker, with their own sockets in the run directory, their
own KV blocks and prefix trie. Nothing is shared between replicas; the tokenizer workers decide which one
serves a request. With one replica the processes keep their plain names ("scheduler", "gpu_worker"), so a
single-engine server's logs, /stats and profiles read as they always did.
"""

from __future__ import annotations

from dataclasses import dataclass

SCHEDULER = "scheduler"
GPU_WORKER = "gpu_worker"


@dataclass(frozen=True, slots=True)
class EngineReplica:
    index: int = 0
    count: int = 1

    @property
    def scheduler_role(self) -> str:
        return self._role(SCHEDULER)

    @property
    def gpu_worker_role(self) -> str:
        return self._role(GPU_WORKER)

    def gpu_worker_rank_role(self, rank: int) -> str:
        """Tensor-parallel rank 0 is the GPU worker the scheduler talks to; the others follow it."""
        return self.gpu_worker_role if rank == 0 else f"{self.gpu_worker_role}-rank{rank}"

    def _role(self, process: str) -> str:
        return process if self.count == 1 else f"{process}-{self.index}"


def engine_replicas(count: int) -> list[EngineReplica]:
    return [EngineReplica(index, count) for index in range(count)]


def is_scheduler_role(role: str) -> bool:
    return role == SCHEDULER or (role.startswith(f"{SCHEDULER}-") and role[len(SCHEDULER) + 1 :].isdigit())
