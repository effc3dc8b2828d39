"""The messages between nodes (node_link/) and between a node link and its launcher: one typed definition each.

    headless node's link ──NodeHello──▶ frontend node's link ──NodeWelcome | NodeRefused──▶ headless node's link
    headless launcher ──NodeJoin (its replicas, ready)──▶ its link ──▶ frontend node's link ──▶ frontend launcher
    frontend node's link ──NodeLost (silent, left, replaced)──▶ frontend launcher

Everything else between nodes is relayed as it is: the bytes of the messages the processes already send each
other (common/messages.py), never decoded on the way.
"""

from __future__ import annotations

from dataclasses import dataclass

from common.messages import WorkerLimits
from common.wire import message


@dataclass(slots=True)
class JoinedReplica:
    """An engine replica a headless node serves, as its GPU worker reported it (WorkerReady)."""

    index: int
    device: str
    limits: WorkerLimits
    roles: list[str]  # its processes: the frontends ask them for /health, /stats and /metrics


@message(40)
@dataclass(slots=True)
class NodeHello:
    """A headless node asks to join. `incarnation`: this start of it (a restarted node is a new one)."""

    node: str
    incarnation: str
    replicas: list[int]
    model: str  # the terms both sides must agree on (node_link/terms.py)
    block_size: int
    data_parallel_size: int
    tensor_parallel_size: int


@message(41)
@dataclass(slots=True)
class NodeWelcome:
    """The frontend node's answer: what the node's schedulers need to send their tokens back."""

    num_tokenizers: int
    num_frontends: int


@message(42)
@dataclass(slots=True)
class NodeRefused:
    reason: str


@message(43)
@dataclass(slots=True)
class NodeJoin:
    """A welcomed node's replicas are ready: route requests to them."""

    node: str
    replicas: list[JoinedReplica]


@message(44)
@dataclass(slots=True)
class NodeLost:
    """The frontend node's link gave up on a node (it fell silent, left, or a new start of it replaced it): its
    replicas are out."""

    node: str
    replicas: list[int]
    reason: str
