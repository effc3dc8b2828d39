"""Issue 12's probes against the real server: huge bodies and prompts, integers beyond 64 bits, slowloris
and idle connections. Each refusal is quick, leaves nothing behind, and the server keeps serving.

The server is the session's guarded_server (tests/conftest.py), shared with the API fuzzing: the limits
are the frontend's, so the engine behind runs no model."""

from __future__ import annotations

import json
import socket
import time

import httpx
import pytest

from frontend.errors import RETRY_AFTER_S
from tests.server_process import GUARDED_LIMITS, ServerProcess, wait_until
from tests.test_frontend_connection import final_response, request_bytes

HEADER_TIMEOUT_S = GUARDED_LIMITS["--timeout-headers"]
BODY_TIMEOUT_S = GUARDED_LIMITS["--timeout-body"]
MAX_CONNECTIONS = GUARDED_LIMITS["--max-connections"]


@pytest.fixture
def server(guarded_server):
    return guarded_server


def assert_serving(srv: ServerProcess) -> None:
    with srv.client() as c:
        assert c.get("/health").status_code == 200
        assert c.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2}).status_code == 200


def test_a_48_mb_prompt_is_refused_at_once(server):
    started = time.monotonic()
    with server.client() as c:
        response = c.post("/v1/completions", json={"prompt": "x" * 48_000_000})
    assert response.status_code == 413
    assert response.json()["error"]["code"] == "request_too_large"
    assert time.monotonic() - started < 10
    assert_serving(server)


def test_a_prompt_over_the_character_limit_is_refused_before_tokenizing(server):
    # The tiny GPT-2's context is 512 tokens: the default bound is 32 characters per token.
    with server.client() as c:
        response = c.post("/v1/completions", json={"prompt": "x" * (32 * 512 + 1)})
    assert response.status_code == 400
    assert response.json()["error"]["param"] == "prompt"
    assert_serving(server)


@pytest.mark.parametrize("field, value", [("top_k", 2**64), ("stop_token_ids", [2**64]), ("prompt", [2**64])])
def test_integers_beyond_64_bits_are_400_and_leave_no_stream(server, field, value):
    with server.client() as c:
        response = c.post("/v1/completions", json={"prompt": "hi", field: value})
        assert response.status_code == 400
        assert response.json()["error"]["param"] == field
        scheduler = c.get("/stats").json()["replies"]["scheduler"]["payload"]
    assert scheduler["num_running"] == 0 and scheduler["num_waiting"] == 0
    assert_serving(server)


