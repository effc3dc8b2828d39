"""The HTTP layer's contract with clients, driven in-process against a scripted engine client."""

from __future__ import annotations

import json
import time

import pytest
from fastapi.testclient import TestClient

from common.messages import ChatTemplateOptions, Logprobs, RequestOutput, RequestRejected
from frontend.app import build_app
from frontend.choices import SharedPromptLogprobs
from frontend.engine_client import EngineLimits
from frontend.limits import HttpLimits
from tests.fake_engine import FakeEngineClient, Script


@pytest.fixture
def engine() -> FakeEngineClient:
    return FakeEngineClient()


@pytest.fixture
def http(engine) -> TestClient:
    return TestClient(build_app(engine))


def sse_events(body: str) -> list:
    """The payloads of an SSE body: parsed JSON objects, and the literal "[DONE]"."""
    assert body.endswith("\n\n")
    events = []
    for block in body.split("\n\n")[:-1]:
        assert block.startswith("data: "), block
        data = block[len("data: ") :]
        events.append(data if data == "[DONE]" else json.loads(data))
    return events


def assert_error(response, status: int, param: str | None, type: str = "invalid_request_error") -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["type"] == type
    assert error["param"] == param
    assert error["message"]
    return error


# ---------------------------------------------------------------- /v1/completions


def test_completion_returns_the_generated_text_and_usage(http):
    response = http.post("/v1/completions", json={"model": "fake-model", "prompt": "Say hi", "max_tokens": 5})
    assert response.status_code == 200
    body = response.json()
    assert body["id"] == "cmpl-1"
    assert body["object"] == "text_completion"
    assert body["model"] == "fake-model"
    assert abs(body["created"] - time.time()) < 60
    assert body["choices"] == [
        {"index": 0, "text": "Hello, world", "logprobs": None, "finish_reason": "stop", "stop_reason": None}
    ]
    assert body["usage"]["prompt_tokens"] == 5
    assert body["usage"]["completion_tokens"] == 3
    assert body["usage"]["total_tokens"] == 8
    assert body["usage"]["prompt_tokens_details"] == {"cached_tokens": 2}


def test_completion_relays_length_finish_reason(http, engine):
    engine.script = Script(finish_reason="length")
    assert http.post("/v1/completions", json={"prompt": "x"}).json()["choices"][0]["finish_reason"] == "length"


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
@pytest.mark.parametrize("stop_reason", ["\n\n", 7])
def test_the_stop_string_or_token_that_ended_a_choice_is_its_stop_reason(http, engine, path, stop_reason):
    """vLLM's stop_reason, on the whole choice and on the streamed chunk that finishes it (null on the others)."""
    engine.script = Script(stop_reason=stop_reason)
    body = {"prompt": "x"} if path == "/v1/completions" else {"messages": [{"role": "user", "content": "x"}]}
    assert http.post(path, json=body).json()["choices"][0]["stop_reason"] == stop_reason
    chunks = sse_events(http.post(path, json={**body, "stream": True}).text)[:-1]
    assert [c["choices"][0]["stop_reason"] for c in chunks][-1] == stop_reason
    assert not any(c["choices"][0]["stop_reason"] for c in chunks[:-1])


def test_completion_stream_sends_text_chunks_then_done(http):
    response = http.post("/v1/completions", json={"prompt": "Say hi", "stream": True})
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/event-stream")
    events = sse_events(response.text)
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    assert all(c["id"] == "cmpl-1" and c["object"] == "text_completion" for c in chunks)
    assert all("usage" not in c for c in chunks)
    assert "".join(c["choices"][0]["text"] for c in chunks) == "Hello, world"
    # Outputs already waiting when a chunk is written share it, so only the last chunk says why it ended.
    finish_reasons = [c["choices"][0]["finish_reason"] for c in chunks]
    assert finish_reasons[-1] == "stop" and not any(finish_reasons[:-1])


