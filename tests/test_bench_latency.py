"""The serving benchmark's arithmetic, on synthetic timestamps: percentiles, the stage latencies, TTFT,
TPOT, pooled ITL, end-to-end latency and throughput."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from benchmarks.latency import (
    RequestTimings,
    inter_token_latencies,
    percentile,
    percentiles,
    request_latencies,
    summarize,
    tpot,
    ttft,
)


def timed_request(submit: float, token_times: list[float], *, prompt_tokens: int = 10) -> RequestTimings:
    """A request whose stages are 1, 2, 3 ms apart after submit and whose tokens sample 1 ms before
    they stream."""
    return RequestTimings(
        submit=submit,
        prompt_tokens=prompt_tokens,
        completion_tokens=len(token_times),
        finish_reason="length",
        arrival=submit + 0.001,
        tokenized=submit + 0.003,
        queued=submit + 0.004,
        first_scheduled=submit + 0.006,
        token_sampled=[t - 0.001 for t in token_times],
        token_streamed=list(token_times),
        finished=token_times[-1],
        done=token_times[-1] + 0.0005,
    )


def test_percentile_interpolates_between_closest_ranks():
    values = [float(v) for v in range(1, 101)]
    assert percentile(values, 50) == pytest.approx(50.5)
    assert percentile(values, 99) == pytest.approx(99.01)
    assert percentile(values, 0) == 1.0 and percentile(values, 100) == 100.0


def test_percentile_ignores_input_order():
    assert percentile([3.0, 1.0, 2.0], 50) == 2.0


def test_percentile_of_one_value_is_that_value():
    assert percentile([7.0], 99) == 7.0


def test_percentile_of_nothing_is_none():
    assert percentile([], 50) is None
    assert percentiles([]).count == 0 and percentiles([]).p99 is None


def test_percentile_outside_0_to_100_is_refused():
    with pytest.raises(ValueError):
        percentile([1.0], 101)


@given(
    st.lists(st.floats(min_value=0, max_value=1e4), min_size=1, max_size=200),
    st.sampled_from([0, 1, 50, 90, 95, 99, 100]),
)
def test_percentile_agrees_with_numpy(values, p):
    assert percentile(values, p) == pytest.approx(float(np.percentile(values, p)), rel=1e-9, abs=1e-9)


def test_stage_latencies_are_differences_of_consecutive_stamps():
    latencies = request_latencies(timed_request(100.0, [100.010, 100.030]))
    assert latencies["submit_latency"] == pytest.approx(0.001)
    assert latencies["tokenize"] == pytest.approx(0.002)
    assert latencies["queue_wait"] == pytest.approx(0.003)  # tokenized -> first scheduled
    assert latencies["prefill_to_first_token"] == pytest.approx(0.003)  # first scheduled -> first sampled


def test_ttft_is_first_token_streamed_minus_submit():
    assert ttft(timed_request(100.0, [100.25, 100.30])) == pytest.approx(0.25)


def test_tpot_is_the_mean_gap_after_the_first_token():
    # (last - first) / (n - 1): 0.3 s over 3 gaps
    assert tpot(timed_request(100.0, [101.0, 101.05, 101.25, 101.30])) == pytest.approx(0.1)


def test_a_one_token_request_has_no_tpot_and_no_inter_token_gap():
    request = timed_request(100.0, [100.5])
    assert tpot(request) is None
    assert inter_token_latencies(request) == []
    summary = summarize([request])
    assert summary.latencies_ms["tpot"].count == 0 and summary.latencies_ms["tpot"].p50 is None
    assert summary.latencies_ms["ttft"].count == 1


def test_tokens_streamed_together_count_a_zero_gap():
    assert inter_token_latencies(timed_request(100.0, [100.1, 100.1, 100.3])) == pytest.approx([0.0, 0.2])


def test_itl_pools_every_gap_of_every_request():
    a = timed_request(100.0, [100.1, 100.2, 100.4])  # gaps 100, 200 ms
    b = timed_request(100.0, [100.1, 100.9])  # gap 800 ms
    itl = summarize([a, b]).latencies_ms["itl"]
    assert itl.count == 3
    assert itl.p50 == pytest.approx(200.0)
    assert itl.mean == pytest.approx(1100.0 / 3)
    # Per-request TPOTs are 150 and 800 ms: ITL weighs each gap, TPOT each request.
    assert summarize([a, b]).latencies_ms["tpot"].mean == pytest.approx(475.0)


def test_itl_as_sampled_leaves_out_what_the_serving_path_held():
    request = timed_request(100.0, [100.1, 100.2, 100.3])
    request.token_streamed[2] = 100.5  # the third token waited 200 ms after it was sampled, on its way out
    summary = summarize([request]).latencies_ms
    assert summary["itl"].mean == pytest.approx(200.0)  # gaps of 100 and 300 ms as streamed
    assert summary["itl_sampled"].count == 2 and summary["itl_sampled"].mean == pytest.approx(100.0)


def test_end_to_end_runs_from_submit_to_the_finishing_output():
    request = timed_request(100.0, [100.1, 100.2])
    request.finished = 100.25  # the finish came in an output without tokens
    assert request_latencies(request)["e2e"] == pytest.approx(0.25)


def test_summary_reports_milliseconds():
    summary = summarize([timed_request(100.0, [100.25, 100.30])])
    assert summary.latencies_ms["ttft"].p50 == pytest.approx(250.0)
    assert summary.latencies_ms["e2e"].p99 == pytest.approx(300.0)


def test_failed_requests_are_counted_but_left_out_of_latencies():
    failed = RequestTimings(submit=99.0, error="HTTP 503: queue full", done=99.01)
    summary = summarize([timed_request(100.0, [100.5, 101.0]), failed])
    assert (summary.completed, summary.failed) == (1, 1)
    assert summary.latencies_ms["ttft"].count == 1
    assert summary.completion_tokens == 2


def test_throughput_divides_tokens_by_first_submit_to_last_response():
    a = timed_request(100.0, [100.5, 101.0], prompt_tokens=6)  # done at 101.0005
    b = timed_request(100.5, [101.5, 101.9995], prompt_tokens=4)  # done at 102.0
    summary = summarize([a, b])
    assert summary.duration_s == pytest.approx(2.0)
    assert summary.completion_throughput == pytest.approx(4 / 2.0)
    assert summary.total_throughput == pytest.approx((4 + 10) / 2.0)
    assert summary.request_throughput == pytest.approx(1.0)
