"""The frontend node's link: serves headless nodes' replicas to this node's tokenizer workers and frontends.

    headless node ──HELLO──▶ terms checked (terms.py) ──▶ WELCOME (or REFUSED)
                  ──JOIN───▶ NodeJoin to the launcher, which tells the routers (launch_cluster.py)
                  ──BEAT───▶ every second; none for --watchdog-timeout: the node is lost (NodeLost)
                  ──BYE────▶ the node stopped: lost at once

A new start of a node (another incarnation offering the same replicas) replaces the old one: the old one's
replicas are lost first, so their requests end with an error and the new one's empty schedulers take new ones.
A node given up on that speaks again is told DROPPED (it stops: its requests were already ended here).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import zmq

from common.cluster_secret import CurveKeys
from common.control import ControlServer, frontend_role
from common.heartbeat import HEARTBEAT_S, PeerSilence
from common.loop_progress import LoopProgress
from common.node_messages import NodeHello, NodeJoin, NodeLost, NodeRefused, NodeWelcome
from common.process import announce_ready, exit_child, init_child_process
from common.profiling import ProcessStats
from common.transport import Endpoints, pull_socket, push_socket, send
from common.wire import WireError, decode, encode
from node_link import frames
from node_link.curve import RefusalLog, ZapCheck, handshake_events, handshake_monitor, link_socket, make_server
from node_link.terms import ClusterTerms

ROLE = "node_link"
log = logging.getLogger("node_link")


@dataclass(slots=True)
class Node:
    name: str
    incarnation: str
    replicas: list[int]
    silence: PeerSilence  # its BEATs
    joined: bool = False


class HeadLink:
    def __init__(
        self,
        endpoints: Endpoints,
        keys: CurveKeys,
        bind: str,
        terms: ClusterTerms,
        welcome: NodeWelcome,
        remote_roles: dict[int, list[str]],
        timeout_s: float,
    ):
        ctx: zmq.Context = zmq.Context.instance()
        self.terms = terms
        self.welcome = encode(welcome)
        self.timeout_s = timeout_s
        self.refusals = RefusalLog(log)
        self.zap = ZapCheck(ctx, keys, self.refusals)
        self.router = link_socket(ctx, zmq.ROUTER)
        self.router.setsockopt(zmq.ROUTER_HANDOVER, 1)
        make_server(self.router, keys)
        self.monitor = handshake_monitor(self.router)
        self.router.bind(bind)
        # To the nodes: what this host's processes send to the remote replicas' endpoints, bound here.
        self.to_nodes: dict[zmq.Socket, tuple[int, bytes]] = {}
        for replica, roles in remote_roles.items():
            for endpoint in [endpoints.scheduler_requests(replica), *(endpoints.control(role) for role in roles)]:
                self.to_nodes[pull_socket(ctx, endpoint)] = (replica, frames.channel_of(endpoint))
        # From the nodes: the remote schedulers' tokens and the remote processes' control replies, to their owners.
        endpoints_back = [endpoints.tokenizer_tokens(i) for i in range(welcome.num_tokenizers)]
        endpoints_back += [endpoints.control_replies(frontend_role(k)) for k in range(welcome.num_frontends)]
        self.from_nodes = {frames.channel_of(e): push_socket(ctx, e) for e in endpoints_back}
        self.events = push_socket(ctx, endpoints.node_events)
        self.nodes: dict[bytes, Node] = {}
        self.holder: dict[int, bytes] = {}  # replica -> the node (identity) serving it
        self.progress = LoopProgress()
        self.control = ControlServer(endpoints, ROLE, stats=self.stats, progress=self.progress)
        self.activity = ProcessStats()  # its sockets: the messages relayed, both ways
        self.last_beat = 0.0

    def stats(self) -> dict:
        nodes = {node.name: {"replicas": node.replicas, "joined": node.joined} for node in list(self.nodes.values())}
        return {**self.activity.summary(), "nodes": nodes}

    def run(self) -> None:
        poller = zmq.Poller()
        for sock in (self.router, self.zap.sock, self.monitor, *self.to_nodes):
            poller.register(sock, zmq.POLLIN)
        while True:
            ready = dict(self.progress.idle_wait(poller.poll, int(HEARTBEAT_S * 1000 / 2)))
            with self.activity.busy():
                self._turn(ready)

    def _turn(self, ready: dict) -> None:
        for command in self.control.pending():
            self.control.reply(command)
        if self.zap.sock in ready:
            self.zap.answer()
        if self.monitor in ready and not all(handshake_events(self.monitor)):
            self.refusals.refused(
                "a connection: its CurveZMQ handshake failed (a node without the cluster secret, or with another)"
            )
        if self.router in ready:
            self._drain_router()
        for sock, (replica, channel) in self.to_nodes.items():
            if sock in ready:
                self._relay_to_node(sock, replica, channel)
        self._keep_time(time.monotonic())

    # ------------------------------------------------------------------ from the nodes

    def _drain_router(self) -> None:
        while True:
            try:
                identity, kind, *rest = self.router.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            except ValueError:  # a frame short of a kind: not a node of ours
                continue
            node = self.nodes.get(identity)
            if kind == frames.RELAY and node is not None and len(rest) == 2:
                out = self.from_nodes.get(rest[0])
                if out is not None:
                    out.send(rest[1], copy=False)
                    self.activity.sockets.messages_in += 1
                    self.activity.sockets.bytes_in += len(rest[1])
            elif kind == frames.HELLO and rest:
                self._on_hello(identity, rest[0])
            elif node is None:
                self.router.send_multipart([identity, frames.DROPPED])  # given up on: it must start afresh
            elif kind == frames.BEAT:
                node.silence.hear(time.monotonic())
            elif kind == frames.JOIN and rest:
                self._on_join(node, rest[0])
            elif kind == frames.BYE:
                self._lose(identity, f"node {node.name} stopped")

    def _on_hello(self, identity: bytes, data: bytes) -> None:
        try:
            hello = decode(data)
        except (WireError, ValueError) as exc:
            self.refusals.refused(f"a node's hello: {exc}")
            return
        if not isinstance(hello, NodeHello):
            return
        if identity in self.nodes:  # its hello again: the welcome was on its way
            self.router.send_multipart([identity, frames.WELCOME, self.welcome])
            return
        reason = self.terms.refusal(hello)
        if reason is not None:
            log.error("refused node %s: %s", hello.node, reason)
            self.router.send_multipart([identity, frames.REFUSED, encode(NodeRefused(reason))])
            return
        for replica in hello.replicas:
            holder = self.holder.get(replica)
            if holder is not None:
                self._lose(holder, f"a new start of its node ({hello.node}) took replica {replica} over")
        silence = PeerSilence(self.timeout_s, time.monotonic())
        self.nodes[identity] = Node(hello.node, hello.incarnation, list(hello.replicas), silence)
        for replica in hello.replicas:
            self.holder[replica] = identity
        log.info("node %s (replicas %s) welcomed: loading its replicas", hello.node, hello.replicas)
        self.router.send_multipart([identity, frames.WELCOME, self.welcome])

    def _on_join(self, node: Node, data: bytes) -> None:
        join = decode(data)
        if not isinstance(join, NodeJoin) or sorted(r.index for r in join.replicas) != sorted(node.replicas):
            log.error("node %s joined with replicas other than those it offered: ignored", node.name)
            return
        node.joined = True
        send(self.events, join)

    # ------------------------------------------------------------------ to the nodes

    def _relay_to_node(self, sock: zmq.Socket, replica: int, channel: bytes) -> None:
        identity = self.holder.get(replica)
        node = self.nodes.get(identity) if identity is not None else None
        if node is None or not node.joined:
            identity = None  # a request routed before the routers heard of a loss would wait in a new start's queue
        while True:
            try:
                data = sock.recv(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            # No node: the replica is out (its requests were ended), a late abort or ping has nobody to reach.
            if identity is not None:
                self.router.send_multipart([identity, frames.RELAY, channel, data], copy=False)
                self.activity.sockets.messages_out += 1
                self.activity.sockets.bytes_out += len(data)

    # ------------------------------------------------------------------ liveness

    def _keep_time(self, now: float) -> None:
        if now - self.last_beat < HEARTBEAT_S:
            return
        self.last_beat = now
        for identity, node in list(self.nodes.items()):
            if node.silence.lost(now):
                silent = node.silence.silent_s(now)
                self._lose(identity, f"node {node.name} sent no heartbeat for {silent:.1f} s (--watchdog-timeout)")
            else:
                self.router.send_multipart([identity, frames.BEAT])

    def _lose(self, identity: bytes, reason: str) -> None:
        node = self.nodes.pop(identity)
        for replica in node.replicas:
            if self.holder.get(replica) == identity:
                del self.holder[replica]
        log.error("%s: its replicas %s are out", reason, node.replicas)
        self.router.send_multipart([identity, frames.DROPPED])  # if it still hears us, it stops
        send(self.events, NodeLost(node.name, node.replicas, reason))


def main(
    keys: CurveKeys,
    bind: str,
    terms: ClusterTerms,
    welcome: NodeWelcome,
    remote_roles: dict[int, list[str]],
    timeout_s: float,
    run_dir: str,
    log_level: str,
    parent_pid: int,
) -> None:
    init_child_process(ROLE, log_level, parent_pid)
    try:
        link = HeadLink(Endpoints(run_dir), keys, bind, terms, welcome, remote_roles, timeout_s)
    except zmq.ZMQError as exc:
        log.error("cannot listen for headless nodes on %s: %s", bind, exc)
        raise SystemExit(1) from None
    announce_ready(run_dir, ROLE)
    log.info("listening for headless nodes on %s (CurveZMQ)", bind)
    try:
        link.run()
    except SystemExit:
        pass
    exit_child()