def test_completion_stream_ends_with_a_usage_chunk_when_asked(http):
    response = http.post(
        "/v1/completions", json={"prompt": "Say hi", "stream": True, "stream_options": {"include_usage": True}}
    )
    *chunks, usage_chunk, done = sse_events(response.text)
    assert done == "[DONE]"
    assert all(c["usage"] is None for c in chunks)
    assert usage_chunk["choices"] == []
    assert usage_chunk["usage"]["prompt_tokens"] == 5
    assert usage_chunk["usage"]["completion_tokens"] == 3
    assert usage_chunk["usage"]["total_tokens"] == 8


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_continuous_usage_stats_put_the_usage_so_far_on_every_chunk(http, path):
    body = {"prompt": "Say hi"} if path == "/v1/completions" else {"messages": USER}
    options = {"include_usage": True, "continuous_usage_stats": True}
    response = http.post(path, json={**body, "stream": True, "stream_options": options})
    *chunks, usage_chunk, done = sse_events(response.text)
    assert done == "[DONE]" and usage_chunk["choices"] == []
    completion = [c["usage"]["completion_tokens"] for c in chunks]
    assert completion == sorted(completion) and completion[-1] == usage_chunk["usage"]["completion_tokens"] == 3
    assert all(c["usage"]["prompt_tokens"] == usage_chunk["usage"]["prompt_tokens"] for c in chunks)
    text = "".join(c["choices"][0].get("text", c["choices"][0].get("delta", {}).get("content", "")) for c in chunks)
    assert text == "Hello, world"


def test_completion_passes_prompt_and_sampling_parameters_to_the_engine(http, engine):
    before = time.time()
    http.post(
        "/v1/completions",
        json={
            "prompt": "Say hi",
            "max_tokens": 7,
            "temperature": 0.5,
            "top_p": 0.9,
            "top_k": 40,
            "seed": 3,
            "stop": "\n",
            "stop_token_ids": [2],
            "ignore_eos": True,
            "skip_special_tokens": False,
            "spaces_between_special_tokens": False,
            "priority": -2,
        },
    )
    request = engine.submitted[0]
    assert request.priority == -2
    assert request.prompt == "Say hi" and request.prompt_token_ids is None and request.chat_messages is None
    s = request.sampling
    assert (s.max_tokens, s.temperature, s.top_p, s.top_k, s.seed) == (7, 0.5, 0.9, 40, 3)
    assert (s.stop, s.stop_token_ids, s.ignore_eos) == (["\n"], [2], True)
    assert (s.skip_special_tokens, s.spaces_between_special_tokens) == (False, False)
    assert before <= request.arrival_time <= time.time()


def test_the_models_generation_defaults_fill_the_sampling_fields_a_request_leaves_out():
    model_defaults = {"temperature": 0.6, "top_p": 0.9, "top_k": 20, "min_p": 0.05, "repetition_penalty": 1.1}
    limits = EngineLimits("fake-model", 128, 64, 16, 32, sampling_defaults=model_defaults)
    engine = FakeEngineClient(limits)
    http = TestClient(build_app(engine))
    for path, body in [("/v1/completions", {"prompt": "x"}), ("/v1/chat/completions", {"messages": USER})]:
        http.post(path, json=body)
        http.post(path, json={**body, "temperature": 0, "top_p": 1.0, "top_k": 0, "min_p": 0, "repetition_penalty": 1})
    http.post("/generate", json={"prompt": "x"})
    fields = [
        (s.temperature, s.top_p, s.top_k, s.min_p, s.repetition_penalty) for s in (r.sampling for r in engine.submitted)
    ]
    assert fields == [(0.6, 0.9, 20, 0.05, 1.1), (0.0, 1.0, 0, 0.0, 1.0)] * 2 + [(0.6, 0.9, 20, 0.05, 1.1)]


def test_vllms_chat_template_options_reach_the_tokenizer_and_their_misuse_is_a_400(http, engine):
    http.post("/v1/chat/completions", json={"messages": USER})
    assert engine.submitted[-1].chat_options is None  # the defaults: nothing more on the wire
    continued = {"add_generation_prompt": False, "continue_final_message": True}
    http.post("/v1/chat/completions", json={"messages": USER, **continued, "chat_template_kwargs": {"think": 0}})
    assert engine.submitted[-1].chat_options == ChatTemplateOptions(False, True, {"think": 0})
    both = {"messages": USER, "continue_final_message": True}
    assert_error(http.post("/v1/chat/completions", json=both), 400, "continue_final_message")
    own_template = {"messages": USER, "chat_template_kwargs": {"chat_template": "{{ secrets }}"}}
    assert_error(http.post("/v1/chat/completions", json=own_template), 400, "chat_template_kwargs")
    assert len(engine.submitted) == 2


@pytest.mark.parametrize(
    "fields, kind, spec",
    [
        ({"structured_outputs": {"json": {"type": "object"}}}, "json", '{"type": "object"}'),
        ({"structured_outputs": {"regex": "[0-9]+"}}, "regex", "[0-9]+"),
        ({"structured_outputs": {"choice": ["a", "b"]}}, "choice", '["a", "b"]'),
        ({"structured_outputs": {"grammar": 'root ::= "x"'}}, "grammar", 'root ::= "x"'),
        ({"structured_outputs": {"json_object": True}}, "json_object", ""),
        ({"guided_grammar": 'root ::= "x"'}, "grammar", 'root ::= "x"'),
    ],
)
def test_vllms_structured_outputs_and_its_older_guided_fields_reach_the_engine(http, engine, fields, kind, spec):
    # structured_outputs is vLLM's field since it dropped guided_* (0.12): both are served.
    assert http.post("/v1/completions", json={"prompt": "x", **fields}).status_code == 200
    structured = engine.submitted[-1].sampling.structured
    assert (structured.kind, structured.spec, structured.field) == (kind, spec, next(iter(fields)))


