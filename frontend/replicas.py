"""The engine replicas as a frontend knows them: how many the server started, and which the launcher took out
since (common/engine_replica.py: ReplicaFailure). /health, /stats and /metrics report them.

With one replica left of two the server still serves every request, at half its capacity: /health stays 200
(a load balancer must keep sending it requests) and says "degraded"; once none is left the server stops.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from common.engine_replica import ReplicaFailure


@dataclass(frozen=True, slots=True)
class EngineReplicas:
    total: int = 1
    failed: dict[int, str] = field(default_factory=dict)  # replica -> why the launcher took it out

    @property
    def alive(self) -> int:
        return self.total - len(self.failed)

    def without(self, failure: ReplicaFailure) -> EngineReplicas:
        return EngineReplicas(self.total, {**self.failed, failure.replica: failure.reason})

    def health(self) -> dict:
        """/health's body (no key needed there: counts, not reasons)."""
        if not self.failed:
            return {"status": "ok"}
        return {"status": "degraded", "engine_replicas": self.total, "engine_replicas_alive": self.alive}

    def to_payload(self) -> dict:
        """/stats' view, with each failure's reason."""
        failed = {str(replica): reason for replica, reason in sorted(self.failed.items())}
        return {"total": self.total, "alive": self.alive, "failed": failed}
