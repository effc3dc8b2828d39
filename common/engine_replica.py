"""Data-parallel engine replicas: who is who.

    tokenizer workers ──route (tokenizer_worker/router.py)──▶ replica r:  scheduler-r ──plans──▶ gpu_worker-r

A replica is one engine: a scheduler and its GPU worker, with their own sockets in the run directory, their
own KV blocks and prefix trie. Nothing is shared between replicas; the tokenizer workers decide which one
serves a request. With one replica the processes keep their plain names ("scheduler", "gpu_worker"), so a
single-engine server's logs, /stats and profiles read as they always did.

A replica on another host (a headless node's, launch_cluster.py) joins when its node does, late or again after
a restart: the launcher sends the same processes a ReplicaJoined, and the routers use it from then on. Its node
lost (its heartbeats stop: node_link/head.py) is that replica's failure, told as below.

A replica whose process dies (or stops answering, or making progress) while others still serve is taken out
(launch.py, Launcher.fail_replica): the launcher stops its other processes and sends every tokenizer worker
and frontend a ReplicaFailure over the control channel. A tokenizer worker ends the requests it had routed
there (a 503 `replica_failed` for each, an error event to a stream) and routes no more there; a frontend
reports the replicas left (/health, /stats, /metrics).
"""

from __future__ import annotations

from dataclasses import dataclass

from common.messages import ControlRequest

SCHEDULER = "scheduler"
GPU_WORKER = "gpu_worker"
REPLICA_FAILED = "replica_failed"  # the control command, and the error code of the requests it ends
REPLICA_FAILED_STATUS = 503  # what those requests get: the other replicas serve a retry
REPLICA_JOINED = "replica_joined"  # the control command: a replica serves (again)
NO_REPLICA = "no_replica"  # the error code of a request that came while no replica served


@dataclass(frozen=True, slots=True)
class EngineReplica:
    index: int = 0
    count: int = 1
    start: int = 0  # the first replica on this replica's node (--data-parallel-start-rank): its devices count from it

    @property
    def scheduler_role(self) -> str:
        return self._role(SCHEDULER)

    @property
    def gpu_worker_role(self) -> str:
        return self._role(GPU_WORKER)

    def gpu_worker_rank_role(self, rank: int) -> str:
        """Tensor-parallel rank 0 is the GPU worker the scheduler talks to; the others follow it."""
        return self.gpu_worker_role if rank == 0 else f"{self.gpu_worker_role}-rank{rank}"

    def roles(self, ranks: int) -> list[str]:
        """Every process of this replica, with `ranks` tensor-parallel GPU workers."""
        return [self.scheduler_role, *(self.gpu_worker_rank_role(rank) for rank in range(ranks))]

    def _role(self, process: str) -> str:
        return process if self.count == 1 else f"{process}-{self.index}"


@dataclass(frozen=True, slots=True)
class ReplicaFailure:
    """The launcher's word that replica `replica` is out: its processes (`roles`) are stopped, for `reason`
    (which process, and how it failed: for the logs and /stats, not for clients)."""

    replica: int
    roles: list[str]
    reason: str

    def request(self) -> ControlRequest:
        args = {"replica": self.replica, "roles": self.roles, "reason": self.reason}
        return ControlRequest(REPLICA_FAILED, 0, args)  # reply_to "": nobody waits for an answer

    @classmethod
    def from_request(cls, request: ControlRequest) -> ReplicaFailure:
        args = request.args
        return cls(int(args["replica"]), [str(role) for role in args["roles"]], str(args["reason"]))

    def client_message(self) -> str:
        return f"engine replica {self.replica} failed while serving this request; the other replicas still serve"


@dataclass(frozen=True, slots=True)
class ReplicaJoined:
    """The launcher's word that replica `replica` serves now (a headless node's, joined late or again after a
    restart: launch_cluster.py): route requests to it, ask its processes (`roles`) for /health and /stats."""

    replica: int
    roles: list[str]

    def request(self) -> ControlRequest:
        return ControlRequest(REPLICA_JOINED, 0, {"replica": self.replica, "roles": self.roles})

    @classmethod
    def from_request(cls, request: ControlRequest) -> ReplicaJoined:
        return cls(int(request.args["replica"]), [str(role) for role in request.args["roles"]])


def engine_replicas(count: int) -> list[EngineReplica]:
    return [EngineReplica(index, count) for index in range(count)]


def is_scheduler_role(role: str) -> bool:
    return role == SCHEDULER or (role.startswith(f"{SCHEDULER}-") and role[len(SCHEDULER) + 1 :].isdigit())
