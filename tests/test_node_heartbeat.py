"""The launchers' link across nodes (common/node_heartbeat.py), in process over a loopback store: a node started with
other engine flags, or a node rank taken twice, is refused naming why; a node that stops or goes silent is lost,
named; node 0 stopping on request lets the others stop cleanly."""

from __future__ import annotations

import threading

import pytest

from common.node_heartbeat import NodeHeartbeat, NodeHeartbeatError, PeerStopped
from common.nodes import Nodes
from tests.server_process import free_port

CONFIG = {"dtype": "float32", "block_size": 16, "tensor_parallel_size": 2}


@pytest.fixture
def nodes(monkeypatch):
    """Node 0 and node 1 of two on a free port; every link made is stopped at the end (its heartbeat thread
    must not outlive the store)."""
    links: list[NodeHeartbeat] = []
    real_init = NodeHeartbeat.__post_init__
    monkeypatch.setattr(NodeHeartbeat, "__post_init__", lambda link: links.append(link) or real_init(link))
    port = free_port()
    yield Nodes(2, 0, "127.0.0.1", port), Nodes(2, 1, "127.0.0.1", port)
    for link in reversed(links):
        link.stop("the test ends", failed=False)


def test_a_node_started_with_other_engine_flags_is_refused_naming_them(nodes):
    node0 = NodeHeartbeat.host(nodes[0], CONFIG, 2, 5.0)
    with pytest.raises(NodeHeartbeatError, match="block_size 32 here, 16 on node 0"):
        NodeHeartbeat.join(nodes[1], {**CONFIG, "block_size": 32}, 2, 5.0)
    with pytest.raises(PeerStopped, match="node 1 \\(tensor-parallel rank 1\\) stopped: .*block_size"):
        node0.tick()


def test_a_node_rank_taken_twice_is_refused(nodes):
    NodeHeartbeat.host(nodes[0], CONFIG, 2, 5.0)
    NodeHeartbeat.join(nodes[1], CONFIG, 2, 5.0)
    with pytest.raises(NodeHeartbeatError, match="node 1 has already joined"):
        NodeHeartbeat.join(nodes[1], CONFIG, 2, 5.0)


def test_a_node_that_stops_is_lost_naming_it_and_why(nodes):
    node0 = NodeHeartbeat.host(nodes[0], CONFIG, 2, 5.0)
    node1 = NodeHeartbeat.join(nodes[1], CONFIG, 2, 5.0)
    node0.tick()
    node1.stop("process gpu_worker-rank1 died with exit code -9", failed=True)
    named = "node 1 \\(tensor-parallel rank 1\\) stopped: process gpu_worker-rank1"
    with pytest.raises(PeerStopped, match=named) as lost:
        node0.tick()
    assert lost.value.failed


def test_a_silent_node_is_lost_after_the_watchdog_timeout(nodes):
    node0 = NodeHeartbeat.host(nodes[0], CONFIG, 2, 5.0)
    node0.store.add("node/1/joined", 1)  # joined, and never beats
    now = [100.0]
    node0.clock = lambda: now[0]
    node0.tick()
    now[0] += 4.0
    node0.tick()  # within --watchdog-timeout
    now[0] += 2.0
    with pytest.raises(PeerStopped, match="node 1 \\(tensor-parallel rank 1\\) sent no heartbeat for 6.0 s"):
        node0.tick()


def test_node_0_stopping_on_request_stops_the_others_cleanly(nodes):
    node0 = NodeHeartbeat.host(nodes[0], CONFIG, 2, 5.0)
    node1 = NodeHeartbeat.join(nodes[1], CONFIG, 2, 5.0)
    stopping = threading.Thread(target=node0.stop, args=("interrupted", False))  # waits for node 1's word back
    stopping.start()
    with pytest.raises(PeerStopped, match="node 0 \\(the server at 127.0.0.1:\\d+\\) stopped: interrupted") as stop:
        node1.wait_for_word(10.0)
    assert not stop.value.failed
    node1.stop(str(stop.value), failed=False)
    stopping.join(timeout=10)
    assert not stopping.is_alive()
