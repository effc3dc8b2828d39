"""CurveZMQ on the link's TCP socket: the frontend node's server side (with its ZAP check of the client's key),
a headless node's client side, and the handshake failures both sides log.

A node with another secret derives another server key: the server cannot open its HELLO, and both sides see a
failed handshake (ZMQ_EVENT_HANDSHAKE_FAILED_*). A client that knows the server's public key but not the
secret presents another client key: the ZAP check below refuses it, with its address. Neither reaches the link.
"""

from __future__ import annotations

import logging
import time

import zmq
from zmq.utils import z85
from zmq.utils.monitor import recv_monitor_message

from common.cluster_secret import CurveKeys

ZAP_ENDPOINT = "inproc://zeromq.zap.01"  # where libzmq asks every handshake's verdict (RFC 27)
ZAP_DOMAIN = b"clearserve"
HANDSHAKE_FAILED = (
    zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL | zmq.EVENT_HANDSHAKE_FAILED_AUTH
)
REFUSAL_LOG_EVERY_S = 60.0  # a refused node retries every few hundred ms: one line, then a count a minute


def link_socket(ctx: zmq.Context, kind: int) -> zmq.Socket:
    sock = ctx.socket(kind)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.SNDHWM, 0)  # as every socket here: never drop (a lost node is handled by its heartbeat)
    sock.setsockopt(zmq.RCVHWM, 0)
    return sock


def make_server(sock: zmq.Socket, keys: CurveKeys) -> None:
    sock.curve_server = True
    sock.curve_secretkey = keys.server_secret
    sock.curve_publickey = keys.server_public
    sock.zap_domain = ZAP_DOMAIN


def make_client(sock: zmq.Socket, keys: CurveKeys) -> None:
    sock.curve_serverkey = keys.server_public
    sock.curve_publickey = keys.node_public
    sock.curve_secretkey = keys.node_secret


def handshake_monitor(sock: zmq.Socket) -> zmq.Socket:
    return sock.get_monitor_socket(HANDSHAKE_FAILED | zmq.EVENT_HANDSHAKE_SUCCEEDED)


def handshake_events(monitor: zmq.Socket) -> list[bool]:
    """The handshakes the monitor saw end since the last call: True for each success, False for each failure."""
    out = []
    while monitor.poll(0):
        event = recv_monitor_message(monitor)
        out.append(event["event"] == zmq.EVENT_HANDSHAKE_SUCCEEDED)
    return out


class RefusalLog:
    """Logs a refusal once, then how many more came, at most once a minute."""

    def __init__(self, log: logging.Logger):
        self._log = log
        self._last: dict[str, float] = {}
        self._since: dict[str, int] = {}

    def refused(self, what: str) -> None:
        now = time.monotonic()
        last = self._last.get(what)
        if last is not None and now - last < REFUSAL_LOG_EVERY_S:
            self._since[what] = self._since.get(what, 0) + 1
            return
        more = self._since.pop(what, 0)
        self._last[what] = now
        self._log.warning("refused %s%s", what, f" ({more} more since the last such line)" if more else "")


class ZapCheck:
    """The server's verdict on each client key: only the key every node derives from the cluster secret."""

    def __init__(self, ctx: zmq.Context, keys: CurveKeys, refusals: RefusalLog):
        self.sock = ctx.socket(zmq.REP)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.bind(ZAP_ENDPOINT)  # before the server socket binds: libzmq asks it from the first handshake
        self._allowed = keys.node_public
        self._refusals = refusals

    def answer(self) -> None:
        frames = self.sock.recv_multipart()
        version, request_id, _domain, address, _identity, mechanism = frames[:6]
        key = z85.encode(frames[6]) if mechanism == b"CURVE" and len(frames) > 6 else b""
        allowed = key == self._allowed
        if not allowed:
            self._refused(address.decode(errors="replace"))
        status = [b"200", b"OK"] if allowed else [b"400", b"not this cluster's key"]
        self.sock.send_multipart([version, request_id, *status, b"", b""])

    def _refused(self, address: str) -> None:
        self._refusals.refused(f"a node at {address}: its CurveZMQ key is not this cluster's")

    def close(self) -> None:
        self.sock.close(linger=0)
