"""A frontend's connections, on a raw socket against the app under uvicorn with the frontend's own protocol
(frontend/http_protocol.py) and server (frontend/process.py), on a scripted engine: a client that half-closes
after its request still gets the whole response; one that left is still noticed; a frontend told to stop
answers every request with a 503 until it closes."""

from __future__ import annotations

import contextlib
import json
import signal
import socket
import threading
import time
from collections.abc import Iterator

import pytest
import uvicorn

from frontend.app import build_app
from frontend.errors import RETRY_AFTER_S
from frontend.http_protocol import protocol_class
from frontend.process import AnnouncingServer
from frontend.stopping import STOPPING_ANSWERED_S, StoppingGate
from tests.fake_engine import FakeEngineClient, Script

DEADLINE_S = 10.0
PARSERS_AND_LOOPS = [("httptools", "uvloop"), ("httptools", "asyncio"), ("h11", "asyncio")]


@contextlib.contextmanager
def serving(engine: FakeEngineClient, parser: str, loop: str) -> Iterator[tuple[AnnouncingServer, int]]:
    gate = StoppingGate(build_app(engine))
    config = uvicorn.Config(
        gate, host="127.0.0.1", port=0, log_level="warning", lifespan="off", http=protocol_class(parser), loop=loop
    )
    server = AnnouncingServer(config, lambda: None, engine, gate)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + DEADLINE_S
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "uvicorn did not start"
        threading.Event().wait(0.005)  # readiness poll
    try:
        yield server, server.servers[0].sockets[0].getsockname()[1]
    finally:
        server.should_exit = True
        thread.join(DEADLINE_S)


@pytest.fixture
def engine() -> FakeEngineClient:
    return FakeEngineClient()


def request_bytes(path: str, body: dict, *headers: str) -> bytes:
    payload = json.dumps(body).encode()
    lines = [f"POST {path} HTTP/1.1", "Host: x", "Content-Type: application/json", f"Content-Length: {len(payload)}"]
    return "\r\n".join([*lines, *headers, "", ""]).encode() + payload


def read_until_closed(sock: socket.socket) -> bytes:
    sock.settimeout(DEADLINE_S)
    data = b""
    while chunk := sock.recv(65536):
        data += chunk
    return data


def final_response(data: bytes) -> tuple[int, dict[str, str], bytes]:
    """Status, headers and body (chunks joined) of the final response, after any interim 1xx ones."""
    while True:
        head, _, data = data.partition(b"\r\n\r\n")
        status = int(head.split(b" ")[1])
        if status >= 200:
            break
    lines = head.decode().split("\r\n")[1:]
    headers = {name.lower(): value.strip() for name, _, value in (line.partition(":") for line in lines)}
    if headers.get("transfer-encoding") == "chunked":
        body = b""
        while True:
            size_line, _, data = data.partition(b"\r\n")
            size = int(size_line, 16)
            if size == 0:
                break
            body, data = body + data[:size], data[size + 2 :]
        data = body
    return status, headers, data


@pytest.mark.parametrize("parser, loop", PARSERS_AND_LOOPS)
@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_a_client_that_half_closes_after_its_request_gets_the_whole_response(engine, parser, loop, stream):
    with serving(engine, parser, loop) as (_, port), socket.create_connection(("127.0.0.1", port)) as sock:
        sock.sendall(request_bytes("/v1/completions", {"prompt": "hi", "stream": stream}))
        sock.shutdown(socket.SHUT_WR)  # HTTP/1.1 allows it: the request is sent, nothing more will be
        status, headers, body = final_response(read_until_closed(sock))
    assert status == 200
    if stream:
        assert body.decode().rstrip().endswith("data: [DONE]")
        text = "".join(json.loads(line[6:])["choices"][0]["text"] for line in body.decode().split("\n\n")[:-2])
    else:
        text = json.loads(body)["choices"][0]["text"]
    assert text == "Hello, world"
    assert engine.aborted == []


@pytest.mark.parametrize("parser, loop", PARSERS_AND_LOOPS)
def test_a_client_that_closed_its_socket_whole_is_noticed_and_its_request_aborted(engine, parser, loop, monkeypatch):
    monkeypatch.setattr("frontend.http_protocol.PEER_PROBE_S", 0.1)
    engine.script = Script(answer=False)  # the request waits for its verdict until the client is seen gone
    with serving(engine, parser, loop) as (_, port):
        with socket.create_connection(("127.0.0.1", port)) as sock:
            sock.sendall(request_bytes("/v1/completions", {"prompt": "hi"}))
            assert engine.request_seen.wait(DEADLINE_S)
        assert engine.abort_seen.wait(DEADLINE_S), "the request outlived its client"
    assert engine.aborted == [engine.submitted[-1].rid]


@pytest.mark.parametrize("parser, loop", PARSERS_AND_LOOPS)
def test_a_stopping_frontend_answers_503_with_retry_after_until_it_closes(engine, parser, loop):
    engine.script = Script(finish_reason=None)  # a stream left open
    with serving(engine, parser, loop) as (server, port):
        with socket.create_connection(("127.0.0.1", port)) as open_stream:
            open_stream.sendall(request_bytes("/v1/completions", {"prompt": "hi", "stream": True}, "Connection: close"))
            assert engine.request_seen.wait(DEADLINE_S)
            server.handle_exit(signal.SIGTERM, None)
            told = time.monotonic()
            status, _, body = final_response(read_until_closed(open_stream))
        assert status == 200 and b'"code":"server_stopping"' in body and body.rstrip().endswith(b"data: [DONE]")
        answers = []
        while time.monotonic() - told < STOPPING_ANSWERED_S / 2:  # well within the frontend's last moments
            with socket.create_connection(("127.0.0.1", port)) as sock:
                sock.sendall(request_bytes("/v1/completions", {"prompt": "hi"}))
                answers.append(final_response(read_until_closed(sock)))
        assert answers
        for status, headers, body in answers:
            assert status == 503 and headers["retry-after"] == str(RETRY_AFTER_S)
            assert json.loads(body)["error"]["code"] == "server_stopping"
        deadline = time.monotonic() + DEADLINE_S
        while server.started and not server.should_exit:
            assert time.monotonic() < deadline, "the frontend did not go on to stop"
            threading.Event().wait(0.01)  # a poll with a deadline
    with pytest.raises(ConnectionRefusedError):
        socket.create_connection(("127.0.0.1", port), timeout=1)
