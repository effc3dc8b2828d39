"""Plans for the tensor-parallel ranks on other nodes: rank 0 broadcasts each plan's bytes, as received, over a
gloo group of itself and those ranks (CPU tensors over TCP, whatever the model's backend). No socket of our own
crosses hosts, and the ranks get every plan in the same order, as from the local relay sockets.

    rank 0 ── _receive: relay.send(bytes) ──▶ PlanBroadcast ══ gloo broadcast ══▶ PlanReceiver thread (rank g)
                                                                                   └─ inproc PUSH ─▶ WorkerLoop's plans

A follower's loop polls a ZeroMQ socket (it answers control pings between plans), so a thread waits in the
broadcast and hands each plan to it over an inproc socket. When rank 0 goes, the broadcast fails at once (gloo
sees the connection close): the thread logs it and ends the process, exit code LOST_RANK_0, since its main thread
may be waiting in a collective that can never complete.

Each plan is one broadcast of HEADER_BYTES (its length, then the plan itself where it fits: every decode step's
plan does) or, for a larger one (new prompts), a second broadcast of the rest.
"""

from __future__ import annotations

import logging
import os
import struct
import threading
from datetime import timedelta

import torch
import torch.distributed as dist
import zmq

from common.nodes import Nodes
from common.transport import push_socket

HEADER_BYTES = 4096
_LENGTH = struct.Struct("<q")
INLINE_BYTES = HEADER_BYTES - _LENGTH.size
# A follower waits in the broadcast while the server is idle: no wait is too long (gloo's default is 30 min).
IDLE_TIMEOUT = timedelta(days=365)
LOST_RANK_0 = 3  # a follower's exit code when rank 0 is gone
log = logging.getLogger(__name__)


def join_plan_group(nodes: Nodes, tensor_parallel_size: int) -> dist.ProcessGroup | None:
    """The group of rank 0 and the ranks on other nodes; None on one node. Every rank calls it (torch's rule
    for new_group), right after joining the tensor-parallel group."""
    if not nodes.multi_node:
        return None
    members = [0, *nodes.remote_ranks(tensor_parallel_size)]
    return dist.new_group(ranks=members, backend="gloo", timeout=IDLE_TIMEOUT)


class PlanBroadcast:
    """Rank 0's side: `send` as a relay socket's, so the worker loop relays to it as to a local rank."""

    def __init__(self, group: dist.ProcessGroup):
        self.group = group
        self.header = torch.zeros(HEADER_BYTES, dtype=torch.uint8)

    def send(self, data: bytes) -> None:
        header = self.header.numpy()
        _LENGTH.pack_into(header, 0, len(data))
        inline = min(len(data), INLINE_BYTES)
        header[_LENGTH.size : _LENGTH.size + inline] = memoryview(data)[:inline]
        dist.broadcast(self.header, 0, group=self.group)
        if len(data) > inline:
            rest = torch.frombuffer(bytearray(memoryview(data)[inline:]), dtype=torch.uint8)
            dist.broadcast(rest, 0, group=self.group)

    def close(self, linger: int | None = None) -> None:
        """Nothing to close (the group goes with the process group); the worker loop closes relays."""


class PlanReceiver:
    """A follower's side: a thread that takes each broadcast plan and pushes its bytes to `endpoint` (inproc,
    bound by the worker loop's socket), which the worker loop pulls from."""

    def __init__(self, group: dist.ProcessGroup, ctx: zmq.Context, endpoint: str, rank: int):
        self.group = group
        self.rank = rank
        self.out = push_socket(ctx, endpoint)  # used by the thread alone
        self.thread = threading.Thread(target=self._run, name="plan-receiver", daemon=True)

    def start(self) -> None:
        self.thread.start()

    def _run(self) -> None:
        header = torch.zeros(HEADER_BYTES, dtype=torch.uint8)
        try:
            while True:
                self.out.send(self._receive(header))
        except RuntimeError as exc:
            log.error("tensor-parallel rank %d lost rank 0 (its node's server stopped or died): %s", self.rank, exc)
            logging.shutdown()
            os._exit(LOST_RANK_0)

    def _receive(self, header: torch.Tensor) -> bytes:
        dist.broadcast(header, 0, group=self.group)
        view = header.numpy()
        (length,) = _LENGTH.unpack_from(view, 0)
        data = view[_LENGTH.size : _LENGTH.size + min(length, INLINE_BYTES)].tobytes()
        if length <= INLINE_BYTES:
            return data
        rest = torch.empty(length - INLINE_BYTES, dtype=torch.uint8)
        dist.broadcast(rest, 0, group=self.group)
        return data + rest.numpy().tobytes()
