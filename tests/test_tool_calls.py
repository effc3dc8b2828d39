"""Tool calling on chat completions: how each tool_choice is served, what the answer says, streamed or not, and
the conversation that carries calls and their results back to the model. The HTTP layer runs over a scripted
engine (tests/fake_engine.py); a forced call through the real engine is in tests/test_openai_server.py."""

from __future__ import annotations

import json

import pytest
from fastapi.testclient import TestClient
from hypothesis import given, settings
from hypothesis import strategies as st

from frontend.app import build_app
from frontend.chat_output import ChatOutputReader
from frontend.errors import ApiError
from frontend.tool_calls import ToolCallStream, ToolPlan, plan_tools
from tests.fake_engine import FakeEngineClient, Script

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}
TIME = {"type": "function", "function": {"name": "get_time"}}
USER = [{"role": "user", "content": "Weather in Paris?"}]
HERMES = ToolPlan("auto", parser="hermes")
LLAMA3 = ToolPlan("auto", parser="llama3_json")
CALL_TEXT = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'


def streamed(plan: ToolPlan, pieces: list[str]) -> tuple[str, list[dict]]:
    """Content and calls as a client assembles them from the deltas of `pieces` (the last one final)."""
    stream = ToolCallStream(plan)
    content, calls = "", []
    for i, piece in enumerate(pieces):
        for delta in stream.feed(piece, final=i == len(pieces) - 1):
            content += delta.get("content", "")
            for call in delta.get("tool_calls", []):
                if call["index"] == len(calls):
                    calls.append({"id": call["id"], "type": call["type"], "function": dict(call["function"])})
                else:
                    calls[call["index"]]["function"]["arguments"] += call["function"]["arguments"]
    return content, calls


def whole_message(stream: ToolCallStream, text: str) -> tuple[str | None, list[dict]]:
    """A whole choice's content and calls, as the chat endpoint reads them."""
    message = ChatOutputReader(None, stream).message(text)
    return message["content"], message.get("tool_calls", [])


def without_ids(calls: list[dict]) -> list[dict]:
    assert all(call["id"].startswith("chatcmpl-tool-") for call in calls)
    return [{**call, "id": None} for call in calls]


# ---------------------------------------------------------------- the plan


def test_a_named_choice_constrains_the_output_to_its_parameters_and_required_to_a_list_of_calls():
    named = plan_tools([WEATHER, TIME], {"type": "function", "function": {"name": "get_weather"}}, None, None)
    assert (named.mode, named.function) == ("named", "get_weather")
    assert json.loads(named.structured.spec) == WEATHER["function"]["parameters"]
    required = plan_tools([WEATHER, TIME], "required", False, None)
    schema = json.loads(required.structured.spec)
    assert (schema["type"], schema["minItems"], schema["maxItems"]) == ("array", 1, 1)
    names = [option["properties"]["name"]["const"] for option in schema["items"]["anyOf"]]
    assert names == ["get_weather", "get_time"]
    assert plan_tools([WEATHER], "none", None, None) is None
    assert plan_tools([WEATHER], None, None, "hermes").mode == "auto"


@pytest.mark.parametrize(
    "tools, choice, parser, field",
    [
        ([WEATHER], None, None, "tool_choice"),  # "auto" by default, and no parser on this server
        ([WEATHER], {"type": "function", "function": {"name": "nope"}}, None, "tool_choice"),
        (None, "required", None, "tool_choice"),
        ([WEATHER, WEATHER], "required", None, "tools"),
    ],
    ids=["auto-without-a-parser", "unknown-function", "no-tools-to-choose-from", "duplicate-names"],
)
def test_a_plan_that_cannot_be_served_is_a_400_naming_the_field(tools, choice, parser, field):
    with pytest.raises(ApiError) as refused:
        plan_tools(tools, choice, None, parser)
    assert (refused.value.status, refused.value.param) == (400, field)


# ---------------------------------------------------------------- reading the calls


