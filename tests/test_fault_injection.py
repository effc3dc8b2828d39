"""Fault injection: a child killed (SIGKILL) or stopped (SIGSTOP) while streams are open, for each engine
role. Every open client gets an error event and [DONE] within the watchdog's bound, the launcher exits
non-zero naming the process, nothing is left running, and the run directory is gone. Ctrl-C with a stream
open ends it the same way (exit code 0). A process that answers its pings but whose loop is stuck in one turn
with work waiting is stuck too; a long step that ends is not. Among two engine replicas, a silent one is taken
out while the other serves, or stops the server with --exit-on-replica-failure. (A dead engine replica's
streams among two, on a real model: tests/test_data_parallel.py.)

Each case needs a server of its own (it ends it), so each is as cheap as can be: one tokenizer worker, and an
engine that runs no model (--load-format null: the tiny GPT-2's tokenizer, placeholder tokens), whose GPU
worker starts without torch; what is faulted is the process, whatever it computes. (A GPU worker running a
real model, killed: tests/test_data_parallel.py and tests/test_tensor_parallel.py.) One request runs at a
time, so the streams behind the first are still open when the fault comes."""

from __future__ import annotations

import os
import signal
import socket
import time

import httpx
import pytest

from gpu_worker.null_runner import STEP_S_ENV
from tests.server_process import (
    ServerProcess,
    assert_every_stream_ended_with_an_error_and_done,
    assert_nothing_left,
    open_streams,
    pid_alive,
    stream_endings,
    wait_until,
)
from tests.test_frontend_connection import final_response, read_until_closed

WATCHDOG_S = 3
STREAMS = 3
STREAM_TOKENS = 1500  # each stream: ~0.5 s of placeholder tokens, as long as 400 tokens of the tiny GPT-2
# A fault is seen at once (a sentinel) or after the watchdog's silence plus one tick; then the frontends
# fail their streams at once. The launcher kills a process the watchdog declared stuck at once (it could not
# run a SIGTERM handler), any other that ignores SIGTERM after 5 s. Before the streams are failed the launcher
# asks every other process for its summary line (1 s at most).
STREAMS_END_WITHIN_S = {signal.SIGKILL: 3, signal.SIGSTOP: WATCHDOG_S + 1 + 1 + 2}
LAUNCHER_EXITS_WITHIN_S = 20


def start_server(
    model, tmp_path, *flags: str, sigint_ignored: bool = False, step_s: float | None = None
) -> ServerProcess:
    """`step_s`: how long each engine step takes (the null engine's CLEARSERVE_NULL_STEP_S), its loop blocked."""
    return ServerProcess(
        model,
        "--load-format",
        "null",
        "--max-num-seqs",
        "1",
        "--watchdog-timeout",
        str(WATCHDOG_S),
        "--tokenizer-workers",
        "1",
        *flags,
        log_path=tmp_path / "server.log",
        sigint_ignored=sigint_ignored,
        env={STEP_S_ENV: str(step_s)} if step_s is not None else None,
    )


@pytest.mark.parametrize("role", ["gpu_worker", "scheduler", "tokenizer-0"])
@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGSTOP], ids=["kill-9", "sigstop"])
def test_a_dead_or_stuck_child_ends_every_open_stream_with_an_error(null_gpt2, tmp_path, role, sig):
    srv = start_server(null_gpt2, tmp_path)
    try:
        pids = srv.child_pids()
        futures = open_streams(srv, STREAMS, STREAM_TOKENS)
        faulted = time.monotonic()
        os.kill(pids[role], sig)
        assert_every_stream_ended_with_an_error_and_done(futures, STREAMS_END_WITHIN_S[sig])
        assert time.monotonic() - faulted < STREAMS_END_WITHIN_S[sig]
        assert srv.proc.wait(timeout=LAUNCHER_EXITS_WITHIN_S) == 1
        assert role in srv.log()
        assert ("answered no ping" if sig == signal.SIGSTOP else "died") in srv.log()
        if sig == signal.SIGSTOP:  # killed at once, not sent a SIGTERM it cannot act on and waited for
            assert f"process {role} is stuck: killing it" in srv.log()
            assert "did not stop on SIGTERM" not in srv.log()
        assert_nothing_left(srv, pids)
    finally:
        srv.stop(signal.SIGKILL)


