"""The wire codec: every message round-trips through msgpack; nothing else is accepted."""

from __future__ import annotations

import msgpack
import pytest

from common.messages import (
    AbortRequest,
    FirstTokens,
    GenerateRequest,
    NewRequestSpec,
    ScheduledChunk,
    StageTimes,
    StepPlan,
    StepResult,
    StepTimings,
    TokenBatch,
)
from common.sampling_params import SamplingParams
from common.wire import PROTOCOL_VERSION, WireError, decode, encode


@pytest.mark.parametrize(
    "message",
    [
        GenerateRequest(
            7, SamplingParams(max_tokens=3, stop=["\n"]), 1.5, chat_messages=[{"role": "user", "content": "hi"}]
        ),
        AbortRequest(7, "stop"),
        StepPlan.of(
            1,
            [NewRequestSpec(7, [1, 2], SamplingParams(seed=3), 0)],
            [ScheduledChunk(7, 0, 2, [4], True, b"\x01")],
            [5],
        ),
        StepResult(1, [7], [42], 2.0, StepTimings(0.1, 0.2, 0.3)),
        TokenBatch(2.0, [7, 8], [42, 43], {7: "length"}, [FirstTokens(8, 1.0, 16)]),
    ],
)
def test_messages_round_trip(message):
    assert decode(encode(message)) == message


def test_nested_types_are_rebuilt():
    plan = decode(encode(StepPlan.of(1, [NewRequestSpec(7, [1], SamplingParams(seed=3), 0)], [], [])))
    assert isinstance(plan.new_requests[0].sampling, SamplingParams)
    assert StageTimes() == StageTimes(0.0, 0.0, 0.0, 0.0)


def test_unknown_tag_and_other_version_are_refused():
    with pytest.raises(WireError, match="unknown message tag"):
        decode(msgpack.packb([999, PROTOCOL_VERSION]))
    with pytest.raises(WireError, match="protocol version"):
        decode(msgpack.packb([AbortRequest.TAG, PROTOCOL_VERSION + 1, 1, "x"]))
    with pytest.raises(WireError):
        decode(msgpack.packb({"not": "a list"}))


def test_wrong_field_count_is_refused():
    with pytest.raises(WireError, match="expects a list of 2 fields"):
        decode(msgpack.packb([AbortRequest.TAG, PROTOCOL_VERSION, 1, "x", "extra"]))


def test_a_list_item_of_the_wrong_shape_is_refused():
    item = [8, 1.0, 16, None]
    good = msgpack.packb([TokenBatch.TAG, PROTOCOL_VERSION, 2.0, [8], [42], {}, [item], []])
    assert decode(good).firsts == [FirstTokens(8, 1.0, 16)]
    for bad in ([*item, "extra"], item[:2], 7):
        data = msgpack.packb([TokenBatch.TAG, PROTOCOL_VERSION, 2.0, [8], [42], {}, [bad], []])
        with pytest.raises(WireError, match="FirstTokens"):
            decode(data)
