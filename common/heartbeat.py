"""Heartbeats between nodes, one rule whatever carries them: every side beats every HEARTBEAT_S, and a peer not
heard for longer than the timeout (--watchdog-timeout; 0: never for silence) is lost.

Two carriers, each the channel its nodes share anyway, so neither opens a socket for liveness alone:

    tensor-parallel ranks across nodes   common/node_heartbeat.py: a counter per node in node 0's rendezvous store
                                         (torch.distributed's TCPStore); heard = the counter moved
    data-parallel replicas across hosts  node_link/: a BEAT frame on the CurveZMQ link that relays the replicas'
                                         traffic; heard = a frame arrived
"""

from __future__ import annotations

from dataclasses import dataclass

HEARTBEAT_S = 1.0


@dataclass(slots=True)
class PeerSilence:
    """When a peer was last heard, and the verdict on its silence (plain numbers in: the caller's clock)."""

    timeout_s: float  # 0: no silence check
    heard_at: float

    def hear(self, now: float) -> None:
        self.heard_at = now

    def silent_s(self, now: float) -> float:
        return now - self.heard_at

    def lost(self, now: float) -> bool:
        return bool(self.timeout_s) and self.silent_s(now) > self.timeout_s