def test_ctrl_c_with_streams_open_ends_them_with_an_error_and_exits_cleanly(null_gpt2, tmp_path):
    # Started as `python launch.py &` from a script is: with SIGINT ignored, which Python would keep.
    srv = start_server(null_gpt2, tmp_path, sigint_ignored=True)
    try:
        pids = srv.child_pids()
        futures = open_streams(srv, STREAMS, STREAM_TOKENS)
        interrupted = time.monotonic()
        srv.proc.send_signal(signal.SIGINT)
        assert_every_stream_ended_with_an_error_and_done(futures, 5)
        assert srv.proc.wait(timeout=5) == 0
        assert time.monotonic() - interrupted < 5
        assert "Traceback" not in srv.log()
        assert_nothing_left(srv, pids)
    finally:
        srv.stop(signal.SIGKILL)


def test_a_killed_frontend_drops_its_connections_at_once_and_stops_the_server(null_gpt2, tmp_path):
    # No process is left to write an error event: its clients see their connections close, not a hang.
    srv = start_server(null_gpt2, tmp_path)
    try:
        pids = srv.child_pids()
        futures = open_streams(srv, STREAMS, STREAM_TOKENS)
        os.kill(pids["frontend-0"], signal.SIGKILL)
        deadline = time.monotonic() + 3
        dropped = 0
        for future in futures:
            try:
                events = future.result(timeout=max(0.1, deadline - time.monotonic()))
            except httpx.TransportError:
                dropped += 1
            else:  # finished before the kill
                assert events[-1] == "[DONE]" and events[-2]["choices"][0]["finish_reason"] == "length"
        assert dropped >= 1
        assert srv.proc.wait(timeout=LAUNCHER_EXITS_WITHIN_S) == 1
        assert "frontend-0" in srv.log()
        assert_nothing_left(srv, pids)
    finally:
        srv.stop(signal.SIGKILL)


ITERATION_TIMEOUT_S = 2
# No progress for the iteration timeout, seen at a watchdog tick (each second), from answers one tick old.
STUCK_SEEN_WITHIN_S = ITERATION_TIMEOUT_S + 2 + 2


def test_a_loop_stuck_in_one_step_with_its_control_thread_answering_stops_the_server_naming_it(null_gpt2, tmp_path):
    # The engine's first step never ends (the GPU worker's loop blocked, as a hung device step blocks it);
    # its control thread answers every ping all along.
    flags = ("--engine-iteration-timeout", str(ITERATION_TIMEOUT_S))
    srv = start_server(null_gpt2, tmp_path, *flags, step_s=600)
    try:
        pids = srv.child_pids()
        futures = open_streams(srv, 1, first_text=False)
        blocked = time.monotonic()
        assert srv.proc.wait(timeout=LAUNCHER_EXITS_WITHIN_S) == 1
        assert time.monotonic() - blocked < STUCK_SEEN_WITHIN_S + 5  # + the shutdown: the summary, the streams
        assert stream_endings(futures, 1) == ["error server_stopping"]
        log = srv.log()
        assert f"process gpu_worker (pid {pids['gpu_worker']}) made no progress for" in log
        assert f"s with work waiting (--engine-iteration-timeout {ITERATION_TIMEOUT_S})" in log
        assert "answered no ping" not in log
        assert "process gpu_worker is stuck: killing it" in log
        assert_nothing_left(srv, pids)
    finally:
        srv.stop(signal.SIGKILL)


def test_steps_longer_than_the_ping_timeout_are_progress_not_a_hang(null_gpt2, tmp_path):
    # Each step is longer than the watchdog's silence bound, and the request's three steps together longer than
    # the iteration timeout: every step that ends is a turn, and the control thread answers throughout.
    flags = ("--watchdog-timeout", "2", "--engine-iteration-timeout", "5")
    srv = start_server(null_gpt2, tmp_path, *flags, step_s=2.5)
    try:
        started = time.monotonic()
        with srv.client() as c:
            body = c.post("/v1/completions", json={"prompt": "x", "max_tokens": 3, "ignore_eos": True}).json()
            assert time.monotonic() - started > 5
            assert body["usage"]["completion_tokens"] == 3
            assert c.get("/health").json() == {"status": "ok"}
        assert srv.proc.poll() is None
        assert "made no progress" not in srv.log() and "answered no ping" not in srv.log()
    finally:
        assert srv.stop() == 0


# ---------------------------------------------------------------- one engine replica of two


