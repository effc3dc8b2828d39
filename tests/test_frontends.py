"""Several HTTP frontend processes on one port (--api-server-count): requests spread over them and are answered
as the in-process engine answers them, /metrics and /stats cover every frontend, a port in use fails before
anything starts, and a dead frontend ends the server like any other child."""

from __future__ import annotations

import importlib.util
import os
import re
import signal
import socket
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from common.sampling_params import SamplingParams
from offline import LLM
from tests.server_process import ROOT, ServerProcess, pid_alive, wait_until

PROMPTS = [f"prompt number {i}:" for i in range(12)]
MAX_TOKENS = 8


@pytest.fixture(scope="module")
def server(tiny_llama, tmp_path_factory):
    log = tmp_path_factory.mktemp("log") / "server.log"
    # One tokenizer worker: it answers both frontends (with two, request ids route frontend k to tokenizer k).
    srv = ServerProcess(
        tiny_llama, "--num-kv-blocks", "256", "--api-server-count", "2", "--tokenizer-workers", "1", log_path=log
    )
    yield srv
    srv.stop()


def complete(server: ServerProcess, prompt: str) -> tuple[str, str]:
    """(response id, text) of one streamed greedy completion, read on a connection of its own."""
    body = {"prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0, "stream": True}
    text, rid = "", ""
    with httpx.Client(base_url=server.url, timeout=60) as c, c.stream("POST", "/v1/completions", json=body) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: {"):
                chunk = httpx.Response(200, content=line[6:]).json()
                rid = chunk["id"]
                text += chunk["choices"][0]["text"]
    return rid, text


def metric(text: str, name: str) -> float:
    match = re.search(rf"^{re.escape(name)} (\S+)$", text, re.M)
    return float(match.group(1)) if match else 0.0


def test_concurrent_streams_spread_over_both_frontends_and_match_the_in_process_engine(server, tiny_llama):
    expected = [
        o.text
        for o in LLM(str(tiny_llama), device="cpu").generate(
            PROMPTS, SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0)
        )
    ]
    with ThreadPoolExecutor(len(PROMPTS)) as pool:
        results = list(pool.map(lambda p: complete(server, p), PROMPTS))
    assert [text for _, text in results] == expected
    # Request ids are n * 2 + k for frontend k: both frontends took requests.
    frontends = {int(rid.rsplit("-", 1)[1]) % 2 for rid, _ in results}
    assert frontends == {0, 1}


def test_metrics_add_up_the_requests_of_every_frontend(server):
    def finished() -> float:
        with server.client() as c:
            return metric(c.get("/metrics").text, 'clearserve_requests_finished_total{finish_reason="length"}')

    before = finished()
    with ThreadPoolExecutor(8) as pool:
        list(pool.map(lambda i: complete(server, f"count me {i}"), range(8)))
    assert finished() - before == 8


def test_health_and_stats_cover_every_frontend(server):
    with server.client() as c:
        assert c.get("/health").json() == {"status": "ok"}
        body = c.get("/stats").json()
    assert body["silent"] == []
    assert set(body["replies"]) == {"frontend-0", "frontend-1", "gpu_worker", "scheduler", "tokenizer-0"}
    frontend_pids = {body["replies"][f"frontend-{k}"]["pid"] for k in (0, 1)}
    assert len(frontend_pids) == 2 and server.proc.pid not in frontend_pids


def installed(module: str) -> bool:
    return importlib.util.find_spec(module) is not None


def test_the_frontends_run_on_uvloop_and_httptools_where_installed_and_on_asyncio_and_h11_when_asked(
    server, tiny_llama, tmp_path
):
    stats = server.stats()
    for k in (0, 1):
        payload = stats[f"frontend-{k}"]["payload"]
        assert payload["event_loop"] == ("uvloop" if installed("uvloop") else "asyncio")
        assert payload["http_parser"] == ("httptools" if installed("httptools") else "h11")
    plain = ServerProcess(
        tiny_llama,
        *("--load-format", "null", "--event-loop", "asyncio", "--http-parser", "h11"),
        log_path=tmp_path / "log",
    )
    try:
        payload = plain.stats()["frontend-0"]["payload"]
        assert (payload["event_loop"], payload["http_parser"]) == ("asyncio", "h11")
        _, text = complete(plain, "hello")
        assert text  # it serves
    finally:
        plain.stop()


def test_a_port_in_use_fails_at_once_without_starting_a_child(tiny_llama):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        done = subprocess.run(
            [sys.executable, str(ROOT / "launch.py"), "--model", str(tiny_llama), "--port", str(port)],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=60,
        )
    assert done.returncode != 0
    assert f"cannot listen on 127.0.0.1:{port}" in done.stderr
    assert "ready" not in done.stdout and "gpu_worker" not in done.stderr


# Last: it ends the module's server.
def test_a_killed_frontend_stops_the_server_naming_it_and_leaves_nothing_behind(server):
    pids = server.child_pids()
    os.kill(pids["frontend-1"], signal.SIGKILL)
    assert server.proc.wait(timeout=30) != 0
    assert re.search(r"process frontend-1 \(pid \d+\) died", server.log()), server.log()[-2500:]
    wait_until(lambda: not any(pid_alive(p) for p in pids.values()), timeout=15, what="every child to exit")
