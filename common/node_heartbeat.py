"""The launchers of a multi-node tensor-parallel group watch each other through node 0's rendezvous store (a
torch.distributed TCPStore at --master-addr:--master-port, which node 0's launcher hosts and every rank also
meets at): no socket of our own crosses hosts. Keys:

    config              node 0's engine config (JSON): a node started with other flags is refused at once
    node/{r}/joined     counts node r's launchers: a second node with the same --node-rank is refused
    node/{r}/beat       node r's heartbeat, a counter its launcher adds 1 to every second (a thread of its own)
    node/{r}/stopped    why node r's launcher stopped (JSON {"reason", "failed"}), set before it stops its ranks

Each launcher checks once a second (its watch loop's tick): node 0 every other node, a headless node node 0. A
node that stopped, or whose counter has not moved for --watchdog-timeout seconds, is lost: the server stops and
exits non-zero naming it, and a headless node stops when node 0 goes (its ranks could never run another step).
The beat and the verdict on silence are common/heartbeat.py's, as for the node link of data parallelism (node_link/);
the carrier differs: here the store every rank needs anyway, so no socket of our own crosses hosts.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import timedelta
from typing import TYPE_CHECKING

from common.heartbeat import HEARTBEAT_S, PeerSilence
from common.nodes import Nodes

if TYPE_CHECKING:
    from torch.distributed import TCPStore  # imported only where a node link is made: the launcher needs no torch

# A store operation that takes longer means node 0 is unreachable (it answers in microseconds when it is up).
STORE_OP_TIMEOUT = timedelta(seconds=10)
# How long node 0, stopping, waits for the other nodes to read its word (they tick once a second).
STOP_NOTICE_S = 3.0
CONFIG = "config"


class PeerStopped(Exception):
    """Another node stopped, or was lost. `failed`: False where node 0 stopped on request (a headless node then
    exits 0 too)."""

    def __init__(self, reason: str, failed: bool = True):
        super().__init__(reason)
        self.failed = failed


@dataclass(slots=True)
class _Heartbeat:
    count: int  # the node's counter as last read: a beat is the counter moving
    silence: PeerSilence


@dataclass
class NodeHeartbeat:
    nodes: Nodes
    store: TCPStore
    tensor_parallel_size: int
    silence_timeout_s: float  # 0: no silence check
    clock: Callable[[], float] = time.monotonic  # the heartbeats' ages
    _beats: dict[int, _Heartbeat] = field(default_factory=dict)
    _stopping: threading.Event = field(default_factory=threading.Event)
    _heart: threading.Thread = field(init=False)

    def __post_init__(self) -> None:
        # The heartbeat has a thread of its own: a launcher's main thread spends seconds at a time importing the
        # processes' modules or waiting on its children, and must not look lost meanwhile.
        self._heart = threading.Thread(target=self._beat, name="node-heartbeat", daemon=True)
        self._heart.start()

    def _beat(self) -> None:
        key = f"node/{self.nodes.node_rank}/beat"
        while not self._stopping.is_set():
            try:
                self.store.add(key, 1)
            except (RuntimeError, OSError):
                return  # node 0's store is gone: the main thread's next tick says so
            self._stopping.wait(HEARTBEAT_S)

    @classmethod
    def host(cls, nodes: Nodes, config: dict, tensor_parallel_size: int, silence_timeout_s: float) -> NodeHeartbeat:
        """Node 0: start the store (an error naming the address if the port is taken) and publish the config."""
        from torch.distributed import TCPStore

        try:
            store = TCPStore(nodes.master_addr, nodes.master_port, is_master=True, wait_for_workers=False)
        except (RuntimeError, OSError) as exc:
            raise NodeHeartbeatError(f"cannot host the rendezvous store at {nodes.master}: {exc}") from None
        store.set(CONFIG, json.dumps(config, sort_keys=True))
        return cls(nodes, store, tensor_parallel_size, silence_timeout_s)

    @classmethod
    def join(cls, nodes: Nodes, config: dict, tensor_parallel_size: int, silence_timeout_s: float) -> NodeHeartbeat:
        """A headless node: wait for node 0's store (torch's default timeout, 300 s), check that both were
        started alike, and take this node's place."""
        from torch.distributed import TCPStore

        try:
            store = TCPStore(nodes.master_addr, nodes.master_port, is_master=False)
            store.set_timeout(STORE_OP_TIMEOUT)
            theirs = json.loads(store.get(CONFIG))
        except (RuntimeError, OSError) as exc:
            raise NodeHeartbeatError(f"no node 0 at {nodes.master}: {_one_line(exc)}") from None
        if store.add(f"node/{nodes.node_rank}/joined", 1) > 1:
            raise NodeHeartbeatError(f"node {nodes.node_rank} has already joined node 0 at {nodes.master}")
        link = cls(nodes, store, tensor_parallel_size, silence_timeout_s)
        differ = sorted(key for key in {*theirs, *config} if theirs.get(key) != config.get(key))
        if differ:
            shown = ", ".join(f"{key} {config.get(key)!r} here, {theirs.get(key)!r} on node 0" for key in differ)
            error = NodeHeartbeatError(
                f"node {nodes.node_rank} was started with other engine flags than node 0: {shown}"
            )
            link.stop(str(error), failed=True)  # node 0's rank 0 would wait for this node's ranks otherwise
            raise error
        return link

    def tick(self) -> None:
        """Check the nodes this one watches; raises PeerStopped naming a lost one."""
        try:
            for node in self._watched():
                self._check(node)
        except (RuntimeError, OSError) as exc:  # the store is node 0's: only a headless node can lose it
            raise PeerStopped(f"lost node 0 at {self.nodes.master}: {_one_line(exc)}") from None

    def wait_for_word(self, seconds: float) -> None:
        """Tick for up to `seconds`: a peer's word of why it stopped may be on its way (raises PeerStopped)."""
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            self.tick()
            time.sleep(0.1)  # polling the store, bounded by the deadline

    def _watched(self) -> list[int]:
        return [0] if self.nodes.node_rank != 0 else list(range(1, self.nodes.nnodes))

    def _check(self, node: int) -> None:
        stopped = f"node/{node}/stopped"
        if self.store.check([stopped]):
            word = json.loads(self.store.get(stopped))
            # Node 0 may stop on request; any other node stopping leaves the group short of its ranks.
            raise PeerStopped(f"{self.describe(node)} stopped: {word['reason']}", word["failed"] or node != 0)
        if not self.store.check([f"node/{node}/joined"]):
            return  # not started yet: rank 0 waits for its ranks to join (torch's timeout)
        count = self.store.add(f"node/{node}/beat", 0)
        now = self.clock()
        beat = self._beats.setdefault(node, _Heartbeat(count, PeerSilence(self.silence_timeout_s, now)))
        if count != beat.count:
            beat.count = count
            beat.silence.hear(now)
        elif beat.silence.lost(now):
            raise PeerStopped(
                f"{self.describe(node)} sent no heartbeat for {beat.silence.silent_s(now):.1f} s "
                f"(--watchdog-timeout {self.silence_timeout_s:g})"
            )

    def describe(self, node: int) -> str:
        if node == 0:
            return f"node 0 (the server at {self.nodes.master})"
        per_node = self.nodes.ranks_per_node(self.tensor_parallel_size)
        ranks = range(node * per_node, (node + 1) * per_node)
        shown = f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {ranks[0]}-{ranks[-1]}"
        return f"node {node} (tensor-parallel {shown})"

    def stop(self, reason: str, failed: bool) -> None:
        """Say why this node stops, before its ranks do. Node 0 then gives the others a moment to read it: its
        store goes with it."""
        self._stopping.set()
        self._heart.join()  # before the store can go: a thread left in a store call aborts the interpreter's exit
        try:
            word = json.dumps({"reason": reason, "failed": failed})
            self.store.set(f"node/{self.nodes.node_rank}/stopped", word)
        except (RuntimeError, OSError):
            return  # node 0 is gone already: nobody to tell
        if self.nodes.node_rank == 0:
            # Every node that read the word answers with its own as it stops.
            deadline = time.monotonic() + STOP_NOTICE_S
            others = [node for node in self._watched() if self.store.check([f"node/{node}/joined"])]
            while others and time.monotonic() < deadline:
                others = [node for node in others if not self.store.check([f"node/{node}/stopped"])]
                time.sleep(0.05)  # polling the local store, bounded by the deadline


class NodeHeartbeatError(RuntimeError):
    """The nodes cannot form one group (node 0 unreachable, flags that differ, a node rank taken)."""


def _one_line(exc: BaseException) -> str:
    return str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
