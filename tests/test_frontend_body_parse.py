"""Request bodies read at a bounded cost (frontend/body_parse.py): the count of JSON values that bounds it, the
400 naming the field where a body holds more, and validation that hands the GIL over between models;
in-process, on a scripted engine."""

from __future__ import annotations

import json
import random
import sys
import threading

import pytest
from fastapi.testclient import TestClient
from pydantic import ValidationError

from frontend.app import build_app
from frontend.body_parse import INLINE_PARSE_BYTES
from frontend.json_values import _ValueCount, field_past_value_limit
from frontend.limits import HttpLimits
from frontend.protocol import MAX_TOOLS, ChatCompletionRequest, ChatMessage, CompletionRequest
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


@pytest.fixture
def small_windows(monkeypatch):
    """Windows of a few bytes, and two passes of pairing at most: the count's skimmed and walked windows, and its
    fall back to walking what is nested deeper, meet everywhere in a small body."""
    monkeypatch.setattr("frontend.json_values.FIRST_WINDOW", 3)
    monkeypatch.setattr("frontend.json_values.SKIM_WINDOW", 24)
    monkeypatch.setattr("frontend.json_values.PAIR_PASSES", 2)


@pytest.mark.parametrize("seed", range(200))
def test_the_count_is_the_same_whichever_windows_it_skims_or_walks(small_windows, seed):
    rng = random.Random(seed)
    document = {"field": [random_json(rng) for _ in range(3)], "other": random_json(rng), "last": [[1, [2]]] * 3}
    body = json.dumps(document, ensure_ascii=rng.random() < 0.5).encode()
    count = counted_values(document)
    assert field_past_value_limit(body, count) is None
    assert field_past_value_limit(body, count - 1) == "last"
    past_field = counted_values({"field": document["field"]})
    assert field_past_value_limit(body, past_field - 1) == "field"


def test_a_body_past_the_limit_deep_in_one_field_is_counted_without_reading_its_strings_one_by_one(monkeypatch):
    """Where a window of the body stays two levels deep or more, no top-level key can be in it: its values are
    counted in a few C calls, not string by string (16 MiB of chat messages took the parsing thread ~0.1 s
    string by string, and the event loop waited on it)."""
    walked = []
    walk = _ValueCount.walk
    monkeypatch.setattr(_ValueCount, "walk", lambda self, pos, end: walked.append(end - pos) or walk(self, pos, end))
    body = json.dumps({"model": "m", "messages": [{"role": "user", "content": "a"}] * 100_000, "n": 1}).encode()
    assert field_past_value_limit(body, 32_768) == "messages"
    assert sum(walked) < 1024  # bytes read string by string: the top level before `messages` only


def test_the_scan_names_the_top_level_field_the_limit_is_passed_in():
    body = json.dumps({"model": "m", "tools": [{"a": {"b": 1}}], "messages": [{"x": [1, 2]}] * 50, "n": 1}).encode()
    assert field_past_value_limit(body, 20) == "messages"
    assert field_past_value_limit(json.dumps([1] * 50).encode(), 20) == ""  # no field: a top-level array


def test_escaped_quotes_and_backslashes_across_a_scan_window_are_read_as_the_parser_reads_them(monkeypatch):
    monkeypatch.setattr("frontend.json_values.SCAN_WINDOW", 7)
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


# ---------------------------------------------------------------- how long one validation holds the GIL