def test_a_named_call_streams_its_arguments_as_they_come():
    plan = plan_tools([WEATHER], {"type": "function", "function": {"name": "get_weather"}}, None, None)
    stream = ToolCallStream(plan)
    first = stream.feed('{"city": ', final=False)
    assert first[0]["tool_calls"][0]["function"] == {"name": "get_weather", "arguments": '{"city": '}
    assert stream.feed('"Paris"}', final=True) == [
        {"tool_calls": [{"index": 0, "function": {"arguments": '"Paris"}'}}]}
    ]
    assert stream.calls[0]["function"]["arguments"] == '{"city": "Paris"}'
    assert stream.finish_reason("stop") == "stop"


def test_required_calls_are_read_from_the_list_and_a_list_cut_short_is_content():
    plan = plan_tools([WEATHER, TIME], "required", None, None)
    listed = '[{"name": "get_weather", "parameters": {"city": "Rome"}}, {"name": "get_time", "parameters": {}}]'
    content, calls = whole_message(ToolCallStream(plan), listed)
    assert content is None
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == [
        ("get_weather", {"city": "Rome"}),
        ("get_time", {}),
    ]
    cut = ToolCallStream(plan)
    assert whole_message(cut, '[{"name": "get_wea') == ('[{"name": "get_wea', [])
    assert cut.finish_reason("length") == "length"


def test_required_calls_stream_their_name_first_then_their_arguments_as_written():
    stream = ToolCallStream(plan_tools([WEATHER, TIME], "required", None, None))
    first = stream.feed('[{"name": "get_weather", "parameters": {"ci', final=False)
    call_id = stream.calls[0]["id"]
    assert first == [
        {
            "tool_calls": [
                {"index": 0, "id": call_id, "type": "function", "function": {"name": "get_weather", "arguments": ""}}
            ]
        },
        {"tool_calls": [{"index": 0, "function": {"arguments": '{"ci'}}]},
    ]
    assert stream.feed('ty": "Rome}"}}, {"name": "get_time", "param', final=False) == [
        {"tool_calls": [{"index": 0, "function": {"arguments": 'ty": "Rome}"}'}}]}
    ]
    deltas = stream.feed('eters": {}}]', final=True)
    assert [d["tool_calls"][0]["index"] for d in deltas] == [1, 1]
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in stream.calls] == [
        ("get_weather", {"city": "Rome}"}),
        ("get_time", {}),
    ]
    assert stream.finish_reason("stop") == "tool_calls"


@settings(max_examples=200, deadline=None)
@given(cuts=st.lists(st.integers(0, 120), max_size=12))
def test_required_streamed_in_any_pieces_says_what_the_whole_text_says(cuts):
    plan = plan_tools([WEATHER, TIME], "required", None, None)
    text = '[ {"name": "get_weather", "parameters": {"city": "a \\"{[" }} ,{"parameters": {}, "name": "get_time"}]'
    bounds = sorted({0, len(text), *[c % (len(text) + 1) for c in cuts]})
    pieces = [text[a:b] for a, b in zip(bounds, bounds[1:])] or [""]
    content, calls = streamed(plan, pieces)
    whole_content, whole_calls = whole_message(ToolCallStream(plan), text)
    assert content == "" and whole_content is None
    assert without_ids(calls) == without_ids(whole_calls)
    assert [json.loads(c["function"]["arguments"]) for c in calls] == [{"city": 'a "{['}, {}]


def test_hermes_calls_are_read_from_the_text_and_the_rest_is_content():
    stream = ToolCallStream(HERMES)
    content, calls = whole_message(stream, "Let me check." + CALL_TEXT + CALL_TEXT.replace("Paris", "Rome"))
    assert content == "Let me check."
    assert [json.loads(c["function"]["arguments"]) for c in calls] == [{"city": "Paris"}, {"city": "Rome"}]
    assert len({c["id"] for c in calls}) == 2
    assert stream.finish_reason("stop") == "tool_calls"
    assert whole_message(ToolCallStream(HERMES), "Just text <tool") == ("Just text <tool", [])
    broken = "<tool_call>{not json}</tool_call> after"
    assert whole_message(ToolCallStream(HERMES), broken) == (broken, [])
    # A model that stops (EOS) before closing its last call: the call stands if it is whole JSON.
    _, unclosed = whole_message(ToolCallStream(HERMES), CALL_TEXT.removesuffix("\n</tool_call>"))
    assert [c["function"]["name"] for c in unclosed] == ["get_weather"]


