"""The frontend's hand-built JSON (per-output NDJSON lines, SSE chunks from templates) is byte for byte what
json.dumps writes, for any text."""

from __future__ import annotations

import json

from hypothesis import given
from hypothesis import strategies as st

from common.messages import RequestOutput
from frontend.native_api import output_line
from frontend.openai_format import ChatFormat, CompletionFormat
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
