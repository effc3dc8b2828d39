"""A reasoning model's thinking told apart from its answer (--reasoning-parser deepseek_r1): reasoning_content
beside content, streamed or whole, and the answer's tool calls read after it."""

from __future__ import annotations

import json

import pytest
from fastapi.testclient import TestClient
from hypothesis import given, settings
from hypothesis import strategies as st

from frontend.app import build_app
from frontend.chat_output import ChatOutputReader
from frontend.reasoning import ReasoningStream
from frontend.tool_calls import ToolCallStream, ToolPlan
from tests.fake_engine import FakeEngineClient, Script

USER = [{"role": "user", "content": "Is 17 prime?"}]


def message(text: str, tools: ToolPlan | None = None) -> dict:
    return ChatOutputReader(ReasoningStream(), None if tools is None else ToolCallStream(tools)).message(text)


def test_the_thinking_up_to_its_closing_tag_is_reasoning_and_the_rest_the_answer():
    # The chat template opened <think> in the prompt; a model may write it again: it is dropped.
    for text in ("It has no divisor.</think>\n\nYes.", "<think>It has no divisor.</think>\n\nYes."):
        assert message(text) == {"role": "assistant", "content": "\n\nYes.", "reasoning_content": "It has no divisor."}
    # Cut short while thinking (max_tokens): all of it is reasoning, as vLLM reads it.
    assert message("Let me try 2, 3") == {"role": "assistant", "content": "", "reasoning_content": "Let me try 2, 3"}


@settings(max_examples=200, deadline=None)
@given(
    cuts=st.lists(st.integers(0, 80), max_size=10),
    text=st.sampled_from(
        ["<think>Try 2, 3.</think>Yes, <b>prime</b>.", " Try </thi 2.</think>Yes.", "no tags at all", "<thin", ""]
    ),
)
def test_streamed_in_any_pieces_it_says_what_the_whole_text_says(cuts, text):
    bounds = sorted({0, len(text), *[c % (len(text) + 1) for c in cuts]})
    pieces = [text[a:b] for a, b in zip(bounds, bounds[1:])] or [""]
    reader = ChatOutputReader(ReasoningStream(), None)
    deltas = [d for i, piece in enumerate(pieces) for d in reader.feed(piece, final=i == len(pieces) - 1)]
    whole = message(text)
    assert "".join(d.get("reasoning_content", "") for d in deltas) == (whole["reasoning_content"] or "")
    assert "".join(d.get("content", "") for d in deltas) == whole["content"]


def test_tool_calls_are_read_from_the_answer_after_the_thinking():
    text = 'I need the weather.</think><tool_call>{"name": "get_weather", "arguments": {"city": "Oslo"}}</tool_call>'
    out = message(text, ToolPlan("auto", parser="hermes"))
    assert out["reasoning_content"] == "I need the weather." and out["content"] is None
    assert json.loads(out["tool_calls"][0]["function"]["arguments"]) == {"city": "Oslo"}


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_the_chat_endpoint_answers_reasoning_content_beside_content(stream):
    engine = FakeEngineClient()
    engine.script = Script(outputs=[("Divisors", [1]), (": none.</th", [2]), ("ink>Yes.", [3])])
    http = TestClient(build_app(engine, reasoning_parser="deepseek_r1"))
    response = http.post("/v1/chat/completions", json={"messages": USER, "stream": stream})
    assert response.status_code == 200, response.text
    if stream:
        reasoning = content = ""
        for block in response.text.split("\n\n")[:-1]:
            data = block.removeprefix("data: ")
            if data != "[DONE]":
                delta = json.loads(data)["choices"][0]["delta"]
                reasoning += delta.get("reasoning_content") or ""
                content += delta.get("content") or ""
    else:
        msg = response.json()["choices"][0]["message"]
        reasoning, content = msg["reasoning_content"], msg["content"]
    assert (reasoning, content) == ("Divisors: none.", "Yes.")
