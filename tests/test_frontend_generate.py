"""POST /generate: the native interface benchmarks use, with every token's times and the stage times."""

from __future__ import annotations

import json

import pytest
from fastapi.testclient import TestClient

from frontend.app import build_app
from tests import fake_engine
from tests.fake_engine import FakeEngineClient, Script


@pytest.fixture
def engine() -> FakeEngineClient:
    engine = FakeEngineClient()
    engine.script = Script(outputs=[("Hello", [11]), (", world", [12, 13])], finish_reason="length")
    return engine


@pytest.fixture
def http(engine) -> TestClient:
    return TestClient(build_app(engine))


def test_streaming_sends_one_line_per_output_with_its_times(http):
    response = http.post("/generate", json={"prompt": "Hi", "stream": True})
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("application/x-ndjson")
    *outputs, summary = [json.loads(line) for line in response.text.splitlines()]
    assert [o["token_ids"] for o in outputs] == [[11], [12, 13]]
    assert [o["text"] for o in outputs] == ["Hello", ", world"]
    assert [o["finish_reason"] for o in outputs] == [None, "length"]
    arrival = summary["times"]["arrival"]
    for i, o in enumerate(outputs):
        assert o["sampled_time"] == pytest.approx(arrival + fake_engine.OUTPUT_EVERY * (i + 1))
        assert o["streamed_time"] == pytest.approx(o["sampled_time"] + fake_engine.STREAMED_AFTER_SAMPLED)


def test_streaming_ends_with_the_stage_times_and_prompt_figures(http):
    lines = http.post("/generate", json={"prompt": "Hi", "stream": True}).text.splitlines()
    summary = json.loads(lines[-1])
    times = summary["times"]
    assert times["tokenized"] == pytest.approx(times["arrival"] + fake_engine.TOKENIZED_AFTER)
    assert times["queued"] == pytest.approx(times["arrival"] + fake_engine.QUEUED_AFTER)
    assert times["first_scheduled"] == pytest.approx(times["arrival"] + fake_engine.FIRST_SCHEDULED_AFTER)
    assert (summary["prompt_tokens"], summary["num_cached_tokens"], summary["completion_tokens"]) == (5, 2, 3)
    assert summary["finish_reason"] == "length"


def test_non_streaming_returns_all_tokens_with_per_token_times(http):
    body = http.post("/generate", json={"input_ids": [1, 2, 3], "sampling_params": {"max_tokens": 3}}).json()
    assert body["token_ids"] == [11, 12, 13]
    assert body["text"] == "Hello, world"
    arrival = body["times"]["arrival"]
    first, second = arrival + fake_engine.OUTPUT_EVERY, arrival + 2 * fake_engine.OUTPUT_EVERY
    assert body["sampled_times"] == pytest.approx([first, second, second])  # tokens of one output share its time
    assert len(body["streamed_times"]) == 3
    assert body["finish_reason"] == "length"


def test_prompt_ids_and_sampling_params_reach_the_engine(http, engine):
    http.post(
        "/generate",
        json={
            "input_ids": [1, 2, 3],
            "sampling_params": {
                "max_tokens": 4,
                "temperature": 0.0,
                "top_k": 5,
                "stop_token_ids": [7],
                "ignore_eos": True,
            },
        },
    )
    request = engine.submitted[0]
    assert request.prompt_token_ids == [1, 2, 3] and request.prompt is None
    s = request.sampling
    assert (s.max_tokens, s.temperature, s.top_k, s.stop_token_ids, s.ignore_eos) == (4, 0.0, 5, [7], True)