def test_a_completion_prompt_may_ask_for_no_special_tokens(http, engine):
    http.post("/v1/completions", json={"prompt": "x"})
    http.post("/v1/completions", json={"prompt": "x", "add_special_tokens": False})
    assert [r.add_special_tokens for r in engine.submitted] == [True, False]


def test_truncate_prompt_tokens_reaches_the_tokenizer_and_minus_one_means_the_context(http, engine):
    for path, body in [("/v1/completions", {"prompt": "x"}), ("/v1/chat/completions", {"messages": USER})]:
        http.post(path, json=body)
        http.post(path, json={**body, "truncate_prompt_tokens": 5})
        http.post(path, json={**body, "truncate_prompt_tokens": -1})
        assert_error(http.post(path, json={**body, "truncate_prompt_tokens": 0}), 400, "truncate_prompt_tokens")
    context = engine.limits.max_model_len
    assert [r.truncate_prompt_tokens for r in engine.submitted] == [None, 5, context] * 2


def test_completion_max_tokens_defaults_to_16_like_openai(http, engine):
    http.post("/v1/completions", json={"prompt": "x"})
    assert engine.submitted[0].sampling.max_tokens == 16


def test_completion_accepts_token_ids_and_batches_of_one(http, engine):
    for prompt in ([5, 6, 7], [[5, 6, 7]]):
        assert http.post("/v1/completions", json={"prompt": prompt}).status_code == 200
    assert http.post("/v1/completions", json={"prompt": ["Hi"]}).status_code == 200
    assert [r.prompt_token_ids for r in engine.submitted] == [[5, 6, 7], [5, 6, 7], None]
    assert engine.submitted[2].prompt == "Hi"


def test_known_no_op_fields_are_accepted_and_model_may_be_omitted(http):
    response = http.post(
        "/v1/completions",
        json={"prompt": "x", "user": "me", "frequency_penalty": 0, "logit_bias": {}, "best_of": 1, "suffix": None},
    )
    assert response.status_code == 200


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_unknown_fields_are_refused_naming_them(http, engine, path):
    body = {"prompt": "x"} if path == "/v1/completions" else {"messages": USER}
    error = assert_error(http.post(path, json={**body, "max_token": 5}), 400, "max_token")
    assert "max_token" in error["message"]
    assert engine.submitted == []


# ---------------------------------------------------------------- /v1/chat/completions


def test_chat_returns_the_assistant_message_and_usage(http, engine):
    response = http.post(
        "/v1/chat/completions",
        json={
            "model": "fake-model",
            "messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}],
        },
    )
    assert response.status_code == 200
    body = response.json()
    assert body["id"] == "chatcmpl-1"
    assert body["object"] == "chat.completion"
    assert body["model"] == "fake-model"
    assert body["choices"][0]["message"] == {"role": "assistant", "content": "Hello, world"}
    assert body["choices"][0]["finish_reason"] == "stop"
    assert body["usage"]["total_tokens"] == 8
    assert engine.submitted[0].chat_messages == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi"},
    ]


def test_chat_stream_sends_the_role_first_then_content_deltas(http):
    response = http.post(
        "/v1/chat/completions",
        json={
            "messages": [{"role": "user", "content": "Hi"}],
            "stream": True,
            "stream_options": {"include_usage": True},
        },
    )
    assert response.status_code == 200
    *chunks, usage_chunk, done = sse_events(response.text)
    assert done == "[DONE]"
    assert all(c["object"] == "chat.completion.chunk" and c["id"] == "chatcmpl-1" for c in chunks)
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    assert "".join(c["choices"][0]["delta"].get("content", "") for c in chunks) == "Hello, world"
    assert chunks[-1]["choices"][0]["finish_reason"] == "stop"
    assert usage_chunk["choices"] == [] and usage_chunk["usage"]["completion_tokens"] == 3


