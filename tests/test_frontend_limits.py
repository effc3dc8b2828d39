"""The HTTP layer's bounds on what a client may send (issue 12's probes), in-process on a scripted engine:
each refusal is an OpenAI-style 4xx before the engine sees anything, and the app keeps serving."""

from __future__ import annotations

import asyncio
import json

import pytest
from fastapi.testclient import TestClient

from frontend.app import build_app
from frontend.limits import HttpLimits
from tests.fake_engine import FakeEngineClient, Script
from tests.test_frontend_api import assert_error, sse_events

LIMITS = HttpLimits(max_request_body_bytes=4096, max_prompt_chars=100, max_stop_strings=4, max_stop_string_chars=8)


@pytest.fixture
def engine() -> FakeEngineClient:
    return FakeEngineClient()


@pytest.fixture
def http(engine) -> TestClient:
    return TestClient(build_app(engine, limits=LIMITS))


def assert_still_serving(http: TestClient) -> None:
    response = http.post("/v1/completions", json={"prompt": "hi"})
    assert response.status_code == 200, response.text


def test_a_body_over_the_limit_is_413_before_the_engine_sees_it(http, engine):
    response = http.post("/v1/completions", json={"prompt": "x", "junk": "y" * 5000})
    error = assert_error(response, 413, None)
    assert error["code"] == "request_too_large"
    assert engine.submitted == []
    assert_still_serving(http)


def test_a_chunked_body_over_the_limit_is_413(http, engine):
    def chunks():
        yield b'{"prompt": "'
        for _ in range(10):
            yield b"y" * 1000
        yield b'"}'

    response = http.post("/v1/completions", content=chunks(), headers={"Content-Type": "application/json"})
    assert_error(response, 413, None)
    assert engine.submitted == []


def test_a_prompt_over_the_character_limit_is_400_before_tokenizing(http, engine):
    response = http.post("/v1/completions", json={"prompt": "x" * 101})
    error = assert_error(response, 400, "prompt")
    assert error["code"] == "prompt_too_long"
    chat = http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "x" * 101}]})
    assert_error(chat, 400, "messages")
    native = http.post("/generate", json={"prompt": "x" * 101})
    assert_error(native, 400, "prompt")
    tokenize = http.post("/tokenize", json={"prompt": "x" * 101})
    assert_error(tokenize, 400, "prompt")
    assert engine.submitted == []


def test_the_default_prompt_limit_follows_the_context():
    assert HttpLimits().prompt_chars(1024) == 32 * 1024
    assert HttpLimits(max_prompt_chars=5).prompt_chars(1024) == 5


@pytest.mark.parametrize(
    "stop", [["a", "b", "c", "d", "e"], "x" * 9], ids=["too many stop strings", "a stop string too long"]
)
def test_stop_strings_are_bounded_in_count_and_length(http, engine, stop):
    assert_error(http.post("/v1/completions", json={"prompt": "hi", "stop": stop}), 400, "stop")
    assert_error(http.post("/generate", json={"prompt": "hi", "sampling_params": {"stop": stop}}), 400, "stop")
    assert engine.submitted == []


@pytest.mark.parametrize(
    "field, value",
    [
        ("top_k", 2**64),
        ("seed", 2**64),
        ("stop_token_ids", [2**64]),
        ("prompt", [2**64]),
        ("max_tokens", 2**70),
        ("n", -(2**64)),
    ],
)
def test_integers_beyond_64_bits_are_400_and_leave_no_stream(http, engine, field, value):
    body = {"prompt": "hi", field: value}
    response = http.post("/v1/completions", content=json.dumps(body), headers={"Content-Type": "application/json"})
    assert_error(response, 400, field)
    assert engine.submitted == []
    assert_still_serving(http)


@pytest.mark.parametrize(
    "path, body, field",
    [
        ("/v1/completions", {"prompt": "hi", "logprobs": 3}, "logprobs"),
        ("/v1/completions", {"prompt": "hi", "logprobs": 3, "echo": True}, "logprobs"),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": "hi"}], "logprobs": True, "top_logprobs": 3},
            "top_logprobs",
        ),
    ],
)
def test_logprobs_past_max_logprobs_are_400_naming_the_field(engine, path, body, field):
    http = TestClient(build_app(engine, limits=HttpLimits(max_logprobs=2)))
    error = assert_error(http.post(path, json=body), 400, field)
    assert "--max-logprobs" in error["message"]
    assert engine.submitted == []


def test_max_logprobs_raised_lets_requests_ask_for_more_prompt_logprobs_included(engine):
    http = TestClient(build_app(engine, limits=HttpLimits(max_logprobs=50)))
    assert http.post("/v1/completions", json={"prompt": "hi", "logprobs": 30, "echo": True}).status_code == 200
    chat = {"messages": [{"role": "user", "content": "hi"}], "logprobs": True, "top_logprobs": 50}
    assert http.post("/v1/chat/completions", json=chat).status_code == 200
    completion, chat_request = engine.submitted
    assert (completion.sampling.logprobs, completion.sampling.prompt_logprobs) == (30, 30)
    assert chat_request.sampling.logprobs == 50


