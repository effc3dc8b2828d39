"""ZeroMQ plumbing: every endpoint of a server run, and typed send/receive over PUSH/PULL sockets.

All endpoints are ipc:// files in one private run directory (mode 0700). The receiving side binds; the
senders connect (fan-in where many send to one). One PUSH/PULL connection delivers in order, which is
why a request and its abort, taking the same path, can never overtake each other.

    frontend[k] ─tokenizer-{i}-requests─▶ tokenizer[i] ─scheduler-{r}-requests─▶ scheduler[r] ─worker-{r}-plans─▶ gpu[r]
    frontend[k] ◀─frontend-{k}-outputs─ tokenizer[i] ◀─tokenizer-{i}-tokens─ scheduler[r] ◀─scheduler-{r}-results─┘
    gpu_worker-{r} ─worker-{r}-plans-rank{t}─▶ gpu_worker-{r}-rank{t}    (tensor-parallel ranks: plans relayed)
    any ──launcher-ready──▶ launcher;   asker ──control-{role}──▶ any ──control-replies-{asker}──▶ asker

Request ids route both ways (common/request_ids.py): tokenizer worker rid % N, frontend rid % K. The engine
replica r is chosen by the tokenizer worker (tokenizer_worker/router.py), which remembers it for the abort.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from typing import Any

import zmq

from common.wire import decode, encode


@dataclass(frozen=True, slots=True)
class Endpoints:
    run_dir: str

    def _ipc(self, name: str) -> str:
        return f"ipc://{os.path.join(self.run_dir, name)}"

    def tokenizer_requests(self, index: int) -> str:
        return self._ipc(f"tokenizer-{index}-requests")

    def tokenizer_tokens(self, index: int) -> str:
        return self._ipc(f"tokenizer-{index}-tokens")

    def frontend_outputs(self, index: int) -> str:
        return self._ipc(f"frontend-{index}-outputs")

    # One of each per engine replica (common/engine_replica.py): replicas share no socket.
    def scheduler_requests(self, replica: int) -> str:
        return self._ipc(f"scheduler-{replica}-requests")

    def worker_plans(self, replica: int) -> str:
        return self._ipc(f"worker-{replica}-plans")

    def scheduler_results(self, replica: int) -> str:
        return self._ipc(f"scheduler-{replica}-results")

    def worker_rank_plans(self, replica: int, rank: int) -> str:
        """Tensor-parallel rank `rank` > 0 of a replica: the plans its rank 0 relays to it."""
        return self._ipc(f"worker-{replica}-plans-rank{rank}")

    def tensor_parallel_init(self, replica: int) -> str:
        """The file where a replica's tensor-parallel ranks meet (torch.distributed's file:// rendezvous); not
        ZeroMQ."""
        return os.path.join(self.run_dir, f"tensor-parallel-init-{replica}")

    @property
    def launcher_ready(self) -> str:
        return self._ipc("launcher-ready")

    @property
    def node_events(self) -> str:
        """The frontend node's link tells its launcher which headless nodes joined or were lost (node_link/)."""
        return self._ipc("launcher-node-events")

    def control(self, role: str) -> str:
        return self._ipc(f"control-{role}")

    def control_replies(self, asker: str) -> str:
        """Where the answers to `asker`'s control requests go (each asker binds its own)."""
        return self._ipc(f"control-replies-{asker}")


RUN_DIR_PREFIX = "clearserve-"


def make_run_dir() -> str:
    """A fresh private directory for this run's sockets (mode 0700: only this user can connect), named after
    the launcher's pid. Run directories of launchers that are gone (killed with SIGKILL, which no cleanup
    survives) are removed first."""
    import tempfile

    remove_stale_run_dirs(tempfile.gettempdir())
    path = tempfile.mkdtemp(prefix=f"{RUN_DIR_PREFIX}{os.getpid()}-")
    os.chmod(path, 0o700)
    return path


def remove_stale_run_dirs(parent: str) -> list[str]:
    """Remove this user's run directories whose launcher is no longer running; returns what was removed."""
    import shutil

    removed = []
    for name in os.listdir(parent):
        pid_text, dash, _ = name[len(RUN_DIR_PREFIX) :].partition("-")  # clearserve-{pid}-{random}
        path = os.path.join(parent, name)
        if not name.startswith(RUN_DIR_PREFIX) or not (pid_text.isdigit() and dash) or not os.path.isdir(path):
            continue
        if os.stat(path).st_uid != os.getuid() or _process_exists(int(pid_text)):
            continue
        shutil.rmtree(path, ignore_errors=True)
        removed.append(path)
    return removed


def _process_exists(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def pull_socket(ctx: zmq.Context, endpoint: str, bind: bool = True) -> zmq.Socket:
    sock = ctx.socket(zmq.PULL)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.RCVHWM, 0)
    sock.bind(endpoint) if bind else sock.connect(endpoint)
    return sock


def push_socket(ctx: zmq.Context, endpoint: str, bind: bool = False) -> zmq.Socket:
    sock = ctx.socket(zmq.PUSH)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.SNDHWM, 0)  # never drop or block on a slow peer: the peer's death is handled elsewhere
    sock.bind(endpoint) if bind else sock.connect(endpoint)
    return sock


@dataclass(slots=True)
class SocketStats:
    """Messages and bytes through one process's sockets, and the time spent in msgpack on them."""

    messages_in: int = 0
    messages_out: int = 0
    bytes_in: int = 0
    bytes_out: int = 0
    msgpack_encode_s: float = 0.0
    msgpack_decode_s: float = 0.0

    def encode(self, message: Any) -> bytes:
        """Encode a message about to be sent, counting it."""
        started = time.perf_counter()
        data = encode(message)
        self.msgpack_encode_s += time.perf_counter() - started
        self.messages_out += 1
        self.bytes_out += len(data)
        return data

    def decode(self, data: bytes) -> Any:
        """Decode a received message, counting it (an undecodable one too: it was received)."""
        started = time.perf_counter()
        try:
            return decode(data)
        finally:
            self.msgpack_decode_s += time.perf_counter() - started
            self.messages_in += 1
            self.bytes_in += len(data)


def send(sock: zmq.Socket, message: Any, stats: SocketStats | None = None) -> int:
    """Encode and send; returns the bytes sent. With `stats`, the message is counted there."""
    data = stats.encode(message) if stats is not None else encode(message)
    sock.send(data, copy=False)
    return len(data)


def recv(sock: zmq.Socket, flags: int = 0, stats: SocketStats | None = None) -> Any:
    data = sock.recv(flags, copy=True)
    return stats.decode(data) if stats is not None else decode(data)