def test_prompt_tokens_times_n_past_the_ceiling_are_refused_naming_n_and_leave_nothing_queued(server):
    ceiling = GUARDED_LIMITS["--max-request-prompt-tokens"]
    prompt = [7] * 300  # 300 tokens: n=13 is 3,900 prompt tokens, n=14 4,200
    with server.client() as c:
        refused = c.post("/v1/completions", json={"prompt": prompt, "n": ceiling // 300 + 1, "max_tokens": 2})
        assert refused.status_code == 400 and refused.json()["error"]["param"] == "n"

        def idle() -> bool:
            scheduler = c.get("/stats").json()["replies"]["scheduler"]["payload"]
            return scheduler["num_running"] == 0 and scheduler["num_waiting"] == 0

        wait_until(idle, 10, "the first sample aborted")
        served = c.post("/v1/completions", json={"prompt": prompt, "n": ceiling // 300, "max_tokens": 2})
        assert served.status_code == 200 and len(served.json()["choices"]) == ceiling // 300


def test_a_slowloris_connection_is_closed_after_the_header_timeout(server):
    with socket.create_connection(("127.0.0.1", server.port)) as sock:
        sock.settimeout(10)
        opened = time.monotonic()
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")
        closed = False
        for _ in range(50):  # a header line every 0.1 s, never the blank line that ends them
            try:
                sock.sendall(b"X-a: b\r\n")
            except OSError:
                closed = True
                break
            time.sleep(0.1)  # the trickle itself
        if not closed:
            closed = sock.recv(1024) == b""
    assert closed
    assert time.monotonic() - opened < HEADER_TIMEOUT_S + 3


def read_until_closed(sock: socket.socket) -> bytes:
    """Everything the server sends until it closes (a reset, when our bytes were left unread, ends it too)."""
    sock.settimeout(10)
    received = b""
    try:
        while chunk := sock.recv(65536):
            received += chunk
    except ConnectionResetError:
        pass
    return received


def request_with_headers(header_bytes: int) -> bytes:
    """A complete request whose header lines add up to about `header_bytes`."""
    lines = "".join(f"X-Filler-{i}: {'v' * 990}\r\n" for i in range(header_bytes // 1000))
    body = b'{"prompt": "hi", "max_tokens": 2}'
    return (
        f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nConnection: close\r\n"
        f"{lines}Content-Length: {len(body)}\r\n\r\n"
    ).encode() + body


def test_headers_under_the_64_kib_bound_are_served(server):
    # Past the bound: test_huge_headers_are_refused.
    with socket.create_connection(("127.0.0.1", server.port)) as sock:
        sock.sendall(request_with_headers(48_000))
        assert read_until_closed(sock).startswith(b"HTTP/1.1 200")


def test_a_header_that_never_ends_is_cut_off_at_64_kib_not_at_the_header_deadline(server):
    with socket.create_connection(("127.0.0.1", server.port)) as sock:
        opened = time.monotonic()
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nX-Endless: ")
        closed = False
        for _ in range(40):  # 40 x 4 KiB: the bound is passed halfway
            try:
                sock.sendall(b"v" * 4096)
            except OSError:
                closed = True
                break
        answer = b"" if closed else read_until_closed(sock)  # returns once the server has closed
    assert answer == b"" or answer.startswith(b"HTTP/1.1 400")
    assert time.monotonic() - opened < HEADER_TIMEOUT_S  # the bound closed it, not the header deadline
    assert_serving(server)


def post_headers(content_length: int) -> bytes:
    return (
        "POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        f"Content-Length: {content_length}\r\n\r\n"
    ).encode()


def closed_while_trickling(sock: socket.socket, piece: bytes, seconds: float) -> bool:
    """Send `piece` every 0.1 s for up to `seconds`: whether the server closed the connection meanwhile."""
    sock.settimeout(0.1)
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        try:
            sock.sendall(piece)
            if sock.recv(1024) == b"":
                return True
        except TimeoutError:
            continue  # nothing to read: the trickle goes on
        except OSError:
            return True
    return False


@pytest.mark.parametrize("trickle", [b"x", b""], ids=["trickled", "stopped"])
def test_a_body_not_sent_in_time_closes_the_connection(server, trickle):
    headers = post_headers(content_length=1000)
    with socket.create_connection(("127.0.0.1", server.port)) as sock:
        sent = time.monotonic()
        sock.sendall(headers + b'{"prompt": "')  # the headers in time (the header deadline is met), then a trickle
        assert closed_while_trickling(sock, trickle, BODY_TIMEOUT_S + 5)
        assert BODY_TIMEOUT_S - 0.5 < time.monotonic() - sent < BODY_TIMEOUT_S + 3
    scheduler = server.stats()["scheduler"]["payload"]
    assert scheduler["num_running"] == 0 and scheduler["num_waiting"] == 0
    assert "Traceback" not in server.log()
    assert_serving(server)


def test_a_body_sent_slowly_within_the_deadline_is_served(server):
    body = b'{"prompt": "hi", "max_tokens": 2}'
    with socket.create_connection(("127.0.0.1", server.port)) as sock:
        sock.settimeout(10)
        sock.sendall(post_headers(content_length=len(body)))
        for i in range(0, len(body), 4):  # longer than the header deadline, shorter than the body's
            sock.sendall(body[i : i + 4])
            time.sleep(HEADER_TIMEOUT_S * 1.2 / (len(body) / 4))
        assert sock.recv(1024).startswith(b"HTTP/1.1 200")


def test_idle_connections_are_closed_and_do_not_starve_the_server(server):
    sockets = [socket.create_connection(("127.0.0.1", server.port)) for _ in range(200)]
    try:
        for sock in sockets:
            sock.settimeout(10)

        def all_closed() -> bool:
            return all(sock.recv(1) == b"" for sock in sockets)

        wait_until(all_closed, timeout=HEADER_TIMEOUT_S + 8, what="the server to close idle connections")
        assert_serving(server)
    finally:
        for sock in sockets:
            sock.close()


def test_beyond_the_connection_cap_requests_get_a_503(server):
    sockets = [socket.create_connection(("127.0.0.1", server.port)) for _ in range(MAX_CONNECTIONS + 6)]
    try:
        wait_until(
            lambda: httpx.get(f"{server.url}/health", timeout=5).status_code == 503,
            timeout=5,
            what="a 503 past --max-connections",
        )
        refused = httpx.post(f"{server.url}/v1/completions", json={"prompt": "hi"}, timeout=5)
        assert refused.status_code == 503
        assert refused.json()["error"]["code"] == "too_many_connections"  # the OpenAI shape, as every refusal
        assert refused.headers["retry-after"] == str(RETRY_AFTER_S) and refused.headers["connection"] == "close"
    finally:
        for sock in sockets:
            sock.close()
    wait_until(lambda: httpx.get(f"{server.url}/health", timeout=5).status_code == 200, timeout=5, what="health")


def test_huge_headers_are_refused(server):
    try:
        status = httpx.get(f"{server.url}/health", headers={"X-big": "a" * 200_000}, timeout=10).status_code
    except httpx.TransportError:  # a 400 and the connection closed while the client was still sending
        status = 400
    assert status == 400
    assert_serving(server)


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_a_client_that_half_closes_after_its_request_gets_the_whole_response(server, stream):
    """`printf 'POST ...' | nc -N`: the client closes its side once the request is sent, as HTTP/1.1 allows."""
    with socket.create_connection(("127.0.0.1", server.port)) as sock:
        sock.sendall(request_bytes("/v1/completions", {"prompt": "hi", "max_tokens": 4, "stream": stream}))
        sock.shutdown(socket.SHUT_WR)
        status, _, body = final_response(read_until_closed(sock))
    assert status == 200
    if stream:
        assert body.decode().rstrip().endswith("data: [DONE]")
    else:
        assert json.loads(body)["usage"]["completion_tokens"] == 4