def test_one_validation_of_a_body_of_many_models_lets_a_waiting_thread_run_between_them():
    """pydantic holds the GIL for its whole call except where it calls back into Python: after each model it builds
    (RequestBody._checked), where the interpreter hands the GIL to a thread that asked for it. So the
    event loop waits for one model at most, not for the body, while the parsing thread validates."""
    body = json.dumps({"messages": [{"role": "user", "content": "a"}] * 2000}).encode()
    progress = 0
    seen_inside_the_call: list[int] = []
    running, done = threading.Event(), threading.Event()

    def waiting_thread() -> None:
        nonlocal progress
        running.set()
        while not done.is_set():
            progress += 1

    def profile(frame, event, arg) -> None:  # each Python function that validation calls
        if event == "call":
            seen_inside_the_call.append(progress)

    interval = sys.getswitchinterval()
    thread = threading.Thread(target=waiting_thread)
    sys.setswitchinterval(1e-6)  # a waiting thread asks for the GIL at once: any switch point hands it over
    try:
        thread.start()
        running.wait()
        sys.setprofile(profile)
        ChatCompletionRequest.model_validate_json(body)
    finally:
        sys.setprofile(None)
        done.set()
        thread.join()
        sys.setswitchinterval(interval)
    assert len(seen_inside_the_call) >= 2000  # the interpreter was entered once per message at least
    assert len(set(seen_inside_the_call)) > 1  # and the other thread ran in between, within the one call


@pytest.mark.parametrize(
    "model, body",
    [
        (ChatCompletionRequest, {"messages": [5] * 3000}),
        (ChatCompletionRequest, {"messages": [{"role": "user", "content": 5}] * 3000}),
        (ChatCompletionRequest, {"messages": [{"role": "user", "content": [{"type": "text", "text": 5}] * 3000}]}),
        (CompletionRequest, {"prompt": [1, "a"] * 1500}),
        (CompletionRequest, {"prompt": ["a", 1] * 1500}),
        (CompletionRequest, {"prompt": "a", "stop": [1] * 3000}),
        (CompletionRequest, {"prompt": "a", "stop_token_ids": ["a"] * 3000}),
        (CompletionRequest, {"prompt": "a", "logit_bias": {str(token): "a" for token in range(3000)}}),
        (CompletionRequest, {"prompt": "a", **{f"unknown{i}": 1 for i in range(3000)}}),
        (ChatCompletionRequest, {"messages": [{"role": "user", "content": "a", **{f"x{i}": 1 for i in range(3000)}}]}),
    ],
)
def test_a_list_of_many_bad_elements_is_one_error_not_one_per_element(model, body):
    """Errors become Python for the 400 in one call that holds the GIL (~3 µs each): a list (or logit_bias) stops
    at its first bad element, a prompt is validated as the one shape its first element names, not tried as
    each, and a model's unknown fields are one refusal."""
    with pytest.raises(ValidationError) as caught:
        model.model_validate_json(json.dumps(body))
    assert caught.value.error_count() <= 2  # a content part's union: not a string, and the list's first bad part


@pytest.mark.parametrize(
    "prompt, where, says",
    [([1, "a"], "prompt.1", "valid integer"), (["a", 1], "prompt.1", "valid string"), ([[1], "a"], "prompt.1", "")],
)
def test_a_prompt_list_is_read_as_the_shape_its_first_element_names(http, prompt, where, says):
    error = assert_error(http.post("/v1/completions", json={"prompt": prompt}), 400, "prompt")
    assert f"(at {where})" in error["message"] and says in error["message"]


def test_a_large_chat_bodys_messages_are_read_for_the_template_on_the_parsing_thread(http, engine, monkeypatch):
    """Work proportional to the messages (their template form) is done with the validation, off the event loop."""
    threads = set()
    read = ChatMessage.engine_message

    def recorded(message: ChatMessage) -> dict:
        threads.add(threading.current_thread().name.split("_")[0])
        return read(message)

    monkeypatch.setattr(ChatMessage, "engine_message", recorded)
    messages = [{"role": "user", "content": "x"}] * 300  # within MAX_VALUES
    body = {"messages": messages, "user": "x" * INLINE_PARSE_BYTES}  # past INLINE_PARSE_BYTES
    response = http.post("/v1/chat/completions", json=body)
    assert response.status_code == 200, response.text
    assert threads == {"body-parse"}
    assert engine.submitted[0].chat_messages == messages


def test_a_refused_message_is_answered_after_the_checks_made_before_messages_are_read(http, engine):
    body = {"messages": [{"role": "user", "content": None}], "n": 0}
    assert_error(http.post("/v1/chat/completions", json=body), 400, "n")
    assert_error(http.post("/v1/chat/completions", json={**body, "n": 1}), 400, "messages")
