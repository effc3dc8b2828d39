"""The frontend's hand-built JSON (per-output NDJSON lines, SSE chunks from templates) is byte for byte what
json.dumps writes, for any text."""

from __future__ import annotations

import json

from hypothesis import given
from hypothesis import strategies as st

from common.messages import Logprobs, RequestOutput
from frontend.native_api import output_line
from frontend.openai_format import LOGPROB_FLOOR, ChatFormat, CompletionFormat
from frontend.streaming import ndjson_line, sse_event

texts = st.text()
finish_reasons = st.sampled_from([None, "stop", "length", "abort"])
times = st.floats(min_value=0, max_value=2e9, allow_nan=False)


@given(texts, st.lists(st.integers(0, 2**31)), times, times, finish_reasons)
def test_an_output_line_is_the_json_of_its_fields(text, token_ids, sampled, streamed, finish_reason):
    output = RequestOutput(7, text, token_ids, sampled, sampled, finish_reason, 0.0, 0, streamed)
    fields = {
        "token_ids": token_ids,
        "text": text,
        "sampled_time": sampled,
        "detokenized_time": sampled,
        "streamed_time": streamed,
        "finish_reason": finish_reason,
    }
    assert output_line(output).encode() == ndjson_line(fields)
    assert json.loads(output_line(output)) == fields


@given(st.integers(0, 3), texts, finish_reasons, st.booleans())
def test_a_templated_sse_chunk_is_the_event_of_its_chunk(index, text, finish_reason, usage_null):
    for fmt in (CompletionFormat("cmpl-1", 1700000000, 'a "model"'), ChatFormat("chatcmpl-1", 1, "m")):
        chunk = {**fmt.chunk(index, text, finish_reason), **({"usage": None} if usage_null else {})}
        assert fmt.chunk_event(index, text, finish_reason, usage_null) == sse_event(chunk)


def _ruled_out_logprobs() -> Logprobs:
    """A prompt's first token (NaN: it has no logprob) and a sampled token whose alternatives a grammar ruled out."""
    nan, inf = float("nan"), float("inf")
    return Logprobs(
        start=0,
        token_ids=[1, 2],
        logprobs=[nan, -inf],
        top_ids=[[], [3, 4]],
        top_logprobs=[[], [-0.5, -inf]],
        token_texts=["a", "b"],
        top_texts=[[], ["c", "d"]],
    )


def test_a_ruled_out_token_logprob_is_vllms_floor_and_the_body_is_strict_json():
    completion = CompletionFormat.logprobs([_ruled_out_logprobs()], 0)
    json.dumps(completion, allow_nan=False)  # what starlette's JSONResponse demands
    assert completion["token_logprobs"] == [None, LOGPROB_FLOOR]
    assert completion["top_logprobs"] == [None, {"c": -0.5, "d": LOGPROB_FLOOR}]
    chat = ChatFormat.logprobs([_ruled_out_logprobs()])
    json.dumps(chat, allow_nan=False)
    assert [entry["top_logprobs"][1]["logprob"] for entry in chat["content"][1:]] == [LOGPROB_FLOOR]
