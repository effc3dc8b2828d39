"""A headless node's link: joins the frontend node's and carries its replicas' traffic.

start ──HELLO (every HELLO_RETRY_S until answered)──▶ WELCOME: the endpoints back are bound, the launcher told
                                                   ▶ REFUSED, or the handshake fails (another secret): the
                                                     launcher told, and it stops (exit 2)
the launcher's "join" command (its replicas ready) ──JOIN──▶
BEAT every second; the frontend node silent for --watchdog-timeout, or DROPPED: this process exits 1 and the
launcher stops the node (its requests were, or will be, ended on the frontend node; a new start rejoins)
"""

from __future__ import annotations

import logging
import os
import time
import uuid

import zmq

from common.cluster_secret import CurveKeys
from common.control import ControlServer, frontend_role
from common.heartbeat import HEARTBEAT_S, PeerSilence
from common.loop_progress import LoopProgress
from common.node_messages import NodeHello, NodeRefused, NodeWelcome
from common.process import announce_ready, init_child_process
from common.profiling import ProcessStats
from common.transport import Endpoints, pull_socket, push_socket, send
from common.wire import decode, encode
from node_link import frames
from node_link.curve import handshake_events, handshake_monitor, link_socket, make_client

ROLE = "node_link"
JOIN = "join"  # the launcher's command: its replicas are ready (args: {"join": an encoded NodeJoin})
HELLO_RETRY_S = 2.0
FAILED_HANDSHAKES = 3  # in a row, none succeeding: the frontend node refuses this node's key
log = logging.getLogger("node_link")


def new_hello(node: str, replicas: list[int], model: str, block_size: int, dp: int, tp: int) -> NodeHello:
    return NodeHello(node, uuid.uuid4().hex, replicas, model, block_size, dp, tp)


