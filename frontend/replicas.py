"""The engine replicas as a frontend knows them: how many the server started, and which the launcher took out
since (common/engine_replica.py: ReplicaFailure). /health, /stats and /metrics report them.

With one replica left of two the server still serves every request, at half its capacity: /health stays 200
(a load balancer must keep sending it requests) and says "degraded"; once none is left the server stops, unless
replicas live on other hosts (launch_cluster.py): their nodes may join or come back, and until one does /health
is 503 "unhealthy" with the counts. A headless node's replica counts as out until its node joins.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from common.engine_replica import ReplicaFailure, ReplicaJoined

NOT_JOINED = "its node has not joined yet"


@dataclass(frozen=True, slots=True)
class EngineReplicas:
    total: int = 1
    failed: dict[int, str] = field(default_factory=dict)  # replica -> why the launcher took it out

    @property
    def alive(self) -> int:
        return self.total - len(self.failed)

    def without(self, failure: ReplicaFailure) -> EngineReplicas:
        return EngineReplicas(self.total, {**self.failed, failure.replica: failure.reason})

    def joined(self, joined: ReplicaJoined) -> EngineReplicas:
        return EngineReplicas(self.total, {r: why for r, why in self.failed.items() if r != joined.replica})

    def health(self) -> dict:
        """/health's body (no key needed there: counts, not reasons)."""
        if not self.failed:
            return {"status": "ok"}
        status = "degraded" if self.alive else "unhealthy"
        return {"status": status, "engine_replicas": self.total, "engine_replicas_alive": self.alive}

    def to_payload(self) -> dict:
        """/stats' view, with each failure's reason."""
        failed = {str(replica): reason for replica, reason in sorted(self.failed.items())}
        return {"total": self.total, "alive": self.alive, "failed": failed}