def test_chat_max_tokens_defaults_to_the_context_and_max_completion_tokens_wins(http, engine):
    messages = [{"role": "user", "content": "Hi"}]
    http.post("/v1/chat/completions", json={"messages": messages})
    http.post("/v1/chat/completions", json={"messages": messages, "max_tokens": 9})
    http.post("/v1/chat/completions", json={"messages": messages, "max_tokens": 9, "max_completion_tokens": 4})
    assert [r.sampling.max_tokens for r in engine.submitted] == [None, 9, 4]


def test_chat_joins_text_content_parts(http, engine):
    parts = [{"type": "text", "text": "Hello "}, {"type": "text", "text": "there"}]
    assert http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": parts}]}).status_code == 200
    assert engine.submitted[0].chat_messages == [{"role": "user", "content": "Hello there"}]


# ---------------------------------------------------------------- bad input: 400 naming the field

USER = [{"role": "user", "content": "Hi"}]

BAD_COMPLETIONS = [
    ({}, "prompt"),
    ({"prompt": 5}, "prompt"),
    ({"prompt": ""}, "prompt"),
    ({"prompt": []}, "prompt"),
    ({"prompt": ["a", ""]}, "prompt"),
    ({"prompt": [[1], []]}, "prompt"),
    ({"prompt": ["a"] * 65, "n": 2}, "prompt"),
    ({"prompt": [1, -2]}, "prompt"),
    ({"prompt": "x", "max_tokens": 0}, "max_tokens"),
    ({"prompt": "x", "max_tokens": -3}, "max_tokens"),
    ({"prompt": "x", "max_tokens": "ten"}, "max_tokens"),
    ({"prompt": "x", "max_tokens": 2.5}, "max_tokens"),
    ({"prompt": "x", "max_tokens": 129}, "max_tokens"),  # the fake's context is 128
    ({"prompt": "x", "temperature": -0.1}, "temperature"),
    ({"prompt": "x", "temperature": "hot"}, "temperature"),
    ({"prompt": "x", "top_p": 0}, "top_p"),
    ({"prompt": "x", "top_p": 1.5}, "top_p"),
    ({"prompt": "x", "top_k": -2}, "top_k"),
    ({"prompt": "x", "n": 0}, "n"),
    ({"prompt": "x", "n": 129}, "n"),
    ({"prompt": "x", "cache_salt": ""}, "cache_salt"),
    ({"prompt": "x", "cache_salt": "s" * 257}, "cache_salt"),
    ({"prompt": "x", "cache_salt": 7}, "cache_salt"),
    ({"prompt": "x", "stop": [""]}, "stop"),
    ({"prompt": "x", "stop": 3}, "stop"),
    ({"prompt": "x", "stop_token_ids": ["a"]}, "stop_token_ids"),
    ({"prompt": "x", "stream": "yes"}, "stream"),
    ({"prompt": "x", "seed": -1}, "seed"),
    ({"prompt": "x", "echo": "yes"}, "echo"),
    ({"prompt": "x", "logprobs": 21}, "logprobs"),
    ({"prompt": "x", "logprobs": -1}, "logprobs"),
    ({"prompt": "x", "best_of": 3}, "best_of"),
    ({"prompt": "x", "suffix": "end"}, "suffix"),
    ({"prompt": "x", "presence_penalty": 2.5}, "presence_penalty"),
    ({"prompt": "x", "frequency_penalty": -3}, "frequency_penalty"),
    ({"prompt": "x", "repetition_penalty": 0}, "repetition_penalty"),
    ({"prompt": "x", "logit_bias": {"a": 1}}, "logit_bias"),
    ({"prompt": "x", "logit_bias": {"5": 101}}, "logit_bias"),
    ({"prompt": "x", "logit_bias": {"5": "up"}}, "logit_bias"),
    ({"prompt": "x", "min_p": 1.5}, "min_p"),
    ({"prompt": "x", "min_tokens": 20, "max_tokens": 10}, "min_tokens"),
    ({"prompt": "x", "min_tokens": -1}, "min_tokens"),
]

