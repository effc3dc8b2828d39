"""Request bodies read at a bounded cost (frontend/body_parse.py): the count of JSON values that bounds it, and
the 400 naming the field where a body holds more; in-process, on a scripted engine."""

from __future__ import annotations

import json
import random

import pytest
from fastapi.testclient import TestClient

from frontend.app import build_app
from frontend.body_parse import INLINE_PARSE_BYTES, field_past_value_limit
from frontend.limits import HttpLimits
from frontend.protocol import MAX_TOOLS
from tests.fake_engine import FakeEngineClient
from tests.test_frontend_api import assert_error

MAX_VALUES = 1000


@pytest.fixture
def engine() -> FakeEngineClient:
    return FakeEngineClient()


@pytest.fixture
def http(engine) -> TestClient:
    return TestClient(build_app(engine, limits=HttpLimits(max_request_json_values=MAX_VALUES)))


def counted_values(value) -> int:
    """What the scan counts, from the parsed value: each container's members, an empty one counting one."""
    if isinstance(value, dict):
        return max(len(value), 1) + sum(counted_values(v) for v in value.values())
    if isinstance(value, list):
        return max(len(value), 1) + sum(counted_values(v) for v in value)
    return 0


def random_json(rng: random.Random, depth: int = 0):
    """Values whose strings hold what could confuse a scan: quotes, backslashes, brackets, commas, colons."""
    pieces = ['"', "\\", "\\\\", '\\"', "[", "]", "{", "}", ",", ":", "a", "é", "\n", " "]
    kind = rng.choice(["str", "int", "list", "dict"] if depth < 4 else ["str", "int"])
    if kind == "str":
        return "".join(rng.choices(pieces, k=rng.randint(0, 12)))
    if kind == "int":
        return rng.randint(-5, 5)
    if kind == "list":
        return [random_json(rng, depth + 1) for _ in range(rng.randint(0, 5))]
    return {random_json(rng, 4): random_json(rng, depth + 1) for _ in range(rng.randint(0, 5))}


@pytest.mark.parametrize("seed", range(200))
def test_the_scan_counts_exactly_the_values_of_any_json_whatever_its_strings_hold(seed):
    rng = random.Random(seed)
    document = {"field": random_json(rng), "other": random_json(rng)}
    body = json.dumps(document, ensure_ascii=rng.random() < 0.5).encode()
    count = counted_values(document)
    assert field_past_value_limit(body, count) is None
    assert field_past_value_limit(body, count - 1) is not None


def test_the_scan_names_the_top_level_field_the_limit_is_passed_in():
    body = json.dumps({"model": "m", "tools": [{"a": {"b": 1}}], "messages": [{"x": [1, 2]}] * 50, "n": 1}).encode()
    assert field_past_value_limit(body, 20) == "messages"
    assert field_past_value_limit(json.dumps([1] * 50).encode(), 20) == ""  # no field: a top-level array


def test_escaped_quotes_and_backslashes_across_a_scan_window_are_read_as_the_parser_reads_them(monkeypatch):
    monkeypatch.setattr("frontend.body_parse.SCAN_WINDOW", 7)
    text = 'x\\\\"y' + "\\" * 13 + '"z,[{' + '\\"' * 9
    body = json.dumps({"prompt": text, "n": [1, 2, 3]}).encode()
    assert field_past_value_limit(body, 5) is None
    assert field_past_value_limit(body, 4) == "n"


@pytest.mark.parametrize(
    "path, body, field",
    [
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}] * 400}, "messages"),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": [{"type": "text", "text": "a"}] * 400}]},
            "messages",
        ),
        ("/v1/completions", {"prompt": [1] * 1001}, "prompt"),
        ("/v1/completions", {"prompt": ["a"] * 1001}, "prompt"),
        ("/v1/completions", {"prompt": "a", "stop": ["s"] * 1001}, "stop"),
        (
            "/v1/completions",
            {"prompt": "a", "response_format": {"type": "json_object", "x": [{}] * 999}},
            "response_format",
        ),
        ("/generate", {"input_ids": [1] * 1001}, "input_ids"),
        ("/tokenize", {"prompt": "a", "messages": [{"role": "user", "content": "hi"}] * 400}, "messages"),
        ("/detokenize", {"tokens": [1] * 1001}, "tokens"),
    ],
)
def test_a_body_of_more_json_values_than_the_limit_is_400_naming_its_field(http, engine, path, body, field):
    error = assert_error(http.post(path, json=body), 400, field)
    assert "--max-request-json-values" in error["message"]
    assert engine.submitted == []


def test_a_body_within_the_limit_is_served(http, engine):
    response = http.post("/v1/completions", json={"prompt": [1] * (MAX_VALUES - 1)})
    assert response.status_code == 200, response.text


@pytest.mark.parametrize("values", [MAX_VALUES - 1, MAX_VALUES + 1])
def test_a_body_too_large_to_parse_on_the_event_loop_is_bounded_and_served_the_same(http, engine, values):
    """Over INLINE_PARSE_BYTES the body is parsed on the frontend's parsing thread, with the same answers."""
    text = "x" * INLINE_PARSE_BYTES  # a long string: many bytes, one value
    body = {"prompt": [1] * (values - 2), "user": text}
    response = http.post("/v1/completions", json=body)
    if values < MAX_VALUES:
        assert response.status_code == 200, response.text
    else:
        assert_error(response, 400, "prompt")


def test_a_malformed_large_body_is_400_not_valid_json(http):
    body = b'{"prompt": "' + b"x" * INLINE_PARSE_BYTES + b'", '
    response = http.post("/v1/completions", content=body, headers={"Content-Type": "application/json"})
    assert "not valid JSON" in assert_error(response, 400, None)["message"]


def test_more_tools_than_openai_takes_is_400_naming_tools(http, engine):
    tool = {"type": "function", "function": {"name": "f"}}
    body = {"messages": [{"role": "user", "content": "hi"}], "tools": [tool] * (MAX_TOOLS + 1), "tool_choice": "none"}
    assert_error(http.post("/v1/chat/completions", json=body), 400, "tools")
    assert engine.submitted == []


@pytest.mark.parametrize(
    "body, param, says",
    [([1, 2], None, "must be a JSON object"), ({"x": [1] * 1001}, "x", "--max-request-json-values")],
)
def test_the_profiling_endpoints_arguments_are_read_the_same_bounded_way(http, body, param, says):
    error = assert_error(http.post("/start_profile", json=body), 400, param)
    assert says in error["message"]