class MemberLink:
    def __init__(
        self,
        endpoints: Endpoints,
        keys: CurveKeys,
        connect: str,
        hello: NodeHello,
        own_roles: dict[int, list[str]],
        timeout_s: float,
    ):
        ctx: zmq.Context = zmq.Context.instance()
        self.endpoints = endpoints
        self.connect = connect
        self.hello = hello
        self.dealer = link_socket(ctx, zmq.DEALER)
        self.dealer.setsockopt(zmq.IDENTITY, hello.incarnation.encode())
        make_client(self.dealer, keys)
        self.monitor = handshake_monitor(self.dealer)
        self.dealer.connect(connect)
        # To this node's processes: what the frontend node sends them, by channel.
        to_local = [endpoints.scheduler_requests(r) for r in own_roles]
        to_local += [endpoints.control(role) for roles in own_roles.values() for role in roles]
        self.to_local = {frames.channel_of(e): push_socket(ctx, e) for e in to_local}
        self.from_local: dict[zmq.Socket, bytes] = {}  # bound once welcomed (the frontend node's counts)
        self.launcher = push_socket(ctx, endpoints.launcher_ready)
        self.progress = LoopProgress()
        self.activity = ProcessStats()  # its sockets: the messages relayed, both ways
        self.control = ControlServer(endpoints, ROLE, stats=self.activity.summary, progress=self.progress)
        self.welcomed = False
        self.silence = PeerSilence(timeout_s, time.monotonic())  # the frontend node's frames, whatever they are
        self.last_beat = self.last_hello = 0.0
        self.failed_handshakes = 0
        self.refused = False

    def run(self) -> None:
        self.poller = zmq.Poller()
        self.poller.register(self.dealer, zmq.POLLIN)
        self.poller.register(self.monitor, zmq.POLLIN)
        while True:
            ready = dict(self.progress.idle_wait(self.poller.poll, int(HEARTBEAT_S * 1000 / 2)))
            with self.activity.busy():
                self._turn(ready)

    def _turn(self, ready: dict) -> None:
        for command in self.control.pending():
            if command.kind == JOIN:
                self.dealer.send_multipart([frames.JOIN, command.args["join"]])
            self.control.reply(command)
        if self.monitor in ready:
            self._count_handshakes()
        if self.dealer in ready:
            self._drain_dealer()
        for sock, channel in list(self.from_local.items()):
            if sock in ready:
                self._relay_to_head(sock, channel)
        self._keep_time(time.monotonic())

    def _count_handshakes(self) -> None:
        for succeeded in handshake_events(self.monitor):
            self.failed_handshakes = 0 if succeeded else self.failed_handshakes + 1
        if self.failed_handshakes == FAILED_HANDSHAKES and not self.welcomed:
            self._refused(
                f"the frontend node at {self.connect} refused this node's key: is the cluster secret "
                "(--cluster-secret-file, $CLEARSERVE_CLUSTER_SECRET) the same on every node?"
            )

    def _drain_dealer(self) -> None:
        while True:
            try:
                kind, *rest = self.dealer.recv_multipart(zmq.NOBLOCK, copy=True)
            except zmq.Again:
                return
            self.silence.hear(time.monotonic())
            if kind == frames.RELAY and len(rest) == 2:
                out = self.to_local.get(rest[0])
                if out is not None:
                    out.send(rest[1], copy=False)
                    self.activity.sockets.messages_in += 1
                    self.activity.sockets.bytes_in += len(rest[1])
            elif kind == frames.WELCOME and rest and not self.welcomed:
                self._on_welcome(decode(rest[0]))
            elif kind == frames.REFUSED and rest:
                self._refused(f"the frontend node at {self.connect} refused this node: {decode(rest[0]).reason}")
            elif kind == frames.DROPPED and self.welcomed:
                self._stop("the frontend node gave this node up (it heard nothing from it in time): restart it")

    def _on_welcome(self, welcome: NodeWelcome) -> None:
        ctx: zmq.Context = zmq.Context.instance()
        back = [self.endpoints.tokenizer_tokens(i) for i in range(welcome.num_tokenizers)]
        back += [self.endpoints.control_replies(frontend_role(k)) for k in range(welcome.num_frontends)]
        for endpoint in back:
            sock = pull_socket(ctx, endpoint)
            self.from_local[sock] = frames.channel_of(endpoint)
            self.poller.register(sock, zmq.POLLIN)
        self.welcomed = True
        log.info("welcomed by the frontend node at %s", self.connect)
        send(self.launcher, welcome)

    def _relay_to_head(self, sock: zmq.Socket, channel: bytes) -> None:
        while True:
            try:
                data = sock.recv(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            self.dealer.send_multipart([frames.RELAY, channel, data], copy=False)
            self.activity.sockets.messages_out += 1
            self.activity.sockets.bytes_out += len(data)

    def _keep_time(self, now: float) -> None:
        if not self.welcomed:
            if now - self.last_hello >= HELLO_RETRY_S:  # the frontend node may not be up yet: ZeroMQ reconnects
                self.last_hello = now
                self.dealer.send_multipart([frames.HELLO, encode(self.hello)])
            return
        if self.silence.lost(now):
            self._stop(f"the frontend node at {self.connect} sent nothing for {self.silence.silent_s(now):.1f} s")
        if now - self.last_beat >= HEARTBEAT_S:
            self.last_beat = now
            self.dealer.send_multipart([frames.BEAT])

    def _refused(self, reason: str) -> None:
        if not self.refused:  # the launcher stops the node on the first; the hellos' answers repeat it
            self.refused = True
            log.error("%s", reason)
            send(self.launcher, NodeRefused(reason))

    def _stop(self, reason: str) -> None:
        log.error("%s: stopping", reason)
        os._exit(1)

    def leave(self) -> None:
        """This node stops (SIGTERM from its launcher): the frontend node takes its replicas out at once."""
        if self.welcomed:
            self.dealer.send_multipart([frames.BYE])
            self.dealer.close(linger=1000)


def main(
    keys: CurveKeys,
    connect: str,
    hello: NodeHello,
    own_roles: dict[int, list[str]],
    timeout_s: float,
    run_dir: str,
    log_level: str,
    parent_pid: int,
) -> None:
    init_child_process(ROLE, log_level, parent_pid)
    link = MemberLink(Endpoints(run_dir), keys, connect, hello, own_roles, timeout_s)
    announce_ready(run_dir, ROLE)
    log.info("joining the frontend node at %s with replicas %s", connect, hello.replicas)
    try:
        link.run()
    except SystemExit:
        link.leave()
    logging.shutdown()
    os._exit(0)