BAD_CHATS = [
    ({}, "messages"),
    ({"messages": []}, "messages"),
    ({"messages": "Hi"}, "messages"),
    ({"messages": [{"role": "wizard", "content": "Hi"}]}, "messages"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]}, "messages"),
    ({"messages": USER, "max_tokens": 0}, "max_tokens"),
    ({"messages": USER, "max_tokens": 1000}, "max_tokens"),
    ({"messages": USER, "max_completion_tokens": 0}, "max_completion_tokens"),
    ({"messages": USER, "temperature": -1}, "temperature"),
    ({"messages": USER, "top_p": 2}, "top_p"),
    ({"messages": USER, "top_k": -5}, "top_k"),
    ({"messages": USER, "n": -1}, "n"),
    ({"messages": USER, "cache_salt": ""}, "cache_salt"),
    ({"messages": USER, "cache_salt": 7}, "cache_salt"),
    ({"messages": USER, "top_logprobs": 3}, "top_logprobs"),
    ({"messages": USER, "logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    # "auto", the default with tools, needs a --tool-call-parser (tests/test_tool_calls.py has the rest)
    ({"messages": USER, "tools": [{"type": "function", "function": {"name": "f"}}]}, "tool_choice"),
    ({"messages": USER, "tool_choice": "auto"}, "tool_choice"),
    ({"messages": USER, "functions": [{"name": "f"}]}, "functions"),
    ({"messages": USER, "response_format": {"type": "yaml"}}, "response_format"),
    ({"messages": USER, "response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "response_format"),
    ({"messages": USER, "guided_regex": "a+", "guided_choice": ["a"]}, "guided_choice"),
    ({"messages": USER, "structured_outputs": {"regex": "a+", "grammar": "root ::= x"}}, "structured_outputs"),
    ({"messages": USER, "structured_outputs": {"yaml": "a: 1"}}, "structured_outputs"),
    ({"messages": USER, "structured_outputs": {"choice": [""]}}, "structured_outputs"),
    ({"messages": USER, "guided_choice": []}, "guided_choice"),
    ({"messages": USER, "modalities": ["audio"]}, "modalities"),
    ({"messages": USER, "store": True}, "store"),
    ({"messages": USER, "reasoning_effort": "high"}, "reasoning_effort"),
    ({"messages": USER, "service_tier": "flex"}, "service_tier"),
    ({"messages": USER, "prediction": {"type": "content", "content": "x"}}, "prediction"),
    ({"messages": USER, "audio": {"voice": "x"}}, "audio"),
    # content may be null only in an assistant message that called tools, as OpenAI takes it
    ({"messages": [{"role": "user", "content": None}]}, "messages"),
    ({"messages": [{"role": "user"}]}, "messages"),
    ({"messages": [*USER, {"role": "assistant", "content": None}]}, "messages"),
    ({"messages": [{"role": "system", "content": None}, *USER]}, "messages"),
]

BAD_GENERATES = [
    ({}, "prompt"),
    ({"prompt": "x", "input_ids": [1]}, "prompt"),
    ({"input_ids": []}, "input_ids"),
    ({"prompt": "x", "sampling_params": {"temperature": -1}}, "temperature"),
    ({"prompt": "x", "sampling_params": {"max_tokens": 500}}, "max_tokens"),
    ({"prompt": "x", "sampling_params": "greedy"}, "sampling_params"),
]


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [("/v1/completions", b, p) for b, p in BAD_COMPLETIONS]
    + [("/v1/chat/completions", b, p) for b, p in BAD_CHATS]
    + [("/generate", b, p) for b, p in BAD_GENERATES],
)
def test_bad_input_is_a_400_naming_the_field(http, engine, path, body, param):
    assert_error(http.post(path, json=body), 400, param)
    assert engine.submitted == []


@pytest.mark.parametrize(
    ("fields", "says", "param"),
    [
        ({"structured_outputs": {"choice": []}}, "structured_outputs.choice must be", "structured_outputs"),
        ({"guided_choice": [""]}, "guided_choice must be", "guided_choice"),
    ],
)
def test_an_empty_choice_is_named_where_it_was_sent(http, fields, says, param):
    response = http.post("/v1/completions", json={"prompt": "x", **fields})
    assert_error(response, 400, param)
    assert response.json()["error"]["message"].startswith(says)


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions", "/generate"])
@pytest.mark.parametrize("raw", [b"{not json", b"", b"[1, 2]", b'"prompt"'])
def test_a_body_that_is_not_a_json_object_is_a_400(http, path, raw):
    assert_error(http.post(path, content=raw, headers={"content-type": "application/json"}), 400, None)


def test_a_message_of_the_wrong_shape_is_named_in_the_clients_words_not_the_servers_classes(http):
    body = {"messages": [{"role": "user", "content": [5]}]}
    error = assert_error(http.post("/v1/chat/completions", json=body), 400, "messages")
    assert "JSON object" in error["message"] and "TextPart" not in error["message"]


def test_n_error_names_n(http):
    error = assert_error(http.post("/v1/completions", json={"prompt": "x", "n": 0}), 400, "n")
    assert "n" in error["message"]


def test_server_keeps_serving_after_bad_requests(http):
    http.post("/v1/completions", content=b"{oops")
    http.post("/v1/completions", json={"prompt": "x", "top_p": 7})
    assert http.post("/v1/completions", json={"prompt": "x"}).status_code == 200


def test_unknown_routes_answer_in_the_openai_error_shape(http):
    assert_error(http.get("/v1/nothing-here"), 404, None)


# ---------------------------------------------------------------- engine rejections are relayed


@pytest.mark.parametrize("stream", [False, True])
def test_engine_rejection_503_is_relayed_before_any_stream(http, engine, stream):
    engine.script = Script(reject=RequestRejected(0, 503, "waiting queue is full"))
    response = http.post("/v1/completions", json={"prompt": "x", "stream": stream})
    error = assert_error(response, 503, None, type="service_unavailable")
    assert error["message"] == "waiting queue is full"
    assert int(response.headers["retry-after"]) >= 1  # when to come back


def test_engine_rejection_400_keeps_its_param(http, engine):
    engine.script = Script(
        reject=RequestRejected(0, 400, "prompt (120 tokens) + max_tokens (16) exceeds 128", param="max_tokens")
    )
    assert_error(http.post("/v1/chat/completions", json={"messages": USER}), 400, "max_tokens")


# ---------------------------------------------------------------- API key


@pytest.fixture
def keyed_http(engine) -> TestClient:
    return TestClient(build_app(engine, api_key="sesame"))


@pytest.mark.parametrize("headers", [{}, {"Authorization": "Bearer wrong"}, {"Authorization": "sesame"}])
def test_a_missing_or_wrong_api_key_is_a_401(keyed_http, engine, headers):
    for path, body in [
        ("/v1/completions", {"prompt": "x"}),
        ("/v1/chat/completions", {"messages": USER}),
        ("/generate", {"prompt": "x"}),
    ]:
        assert_error(keyed_http.post(path, json=body, headers=headers), 401, None, type="authentication_error")
    assert_error(keyed_http.get("/v1/models", headers=headers), 401, None, type="authentication_error")
    assert engine.submitted == []


def test_the_right_api_key_is_served(keyed_http):
    response = keyed_http.post("/v1/completions", json={"prompt": "x"}, headers={"Authorization": "Bearer sesame"})
    assert response.status_code == 200


def test_health_and_metrics_need_no_api_key(keyed_http):
    assert keyed_http.get("/health").status_code == 200
    assert keyed_http.get("/metrics").status_code == 200


# ---------------------------------------------------------------- the generation endpoints' own path


GENERATION = [
    ("/v1/completions", {"prompt": "x"}),
    ("/v1/chat/completions", {"messages": USER}),
    ("/generate", {"prompt": "x"}),
]


def test_an_unexpected_error_in_a_generation_endpoint_is_the_openai_shaped_500(engine, monkeypatch):
    async def broken(request):
        raise RuntimeError("a bug")

    monkeypatch.setattr(engine, "submit", broken)
    http = TestClient(build_app(engine), raise_server_exceptions=False)
    for path, body in GENERATION:
        error = assert_error(http.post(path, json=body), 500, None, type="server_error")
        assert "RuntimeError" in error["message"]


def test_the_generation_paths_keep_the_apps_other_answers_and_their_schema(http):
    schema = http.get("/openapi.json").json()["paths"]
    for path, _ in GENERATION:
        assert "post" in schema[path]
        assert http.get(path).status_code == 405  # FastAPI's own answer to another method
    assert_error(http.post("/v1/completion", json={"prompt": "x"}), 404, None)


# ---------------------------------------------------------------- /v1/models, /health, control stubs


def test_models_lists_the_served_model_with_its_context(http):
    body = http.get("/v1/models").json()
    assert body["object"] == "list"
    assert [(m["id"], m["object"], m["max_model_len"]) for m in body["data"]] == [("fake-model", "model", 128)]
    assert http.get("/v1/models/fake-model").json()["id"] == "fake-model"


def test_a_model_card_names_its_local_folder_as_root_and_no_parent():
    limits = EngineLimits("fake-model", 128, 64, 16, 32, model_root="/models/fake")
    http = TestClient(build_app(FakeEngineClient(limits)))
    card = http.get("/v1/models").json()["data"][0]
    assert (card["root"], card["parent"]) == ("/models/fake", None)
    assert http.get("/v1/models/fake-model").json() == card


def test_health_is_200_when_every_role_answers_a_ping(http, engine):
    response = http.get("/health")
    assert response.status_code == 200
    kind, _, timeout = engine.control_calls[-1]
    assert kind == "ping" and timeout <= 2.0


def test_health_is_503_naming_a_silent_role():
    response = TestClient(build_app(FakeEngineClient(silent_roles=("gpu_worker",)))).get("/health")
    assert response.status_code == 503
    assert response.json()["silent"] == ["gpu_worker"]


def test_stats_endpoint_forwards_to_every_process(http, engine):
    response = http.get("/stats")
    assert response.status_code == 200
    assert engine.control_calls[-1][0] == "stats"
    replies = response.json()["replies"]
    assert set(replies) == {"tokenizer-0", "scheduler", "gpu_worker"}
    assert all(isinstance(r["pid"], int) for r in replies.values())


# ---------------------------------------------------------------- n, lists of prompts, new sampling fields


def test_n_and_a_list_of_prompts_give_one_choice_each_in_order(http, engine):
    body = http.post("/v1/completions", json={"prompt": ["a", "b"], "n": 2, "seed": 9}).json()
    assert [c["index"] for c in body["choices"]] == [0, 1, 2, 3]
    assert all(c["text"] == "Hello, world" for c in body["choices"])
    # Submitted each prompt's first sample first (their token counts are checked before any other sample goes).
    assert [r.prompt for r in engine.submitted] == ["a", "b", "a", "b"]
    assert [r.sampling.seed for r in engine.submitted] == [9, 9, 10, 10], "a prompt's samples differ by seed"
    # Each prompt counts once (the fake's prompts are 5 tokens), every sample's tokens count.
    assert body["usage"]["prompt_tokens"] == 10 and body["usage"]["completion_tokens"] == 12


def test_chat_n_streams_every_choice_with_its_index(http):
    events = sse_events(http.post("/v1/chat/completions", json={"messages": USER, "n": 3, "stream": True}).text)
    chunks = events[:-1]
    for index in range(3):
        mine = [c["choices"][0] for c in chunks if c["choices"][0]["index"] == index]
        assert mine[0]["delta"]["role"] == "assistant"
        assert "".join(c["delta"].get("content", "") for c in mine) == "Hello, world"
        assert mine[-1]["finish_reason"] == "stop"


def test_echo_with_logprobs_asks_each_prompts_first_sample_alone_for_the_prompt_logprobs(http, engine):
    body = {"prompt": ["a", "b"], "n": 3, "echo": True, "logprobs": 1, "seed": 1}
    assert http.post("/v1/completions", json=body).status_code == 200
    asked = {(r.prompt, r.sampling.seed): r.sampling.prompt_logprobs for r in engine.submitted}
    assert asked == {("a", 1): 1, ("b", 1): 1, ("a", 2): None, ("a", 3): None, ("b", 2): None, ("b", 3): None}


def test_a_later_samples_stream_waits_for_the_prompt_logprobs_of_the_first():
    shared = SharedPromptLogprobs(n=2)
    logprobs = Logprobs(0, [5], [float("nan")], [[]], [[]])
    early = [RequestOutput(1, "x", [7], 0.0, 0.0)]
    assert shared.release(1, early) == [], "held: the prompt logprobs are not known yet"
    first = [RequestOutput(0, "y", [8], 0.0, 0.0, prompt_logprobs=logprobs)]
    later = [RequestOutput(1, "z", [9], 0.0, 0.0)]
    assert shared.release(0, first) == [(0, first), (1, early)]
    assert early[0].prompt_logprobs is logprobs
    assert shared.release(1, later) == [(1, later)] and later[0].prompt_logprobs is None, "on the first batch only"


def ceiling_app(engine: FakeEngineClient, max_request_prompt_tokens: int) -> TestClient:
    return TestClient(build_app(engine, limits=HttpLimits(max_request_prompt_tokens=max_request_prompt_tokens)))


def test_prompt_tokens_times_n_past_the_ceiling_are_a_400_naming_n(engine):
    # The fake's prompts are 5 tokens: two prompts times n=2 are 20 prompt tokens.
    response = ceiling_app(engine, 12).post("/v1/completions", json={"prompt": ["a", "b"], "n": 2})
    error = assert_error(response, 400, "n")
    assert "--max-request-prompt-tokens" in error["message"]
    assert [r.prompt for r in engine.submitted] == ["a", "b"], "no other sample was submitted"
    assert engine.aborted == [r.rid for r in engine.submitted]


@pytest.mark.parametrize(
    "path, body, field",
    [("/v1/completions", {"prompt": "a"}, "prompt"), ("/v1/chat/completions", {"messages": USER}, "messages")],
)
def test_prompts_past_the_ceiling_even_once_are_a_400_naming_them(engine, path, body, field):
    assert_error(ceiling_app(engine, 4).post(path, json={**body, "n": 2}), 400, field)


def test_the_default_ceiling_is_a_running_batch_of_whole_contexts(http, engine):
    # The fake's context is 128 tokens and its engine runs 32 requests: 32 samples of a 128-token prompt fit.
    engine.script.prompt_tokens = 128
    assert http.post("/v1/completions", json={"prompt": "a", "n": 32}).status_code == 200
    assert_error(http.post("/v1/completions", json={"prompt": "a", "n": 33}), 400, "n")


def test_new_sampling_fields_reach_the_engine(http, engine):
    http.post(
        "/v1/completions",
        json={
            "prompt": "x",
            "presence_penalty": 0.5,
            "frequency_penalty": -0.5,
            "repetition_penalty": 1.2,
            "logit_bias": {"7": -100, "8": 5},
            "min_tokens": 3,
            "min_p": 0.1,
            "logprobs": 2,
            "echo": True,
        },
    )
    s = engine.submitted[0].sampling
    assert (s.presence_penalty, s.frequency_penalty, s.repetition_penalty) == (0.5, -0.5, 1.2)
    assert (s.logit_bias, s.min_tokens, s.min_p) == ({7: -100.0, 8: 5.0}, 3, 0.1)
    assert (s.logprobs, s.prompt_logprobs) == (2, 2), "echo with logprobs asks for the prompt's"


def test_chat_logprobs_ask_for_top_logprobs(http, engine):
    http.post("/v1/chat/completions", json={"messages": USER, "logprobs": True, "top_logprobs": 4})
    http.post("/v1/chat/completions", json={"messages": USER, "logprobs": True})
    assert [(r.sampling.logprobs, r.sampling.prompt_logprobs) for r in engine.submitted] == [(4, None), (0, None)]


def test_completion_echo_prepends_the_prompt(http):
    assert http.post("/v1/completions", json={"prompt": "Say: ", "echo": True}).json()["choices"][0]["text"] == (
        "Say: Hello, world"
    )
    # A token-id prompt is echoed as its text (the fake's token ids are code points).
    body = http.post("/v1/completions", json={"prompt": [72, 105], "echo": True}).json()
    assert body["choices"][0]["text"] == "HiHello, world"


# ---------------------------------------------------------------- /tokenize, /detokenize, /version


def test_tokenize_and_detokenize_go_through_a_tokenizer_worker(http):
    body = http.post("/tokenize", json={"prompt": "Hi"}).json()
    assert body == {"count": 2, "max_model_len": 128, "tokens": [72, 105], "token_strs": None}
    assert http.post("/tokenize", json={"messages": USER}).json()["tokens"] == [72, 105]
    assert http.post("/detokenize", json={"tokens": [72, 105]}).json() == {"prompt": "Hi"}


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        ("/tokenize", {}, "prompt"),
        ("/tokenize", {"prompt": "x", "messages": USER}, "prompt"),
        ("/tokenize", {"prompt": "x", "return_token_strs": True}, "return_token_strs"),
        ("/detokenize", {"tokens": [-1]}, "tokens"),
        ("/detokenize", {"tokens": "abc"}, "tokens"),
    ],
)
def test_tokenize_and_detokenize_refuse_bad_input(http, path, body, param):
    assert_error(http.post(path, json=body), 400, param)


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/v1/completions", {"prompt": "x", "model": "gpt-4"}),
        ("/v1/chat/completions", {"messages": USER, "model": "gpt-4"}),
        ("/tokenize", {"prompt": "x", "model": "gpt-4"}),
        ("/detokenize", {"tokens": [1], "model": "gpt-4"}),
    ],
)
def test_a_model_not_served_is_a_404_model_not_found_as_vllm_answers(http, engine, path, body):
    error = assert_error(http.post(path, json=body), 404, "model", type="NotFoundError")
    assert (error["message"], error["code"]) == ("The model `gpt-4` does not exist.", "model_not_found")
    assert engine.submitted == []


def test_a_model_card_not_served_is_the_same_404(http):
    error = assert_error(http.get("/v1/models/gpt-4"), 404, "model", type="NotFoundError")
    assert error["code"] == "model_not_found"


def test_version_answers(http):
    assert isinstance(http.get("/version").json()["version"], str)


def test_an_assistant_message_sent_back_as_the_client_returned_it_is_accepted(http, engine):
    returned = {"role": "assistant", "content": "Hi!", "refusal": None, "tool_calls": None, "annotations": None}
    body = {"messages": [*USER, returned, {"role": "user", "content": "More"}]}
    assert http.post("/v1/chat/completions", json=body).status_code == 200
    assert engine.submitted[0].chat_messages[1] == {"role": "assistant", "content": "Hi!"}
    with_calls = {**returned, "tool_calls": [{"id": "1", "type": "function"}]}
    assert_error(http.post("/v1/chat/completions", json={"messages": [*USER, with_calls]}), 400, "messages")
