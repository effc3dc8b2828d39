"""The link's frames over its one TCP connection per node (ZeroMQ multipart, after the ROUTER's identity frame):

    [HELLO, NodeHello]   [WELCOME, NodeWelcome]   [REFUSED, NodeRefused]   [JOIN, NodeJoin]
    [BEAT]  each side, every second (common/heartbeat.py)  [BYE]  a node stopping  [DROPPED]  "you were given up on"
    [RELAY, channel, bytes]  a message for the ipc endpoint `channel` on the other host, as it was sent

A channel is the name of an ipc endpoint in the run directory (common/transport.py: "scheduler-2-requests",
"tokenizer-0-tokens", "control-scheduler-2", "control-replies-frontend-0"). Each side relays only to the
channels it bound for the other: a name outside them is dropped, so no peer can reach any other socket.
"""

from __future__ import annotations

import os

HELLO = b"hello"
WELCOME = b"welcome"
REFUSED = b"refused"
JOIN = b"join"
BEAT = b"beat"
BYE = b"bye"
DROPPED = b"dropped"
RELAY = b"relay"


def channel_of(endpoint: str) -> bytes:
    """An ipc endpoint's channel name: the same on both hosts, whatever their run directories."""
    return os.path.basename(endpoint).encode()