@settings(max_examples=200, deadline=None)
@given(cuts=st.lists(st.integers(0, 120), max_size=12), before=st.sampled_from(["", "Sure. ", "a <b> c "]))
def test_hermes_streamed_in_any_pieces_says_what_the_whole_text_says(cuts, before):
    text = before + CALL_TEXT + "\nDone?" + CALL_TEXT.replace("Paris", "Oslo")
    bounds = sorted({0, len(text), *[c % (len(text) + 1) for c in cuts]})
    pieces = [text[a:b] for a, b in zip(bounds, bounds[1:])] or [""]
    content, calls = streamed(HERMES, pieces)
    whole_content, whole_calls = whole_message(ToolCallStream(HERMES), text)
    assert content == whole_content == before + "Done?"
    assert without_ids(calls) == without_ids(whole_calls)


@pytest.mark.parametrize("tag", ["", "<|python_tag|>"])
def test_llama3_json_calls_are_the_whole_output_and_anything_else_is_content(tag):
    text = tag + '{"name": "get_weather", "parameters": {"city": "Paris"}}; {"name": "get_time", "parameters": {}}'
    content, calls = whole_message(ToolCallStream(LLAMA3), text)
    assert content is None
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == [
        ("get_weather", {"city": "Paris"}),
        ("get_time", {}),
    ]
    assert whole_message(ToolCallStream(LLAMA3), "It is sunny in {Paris}.") == ("It is sunny in {Paris}.", [])
    assert whole_message(ToolCallStream(LLAMA3), '{"name": "get_wea') == ('{"name": "get_wea', [])  # cut short


@settings(max_examples=100, deadline=None)
@given(
    cuts=st.lists(st.integers(0, 80), max_size=8),
    text=st.sampled_from(
        [' <|python_tag|>{"name": "get_time", "parameters": {}}', "Plain {text} answer.", "<|pyth not a tag", ""]
    ),
)
def test_llama3_json_streamed_in_any_pieces_says_what_the_whole_text_says(cuts, text):
    bounds = sorted({0, len(text), *[c % (len(text) + 1) for c in cuts]})
    pieces = [text[a:b] for a, b in zip(bounds, bounds[1:])] or [""]
    content, calls = streamed(LLAMA3, pieces)
    whole_content, whole_calls = whole_message(ToolCallStream(LLAMA3), text)
    assert (content or None, without_ids(calls)) == (whole_content or None, without_ids(whole_calls))


# ---------------------------------------------------------------- through the HTTP layer


def chat(http: TestClient, **body) -> dict:
    response = http.post("/v1/chat/completions", json={"messages": USER, **body})
    assert response.status_code == 200, response.text
    return response.json()


def chat_stream(http: TestClient, **body) -> tuple[str, list[dict], str]:
    """The streamed answer as a client assembles it: content, calls, the last finish_reason."""
    response = http.post("/v1/chat/completions", json={"messages": USER, "stream": True, **body})
    assert response.status_code == 200, response.text
    content, calls, finish = "", [], None
    for block in response.text.split("\n\n")[:-1]:
        data = block.removeprefix("data: ")
        if data == "[DONE]":
            continue
        choice = json.loads(data)["choices"][0]
        delta = choice["delta"]
        content += delta.get("content") or ""
        for call in delta.get("tool_calls", []):
            if call["index"] == len(calls):
                calls.append({"id": call["id"], "type": call["type"], "function": dict(call["function"])})
            else:
                calls[call["index"]]["function"]["arguments"] += call["function"]["arguments"]
        finish = choice["finish_reason"] or finish
    return content, calls, finish


def scripted(engine: FakeEngineClient, *pieces: str) -> None:
    engine.script = Script(outputs=[(piece, [10 + i]) for i, piece in enumerate(pieces)])


