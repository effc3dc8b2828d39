"""benchmarks/arrivals.py's breakdown of a round (where the slowest first token waited, which stamp spread) and
its floor, the offline engine's ratio (benchmarks/engine_ttft.py)."""

from __future__ import annotations

import functools

import pytest

from benchmarks.arrivals import prompt, slowest_stages_ms, spreads_ms
from benchmarks.engine_ttft import measure_in_child
from benchmarks.latency import RequestTimings


def timed(submit: float, arrival: float, scheduled: float, sampled: float, streamed: float) -> RequestTimings:
    t = RequestTimings(submit=submit, arrival=arrival, tokenized=arrival + 0.001, queued=arrival + 0.002)
    t.first_scheduled, t.token_sampled, t.token_streamed = scheduled, [sampled], [streamed]
    return t


ROUND = [timed(0.000, 0.005, 0.008, 0.020, 0.022), timed(0.001, 0.040, 0.045, 0.060, 0.070)]


def test_the_slowest_requests_stages_add_up_to_its_ttft():
    stages = slowest_stages_ms(ROUND)
    assert stages["submit_to_arrival"] == 39.0, "the second request's first token came last"
    assert sum(stages.values()) == pytest.approx(69.0)


def test_a_stamps_spread_is_its_latest_less_its_earliest():
    spreads = spreads_ms(ROUND)
    assert spreads["submit"] == 1.0 and spreads["arrival"] == 35.0 and spreads["first_streamed"] == 48.0


def test_the_engine_floor_times_one_prompt_and_the_group_in_the_offline_engine(tiny_llama):
    floor = measure_in_child(
        f"--model {tiny_llama} --device cpu --num-kv-blocks 64", functools.partial(prompt, words=5), 4, 1, 2
    )
    assert len(floor["alone_ttft_ms"]) == 1 and len(floor["together_ttft_ms_max"]) == 1
    assert floor["ratio"] == floor["together_ttft_ms_max_median"] / floor["alone_ttft_ms_median"] > 0