def start_two_replicas(model, tmp_path, *flags: str) -> ServerProcess:
    # Steps of 5 ms: a stream of 400 tokens stays open 2 s, long enough to be faulted.
    return start_server(model, tmp_path, "--data-parallel-size", "2", *flags, step_s=0.005)


def test_a_silent_replica_is_taken_out_its_streams_end_with_an_error_and_the_other_serves(null_gpt2, tmp_path):
    srv = start_two_replicas(null_gpt2, tmp_path)
    try:
        pids = srv.child_pids()
        # One tokenizer worker routes four streams in turn: two to each replica (least load, then index).
        futures = open_streams(srv, 4)
        os.kill(pids["scheduler-1"], signal.SIGSTOP)
        endings = stream_endings(futures, STREAMS_END_WITHIN_S[signal.SIGSTOP] + 4)
        assert sorted(endings) == ["error replica_failed", "error replica_failed", "length", "length"]
        assert "process scheduler-1" in srv.log() and "engine replica 1 is out, 1 of 2 still serve" in srv.log()
        # Its processes are gone (a stopped one killed), the server's others all still run.
        gone = [pids["scheduler-1"], pids["gpu_worker-1"]]
        wait_until(lambda: not any(pid_alive(pid) for pid in gone), timeout=5, what="replica 1's processes to exit")
        with srv.client() as c:
            for _ in range(4):
                body = {"prompt": "x", "max_tokens": 3, "ignore_eos": True}
                assert c.post("/v1/completions", json=body).json()["usage"]["completion_tokens"] == 3
            health = c.get("/health")
            assert health.status_code == 200
            assert health.json() == {"status": "degraded", "engine_replicas": 2, "engine_replicas_alive": 1}
        assert srv.proc.poll() is None
        assert srv.stop() == 0
        assert_nothing_left(srv, pids)
    finally:
        srv.stop(signal.SIGKILL)


def test_with_exit_on_replica_failure_a_dead_replica_stops_the_server(null_gpt2, tmp_path):
    srv = start_two_replicas(null_gpt2, tmp_path, "--exit-on-replica-failure")
    try:
        pids = srv.child_pids()
        futures = open_streams(srv, 4)
        os.kill(pids["gpu_worker-1"], signal.SIGKILL)
        assert_every_stream_ended_with_an_error_and_done(futures, STREAMS_END_WITHIN_S[signal.SIGKILL])
        assert srv.proc.wait(timeout=LAUNCHER_EXITS_WITHIN_S) == 1
        assert f"process gpu_worker-1 (pid {pids['gpu_worker-1']}) died with exit code -9" in srv.log()
        assert "is out" not in srv.log()
        assert_nothing_left(srv, pids)
    finally:
        srv.stop(signal.SIGKILL)


def answer_of_a_new_connection(port: int) -> str:
    """A GET /v1/models on a new connection: its status ("503" only with Retry-After), "refused" (nothing
    listens), or "reset" (connected, then cut without an answer)."""
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
            sock.sendall(b"GET /v1/models HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
            status, headers, _ = final_response(read_until_closed(sock))
    except ConnectionRefusedError:
        return "refused"
    except (ConnectionResetError, IndexError):  # IndexError: closed before a status line
        return "reset"
    return str(status) if status != 503 or "retry-after" in headers else "503 without Retry-After"


def test_after_a_fault_new_requests_get_a_503_until_the_listener_closes_not_a_reset(null_gpt2, tmp_path):
    srv = start_server(null_gpt2, tmp_path)
    try:
        pids = srv.child_pids()
        os.kill(pids["scheduler"], signal.SIGKILL)
        answers = [answer_of_a_new_connection(srv.port)]
        deadline = time.monotonic() + LAUNCHER_EXITS_WITHIN_S
        while answers[-1] != "refused":
            assert time.monotonic() < deadline, answers[-5:]
            answers.append(answer_of_a_new_connection(srv.port))
        assert "503" in answers, answers
        assert set(answers) <= {"200", "503", "reset", "refused"}, answers
        # A connection that reached the backlog just as the last frontend closed it is reset: the one before
        # the refusals, if any; never one while the server still answers.
        assert "reset" not in answers[:-2], answers
        assert srv.proc.wait(timeout=LAUNCHER_EXITS_WITHIN_S) == 1
        assert_nothing_left(srv, pids)
    finally:
        srv.stop(signal.SIGKILL)