def test_max_logprobs_is_a_launch_flag_of_vllms_name_and_default(capsys):
    from launch import parse_args

    assert HttpLimits.from_args(parse_args([])).max_logprobs == 20
    assert HttpLimits.from_args(parse_args(["--max-logprobs", "5"])).max_logprobs == 5
    with pytest.raises(SystemExit):
        parse_args(["--max-logprobs", "-1"])
    assert "at least 0" in capsys.readouterr().err


def test_a_logit_bias_key_beyond_64_bits_is_400(http):
    response = http.post("/v1/completions", json={"prompt": "hi", "logit_bias": {str(2**64): 1}})
    assert_error(response, 400, "logit_bias")


@pytest.mark.parametrize("literal", ["NaN", "Infinity", "-Infinity"])
def test_temperature_nan_or_infinite_is_400(http, literal):
    body = '{"prompt": "hi", "temperature": ' + literal + "}"
    response = http.post("/v1/completions", content=body, headers={"Content-Type": "application/json"})
    assert_error(response, 400, "temperature")


def test_a_vanishing_temperature_is_greedy(http, engine):
    assert http.post("/v1/completions", json={"prompt": "hi", "temperature": 1e-40}).status_code == 200
    assert engine.submitted[-1].sampling.temperature == 0.0


@pytest.mark.parametrize("content_type", ["text/plain", "application/x-www-form-urlencoded", "multipart/form-data"])
def test_bodies_a_web_page_could_post_cross_origin_are_refused(http, engine, content_type):
    # A page may POST these types to localhost without a CORS preflight: refusing them stops CSRF.
    response = http.post("/v1/completions", content='{"prompt": "hi"}', headers={"Content-Type": content_type})
    assert_error(response, 415, None)
    assert engine.submitted == []


def test_the_schema_and_docs_pages_need_the_key_when_one_is_set(engine):
    http = TestClient(build_app(engine, api_key="sesame"))
    for path in ("/openapi.json", "/docs", "/redoc"):
        assert_error(http.get(path), 401, None, type="authentication_error")
        assert http.get(path, headers={"Authorization": "Bearer sesame"}).status_code == 200
    assert "/v1/completions" in http.get("/openapi.json", headers={"Authorization": "Bearer sesame"}).json()["paths"]


def test_without_a_key_the_schema_is_served(http):
    assert "/v1/chat/completions" in http.get("/openapi.json").json()["paths"]


# ---------------------------------------------------------------- streams that end in an error


async def _post_then_stop(engine: FakeEngineClient, path: str, body: dict) -> str:
    """POST `body`; once the engine has it (its scripted outputs queued, the request left open), the
    frontend stops: `fail_open_streams`, as the server's shutdown hook calls it."""
    import httpx

    transport = httpx.ASGITransport(app=build_app(engine))
    async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
        task = asyncio.ensure_future(client.post(path, json=body))
        while not engine.submitted:
            await asyncio.sleep(0.01)  # a poll, bounded by the caller's wait_for
        engine.fail_open_streams("the server is stopping")
        response = await task
        assert response.status_code == 200
        return response.text


def test_failing_open_streams_ends_each_sse_stream_with_an_error_event_and_done(engine):
    engine.script = Script(finish_reason=None)  # the request stays open after its outputs
    body = asyncio.run(
        asyncio.wait_for(_post_then_stop(engine, "/v1/completions", {"prompt": "hi", "stream": True}), 10)
    )
    events = sse_events(body)
    assert "".join(e["choices"][0]["text"] for e in events[:-2]) == "Hello, world"
    assert events[-1] == "[DONE]"
    error = events[-2]["error"]
    assert error["type"] == "service_unavailable"
    assert error["code"] == "server_stopping"
    assert "stopping" in error["message"]


def test_failing_open_streams_ends_a_native_stream_with_an_error_line(engine):
    engine.script = Script(finish_reason=None)
    body = asyncio.run(asyncio.wait_for(_post_then_stop(engine, "/generate", {"prompt": "hi", "stream": True}), 10))
    lines = [json.loads(line) for line in body.splitlines()]
    assert [line["text"] for line in lines[:-1]] == ["Hello", ",", " world"]
    assert lines[-1]["error"]["code"] == "server_stopping"


def test_a_request_past_its_timeout_ends_with_a_504_error_event_and_is_aborted(engine):
    engine.script = Script(finish_reason=None)
    http = TestClient(build_app(engine, limits=HttpLimits(request_timeout_s=0.2)))
    response = http.post("/v1/completions", json={"prompt": "hi", "stream": True})
    events = sse_events(response.text)
    assert events[-1] == "[DONE]"
    assert events[-2]["error"]["code"] == "request_timeout"
    assert engine.aborted == [engine.submitted[-1].rid]
    whole = http.post("/v1/completions", json={"prompt": "hi"})
    assert_error(whole, 504, None, type="server_error")


def test_a_request_past_its_timeout_before_its_verdict_is_a_504_request_timeout_and_is_aborted(engine):
    engine.script = Script(answer=False)  # stuck before the scheduler
    http = TestClient(build_app(engine, limits=HttpLimits(request_timeout_s=0.2)))
    error = assert_error(http.post("/v1/completions", json={"prompt": "hi"}), 504, None, type="server_error")
    assert error["code"] == "request_timeout"
    assert engine.aborted == [engine.submitted[-1].rid]
