"""The app behind a real HTTP server: the official OpenAI client works against it, and a client that
hangs up stops its request (the engine sees exactly one abort)."""

from __future__ import annotations

import contextlib
import json
import socket
import threading
import time
from collections.abc import Iterator

import openai
import pytest
import uvicorn

from frontend.app import build_app
from tests.fake_engine import FakeEngineClient, Script

API_KEY = "sesame"
DEADLINE_S = 10.0


@contextlib.contextmanager
def serving(engine: FakeEngineClient) -> Iterator[tuple[str, int]]:
    """Run the app under uvicorn on a free port in a thread; yields (host, port) once it accepts."""
    config = uvicorn.Config(
        build_app(engine, api_key=API_KEY), host="127.0.0.1", port=0, log_level="warning", lifespan="off"
    )
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + DEADLINE_S
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "uvicorn did not start"
        threading.Event().wait(0.005)  # readiness poll
    port = server.servers[0].sockets[0].getsockname()[1]
    try:
        yield "127.0.0.1", port
    finally:
        server.should_exit = True
        thread.join(DEADLINE_S)


@pytest.fixture
def engine() -> FakeEngineClient:
    return FakeEngineClient()


@pytest.fixture
def address(engine) -> Iterator[tuple[str, int]]:
    with serving(engine) as address:
        yield address


@pytest.fixture
def oai(address) -> openai.OpenAI:
    host, port = address
    return openai.OpenAI(base_url=f"http://{host}:{port}/v1", api_key=API_KEY, max_retries=0, timeout=DEADLINE_S)


# ---------------------------------------------------------------- the official OpenAI client


def test_openai_client_completion(oai):
    completion = oai.completions.create(model="fake-model", prompt="Say hi", max_tokens=5)
    assert completion.choices[0].text == "Hello, world"
    assert completion.choices[0].finish_reason == "stop"
    assert (completion.usage.prompt_tokens, completion.usage.completion_tokens, completion.usage.total_tokens) == (
        5,
        3,
        8,
    )


def test_openai_client_streamed_completion_with_usage(oai):
    chunks = list(
        oai.completions.create(model="fake-model", prompt="Say hi", stream=True, stream_options={"include_usage": True})
    )
    assert "".join(c.choices[0].text for c in chunks if c.choices) == "Hello, world"
    assert chunks[-1].usage.total_tokens == 8


def test_openai_client_chat(oai):
    chat = oai.chat.completions.create(model="fake-model", messages=[{"role": "user", "content": "Hi"}])
    assert chat.choices[0].message.role == "assistant"
    assert chat.choices[0].message.content == "Hello, world"
    assert chat.usage.completion_tokens == 3


def test_openai_client_streamed_chat(oai):
    chunks = list(
        oai.chat.completions.create(
            model="fake-model",
            messages=[{"role": "user", "content": "Hi"}],
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == "Hello, world"
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "stop"
    assert chunks[-1].usage.prompt_tokens == 5


def test_openai_client_lists_the_model(oai):
    assert [m.id for m in oai.models.list()] == ["fake-model"]


def test_openai_client_sees_the_bad_field(oai):
    with pytest.raises(openai.BadRequestError) as caught:
        oai.completions.create(model="fake-model", prompt="x", top_p=3.0)
    assert caught.value.status_code == 400
    assert caught.value.param == "top_p"


def test_openai_client_with_a_wrong_key_is_refused(address):
    host, port = address
    client = openai.OpenAI(base_url=f"http://{host}:{port}/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        client.completions.create(model="fake-model", prompt="x")


# ---------------------------------------------------------------- clients that hang up


def send_raw_request(address: tuple[str, int], path: str, body: dict) -> socket.socket:
    payload = json.dumps(body).encode()
    head = (
        f"POST {path} HTTP/1.1\r\nHost: test\r\nAuthorization: Bearer {API_KEY}\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(payload)}\r\n\r\n"
    ).encode()
    sock = socket.create_connection(address, timeout=DEADLINE_S)
    sock.sendall(head + payload)
    return sock


def read_until(sock: socket.socket, marker: bytes) -> bytes:
    received = b""
    while marker not in received:
        data = sock.recv(65536)
        assert data, f"connection closed before {marker!r}: {received!r}"
        received += data
    return received


def assert_aborted_once_and_still_serving(engine: FakeEngineClient, oai: openai.OpenAI) -> None:
    assert engine.abort_seen.wait(DEADLINE_S), "the request was not aborted"
    engine.script = Script()
    assert oai.completions.create(model="fake-model", prompt="x").choices[0].text == "Hello, world"
    assert engine.aborted == [engine.submitted[0].rid]


@pytest.mark.parametrize(
    "path, body",
    [
        ("/v1/completions", {"prompt": "x", "stream": True}),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "stream": True}),
        ("/generate", {"prompt": "x", "stream": True}),
    ],
)
def test_hanging_up_mid_stream_aborts_the_request_once(engine, address, oai, path, body):
    engine.script = Script(finish_reason=None)  # outputs, then the request stays open
    sock = send_raw_request(address, path, body)
    received = read_until(sock, b"world")
    assert received.startswith(b"HTTP/1.1 200")
    sock.close()
    assert_aborted_once_and_still_serving(engine, oai)


@pytest.mark.parametrize("stream", [False, True])
def test_hanging_up_before_the_engine_answers_aborts_the_request(engine, address, oai, stream):
    engine.script = Script(answer=False)
    sock = send_raw_request(address, "/v1/completions", {"prompt": "x", "stream": stream})
    assert engine.request_seen.wait(DEADLINE_S)
    sock.close()
    assert_aborted_once_and_still_serving(engine, oai)


def test_hanging_up_on_a_non_streaming_request_aborts_it(engine, address, oai):
    engine.script = Script(finish_reason=None)
    sock = send_raw_request(address, "/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}]})
    assert engine.request_seen.wait(DEADLINE_S)
    sock.close()
    assert_aborted_once_and_still_serving(engine, oai)


def test_a_finished_stream_is_not_aborted(engine, address, oai):
    assert "".join(c.choices[0].text for c in oai.completions.create(model="fake-model", prompt="x", stream=True))
    oai.completions.create(model="fake-model", prompt="x")
    assert engine.aborted == []
