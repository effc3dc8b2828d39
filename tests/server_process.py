"""Run the real server (`python launch.py ...`) as a subprocess for tests, and talk to it."""

from __future__ import annotations

import glob
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx

from common.transport import RUN_DIR_PREFIX

ROOT = Path(__file__).resolve().parent.parent
START_TIMEOUT_S = 180
# The HTTP limits of the shared server for hostile input (tests/conftest.py's guarded_server).
GUARDED_LIMITS = {
    "--max-request-body-bytes": 1_000_000,
    "--timeout-headers": 1.0,
    "--timeout-body": 2.0,
    "--max-connections": 64,
    "--max-request-prompt-tokens": 4096,
}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    """`python launch.py --model MODEL` on a free port, 2 tokenizer workers and 1 HTTP process unless `flags`
    say otherwise (a flag given twice: the last one counts). With `profile_dir`, profiling is available on
    request (--profile-dir). `sigint_ignored`: started as a non-interactive shell starts a `&` job, with
    SIGINT ignored. `env`: more environment variables for it. `start_timeout_s`: how long it may take to be
    ready."""

    def __init__(
        self,
        model: Path | str,
        *flags: str,
        log_path: Path,
        profile_dir: Path | None = None,
        sigint_ignored: bool = False,
        env: dict[str, str] | None = None,
        start_timeout_s: float = START_TIMEOUT_S,
    ):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        self.profile_dir = profile_dir
        if profile_dir is not None:
            flags = ("--profile-dir", str(profile_dir), *flags)
        self._log = open(log_path, "wb")  # noqa: SIM115 (closed by stop())
        cmd = [
            sys.executable,
            str(ROOT / "launch.py"),
            "--model",
            str(model),
            "--port",
            str(self.port),
            "--device",
            "cpu",
            "--tokenizer-workers",
            "2",
            "--api-server-count",
            "1",
            *flags,
        ]
        self.proc = subprocess.Popen(
            cmd,
            cwd=ROOT,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})},
            preexec_fn=(lambda: signal.signal(signal.SIGINT, signal.SIG_IGN)) if sigint_ignored else None,
        )
        self._wait_ready(start_timeout_s)

    def _wait_ready(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode} while starting:\n{self.log()}")
            if "ready on" in self.log():
                return
            time.sleep(0.1)  # polling the log file, bounded by the deadline above
        raise TimeoutError(f"server not ready after {timeout_s} s:\n{self.log()}")

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def client(self, **kwargs) -> httpx.Client:
        return httpx.Client(base_url=self.url, timeout=60, **kwargs)

    def stats(self) -> dict:
        with self.client() as c:
            return c.get("/stats").json()["replies"]

    def child_pids(self) -> dict[str, int]:
        return {role: reply["pid"] for role, reply in self.stats().items()}

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 30) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()
        return self.proc.returncode


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie is dead but not yet reaped: it holds nothing.
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def wait_until(predicate, timeout: float, what: str, interval: float = 0.05):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(interval)  # a poll with a deadline
    raise AssertionError(f"timed out after {timeout} s waiting for {what}")


# ---------------------------------------------------------------- a fault with streams open


def open_streams(srv: ServerProcess, count: int, max_tokens: int = 400, first_text: bool = True) -> list:
    """`count` long SSE streams (greedy, EOS ignored), read in threads; returns their futures (each: the events
    it got) once every stream has its answer's status (accepted, or refused) and, with `first_text`, one has its
    first text chunk: a fault that comes after that finds no request still on its way in."""
    answered = [threading.Event() for _ in range(count)]
    started = threading.Event()
    body = {"prompt": "x", "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, "stream": True}

    def read(answer: threading.Event) -> list:
        events: list = []
        try:
            with httpx.stream("POST", f"{srv.url}/v1/completions", json=body, timeout=120) as response:
                answer.set()
                if response.status_code != 200:  # not yet accepted when the fault came: a 503 of its own
                    response.read()
                    return [response.status_code, response.json()]
                for line in response.iter_lines():
                    if line.startswith("data: "):
                        data = line[len("data: ") :]
                        events.append(data if data == "[DONE]" else json.loads(data))
                        started.set()
        finally:
            answer.set()
        return events

    pool = ThreadPoolExecutor(count)
    futures = [pool.submit(read, answer) for answer in answered]
    pool.shutdown(wait=False)
    assert (started.wait(60) or not first_text) and all(answer.wait(60) for answer in answered), "no stream started"
    return futures


def assert_every_stream_ended_with_an_error_and_done(futures, within_s: float) -> None:
    deadline = time.monotonic() + within_s
    errors = 0
    for future in futures:
        events = future.result(timeout=max(0.1, deadline - time.monotonic()))
        if events and events[0] == 503:
            assert events[1]["error"]["type"] == "service_unavailable"
            errors += 1
            continue
        assert events and events[-1] == "[DONE]", events[-3:]
        last = events[-2]
        if "error" in last:
            errors += 1
            assert last["error"]["type"] == "service_unavailable"
        else:  # a stream that finished before the fault
            assert last["choices"][0]["finish_reason"] == "length"
    # At least one stream was still open when the fault came, and ended in an error.
    assert errors >= 1


def assert_nothing_left(srv: ServerProcess, pids: dict[str, int]) -> None:
    """Every child of the server's launcher has exited and its run directory is gone."""
    wait_until(lambda: not any(pid_alive(p) for p in pids.values()), timeout=10, what="every child to exit")
    assert glob.glob(os.path.join(tempfile.gettempdir(), f"{RUN_DIR_PREFIX}{srv.proc.pid}-*")) == []


def stream_endings(futures, within_s: float) -> list[str]:
    """How each stream (of open_streams) ended, in order: its finish reason ("length"), or "error <code>" for an
    error event (then [DONE]), or "<status> <code>" for one refused before it began."""
    deadline = time.monotonic() + within_s
    endings = []
    for future in futures:
        events = future.result(timeout=max(0.1, deadline - time.monotonic()))
        if events and isinstance(events[0], int):
            endings.append(f"{events[0]} {events[1]['error']['code']}")
            continue
        assert events and events[-1] == "[DONE]", events[-3:]
        last = events[-2]
        endings.append(f"error {last['error']['code']}" if "error" in last else last["choices"][0]["finish_reason"])
    return endings


class LauncherProcess:
    """`python launch.py ARGS` with its output in `log_path`: a node of a multi-node test that serves no HTTP here
    (a headless node), watched through its log."""

    def __init__(self, args: list[str], log_path: Path):
        self.log_path = log_path
        self._log = open(log_path, "wb")  # noqa: SIM115 (closed by stop())
        self.proc = subprocess.Popen(
            [sys.executable, str(ROOT / "launch.py"), *args],
            cwd=ROOT,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def wait_for_line(self, text: str, timeout_s: float) -> None:
        """Until `text` is in the log or the launcher has exited."""
        wait_until(lambda: text in self.log() or self.proc.poll() is not None, timeout_s, repr(text), interval=0.2)

    def child_pids(self) -> list[int]:
        with open(f"/proc/{self.proc.pid}/task/{self.proc.pid}/children") as f:
            return [int(pid) for pid in f.read().split()]

    def stop(self, sig: int = signal.SIGKILL, timeout_s: float = 30) -> int:
        """Send `sig` if it still runs, wait `timeout_s` for it (then kill it); its exit code."""
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()
        return self.proc.returncode
