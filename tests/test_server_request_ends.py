"""Every way a request ends leaves nothing of it behind: the frontend routes no outputs to it any more
(`requests_open` in its /stats is 0) and the scheduler holds nothing of it. A table entry left behind on one
path would grow the frontend with every such request (the soak's question, docs/notes/benchmark-history.md).

One server with a --request-timeout and one tokenizer worker, whose engine runs no model (--load-format null:
placeholder tokens at once, the bookkeeping is what is checked); the scheduler is stopped (SIGSTOP) where a
request must wait for its verdict."""

from __future__ import annotations

import contextlib
import os
import signal
from collections.abc import Iterator

import httpx
import pytest

from tests.server_process import ServerProcess, wait_until

REQUEST_TIMEOUT_S = 1.0  # placeholder tokens come at once: only a request held at a stopped scheduler waits
LONG = {"prompt": "x", "max_tokens": 1500, "temperature": 0, "ignore_eos": True}  # ~0.5 s of placeholder tokens


@pytest.fixture(scope="module")
def server(null_gpt2, tmp_path_factory):
    srv = ServerProcess(
        null_gpt2,
        "--load-format",
        "null",
        "--request-timeout",
        str(REQUEST_TIMEOUT_S),
        "--tokenizer-workers",
        "1",
        log_path=tmp_path_factory.mktemp("log") / "server.log",
    )
    yield srv
    srv.stop()


@contextlib.contextmanager
def scheduler_stopped(srv: ServerProcess) -> Iterator[None]:
    """No verdict, no output while inside (well within the watchdog's 10 s)."""
    pid = srv.child_pids()["scheduler"]
    os.kill(pid, signal.SIGSTOP)
    try:
        yield
    finally:
        os.kill(pid, signal.SIGCONT)


def nothing_left(srv: ServerProcess) -> bool:
    stats = srv.stats()
    scheduler = stats["scheduler"]["payload"]
    return stats["frontend-0"]["payload"]["requests_open"] == 0 and (
        scheduler["num_running"] == scheduler["num_waiting"] == 0
    )


def finished_streamed(srv: ServerProcess) -> None:
    with srv.client() as c, c.stream("POST", "/v1/completions", json={"prompt": "hi", "stream": True}) as r:
        assert r.status_code == 200
        assert list(r.iter_lines())[-2] == "data: [DONE]"


def finished_whole(srv: ServerProcess) -> None:
    with srv.client() as c:
        assert c.post("/v1/completions", json={"prompt": "hi", "n": 2, "max_tokens": 4}).status_code == 200


def refused_by_the_engine(srv: ServerProcess) -> None:
    with srv.client() as c:  # prompt + max_tokens past the 2,048-token context: the tokenizer worker refuses it
        response = c.post("/v1/completions", json={"prompt": "hi " * 200, "max_tokens": 2000})
    assert response.status_code == 400


def cancelled_mid_stream(srv: ServerProcess) -> None:
    with srv.client() as c, c.stream("POST", "/v1/completions", json={**LONG, "stream": True}) as r:
        assert r.status_code == 200
        next(r.iter_lines())  # one event, then the client leaves


def cancelled_before_the_verdict(srv: ServerProcess) -> None:
    with scheduler_stopped(srv), httpx.Client(base_url=srv.url, timeout=0.5) as c, pytest.raises(httpx.ReadTimeout):
        c.post("/v1/completions", json=LONG)  # the client gives up before any answer


def timed_out(srv: ServerProcess) -> None:
    with scheduler_stopped(srv), srv.client() as c:
        response = c.post("/v1/completions", json=LONG)
    assert response.status_code == 504
    assert response.json()["error"]["code"] == "request_timeout"


def tokenized(srv: ServerProcess) -> None:
    with srv.client() as c:
        assert c.post("/tokenize", json={"prompt": "hi"}).status_code == 200


@pytest.mark.parametrize(
    "end",
    [
        finished_streamed,
        finished_whole,
        refused_by_the_engine,
        cancelled_mid_stream,
        cancelled_before_the_verdict,
        timed_out,
        tokenized,
    ],
)
def test_a_request_that_ended_leaves_nothing_in_the_frontend_or_the_scheduler(server, end):
    for _ in range(3):
        end(server)
    wait_until(lambda: nothing_left(server), timeout=10, what="no request left open")