def test_a_named_tool_choice_answers_one_call_whose_arguments_the_grammar_wrote():
    engine = FakeEngineClient()
    http = TestClient(build_app(engine))
    scripted(engine, '{"city"', ': "Paris"}')
    named = {"type": "function", "function": {"name": "get_weather"}}
    body = chat(http, tools=[WEATHER], tool_choice=named)
    [choice] = body["choices"]
    assert choice["finish_reason"] == "stop"
    assert choice["message"]["content"] is None
    [call] = choice["message"]["tool_calls"]
    assert call["function"] == {"name": "get_weather", "arguments": '{"city": "Paris"}'}
    request = engine.submitted[0]
    assert request.sampling.structured.kind == "json" and request.sampling.structured.field == "tools"
    assert request.chat_options.tools == [WEATHER]  # the template is told of the tools
    content, calls, finish = chat_stream(http, tools=[WEATHER], tool_choice=named)
    assert (content, without_ids(calls), finish) == ("", without_ids([call]), "stop")


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_auto_tool_choice_reads_the_models_calls_with_the_servers_parser(stream):
    engine = FakeEngineClient()
    scripted(
        engine,
        "Let me check.<tool",
        '_call>\n{"name": "get_weather", ',
        '"arguments": {"city": "Paris"}}\n</tool_call>',
    )
    http = TestClient(build_app(engine, tool_call_parser="hermes"))
    if stream:
        content, calls, finish = chat_stream(http, tools=[WEATHER])
    else:
        [choice] = chat(http, tools=[WEATHER])["choices"]
        content, calls, finish = choice["message"]["content"], choice["message"]["tool_calls"], choice["finish_reason"]
    assert (content, finish) == ("Let me check.", "tool_calls")
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == [
        ("get_weather", {"city": "Paris"})
    ]
    sampling = engine.submitted[0].sampling
    assert sampling.structured is None  # the model writes freely
    assert not sampling.skip_special_tokens  # a model may mark its <tool_call> tags special: they stay in the text


def test_without_a_parser_auto_tool_choice_is_a_400_and_tool_choice_none_is_plain_text():
    engine = FakeEngineClient()
    http = TestClient(build_app(engine))
    response = http.post("/v1/chat/completions", json={"messages": USER, "tools": [WEATHER]})
    assert response.status_code == 400 and response.json()["error"]["param"] == "tool_choice"
    [choice] = chat(http, tools=[WEATHER], tool_choice="none")["choices"]
    assert choice["message"] == {"role": "assistant", "content": "Hello, world"}


@pytest.mark.parametrize(
    "body, param",
    [
        (
            {"tools": [WEATHER], "tool_choice": "required", "response_format": {"type": "json_object"}},
            "response_format",
        ),
        ({"tools": [{"type": "function", "function": {"name": "bad name!"}}], "tool_choice": "required"}, "tools"),
        ({"tools": [{"type": "retrieval"}], "tool_choice": "required"}, "tools"),
        ({"tool_choice": {"type": "function", "function": {"name": "get_weather"}}}, "tool_choice"),
    ],
    ids=["forced-call-and-structured-output", "bad-function-name", "not-a-function", "choice-without-tools"],
)
def test_bad_tool_requests_are_a_400_naming_the_field(body, param):
    http = TestClient(build_app(FakeEngineClient()))
    response = http.post("/v1/chat/completions", json={"messages": USER, **body})
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param


def test_calls_and_their_results_go_back_to_the_template_as_it_reads_them():
    engine = FakeEngineClient()
    http = TestClient(build_app(engine))
    call = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
    messages = [
        *USER,
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_1", "content": "18 C, sunny"},
    ]
    assert http.post("/v1/chat/completions", json={"messages": messages}).status_code == 200
    sent = engine.submitted[0].chat_messages
    assert sent[1] == {
        "role": "assistant",
        "content": "",
        "tool_calls": [{**call, "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}],
    }
    assert sent[2] == {"role": "tool", "content": "18 C, sunny", "tool_call_id": "call_1"}


def test_tokenize_renders_tools_and_calls_as_the_chat_request_sends_them():
    engine = FakeEngineClient()
    http = TestClient(build_app(engine))
    call = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Rome"}'}}
    messages = [*USER, {"role": "assistant", "content": None, "tool_calls": [call]}]
    body = {"messages": messages, "tools": [WEATHER]}
    assert http.post("/tokenize", json=body).status_code == 200
    assert http.post("/v1/chat/completions", json={**body, "tool_choice": "none"}).status_code == 200
    tokenized, chat = engine.submitted
    assert tokenized.chat_messages == chat.chat_messages and tokenized.chat_options == chat.chat_options
    assert chat.chat_options.tools == [WEATHER]
