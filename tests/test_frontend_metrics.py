"""/metrics: Prometheus text with per-request latencies measured from the events' stage times, and the
scheduler's state read at scrape time."""

from __future__ import annotations

import pytest
from fastapi.testclient import TestClient
from prometheus_client.parser import text_string_to_metric_families

from common.messages import RequestRejected
from frontend.app import build_app
from tests import fake_engine
from tests.fake_engine import FakeEngineClient, Script


def scrape(http: TestClient) -> dict[tuple[str, tuple], float]:
    """Every sample of /metrics as {(name, sorted labels): value}."""
    response = http.get("/metrics")
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/plain")
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(response.text)
        for s in family.samples
    }


@pytest.fixture
def engine() -> FakeEngineClient:
    return FakeEngineClient()


@pytest.fixture
def http(engine) -> TestClient:
    return TestClient(build_app(engine))


def test_scheduler_state_is_exposed_as_gauges(http):
    m = scrape(http)
    assert m[("clearserve_num_requests_running", ())] == 3
    assert m[("clearserve_num_requests_waiting", ())] == 2
    assert m[("clearserve_kv_blocks_total", ())] == 64
    assert m[("clearserve_kv_blocks_free", ())] == 40
    assert m[("clearserve_kv_blocks_used", ())] == 19
    assert m[("clearserve_kv_blocks_cached", ())] == 5


def test_scheduler_counters_and_prefix_cache_hit_rate_are_exposed(http):
    m = scrape(http)
    assert m[("clearserve_prefix_cache_hit_tokens_total", ())] == 100
    assert m[("clearserve_prefix_cache_hit_rate", ())] == pytest.approx(100 / 400)
    assert m[("clearserve_scheduler_steps_total", ())] == 100
    assert m[("clearserve_preemptions_total", ())] == 1
    assert m[("clearserve_prompt_tokens_computed_total", ())] == 300
    assert m[("clearserve_decode_tokens_computed_total", ())] == 200


def test_scheduler_state_is_read_at_every_scrape(http, engine):
    scrape(http)
    engine.scheduler_stats["num_running"] = 9
    assert scrape(http)[("clearserve_num_requests_running", ())] == 9


def test_a_silent_scheduler_leaves_its_metrics_out_but_still_answers():
    m = scrape(TestClient(build_app(FakeEngineClient(silent_roles=("scheduler",)))))
    assert ("clearserve_num_requests_running", ()) not in m
    assert ("clearserve_prompt_tokens_total", ()) in m


def test_token_and_finish_reason_counters_follow_requests(http, engine):
    http.post("/v1/completions", json={"prompt": "x"})
    engine.script = Script(finish_reason="length", outputs=[("a", [1]), ("bc", [2, 3]), ("d", [4])])
    http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "x"}], "stream": True})
    m = scrape(http)
    assert m[("clearserve_prompt_tokens_total", ())] == 10
    assert m[("clearserve_generation_tokens_total", ())] == 3 + 4
    assert m[("clearserve_requests_finished_total", (("finish_reason", "stop"),))] == 1
    assert m[("clearserve_requests_finished_total", (("finish_reason", "length"),))] == 1


def test_rejections_are_counted_by_status(http, engine):
    engine.script = Script(reject=RequestRejected(0, 503, "full"))
    http.post("/v1/completions", json={"prompt": "x"})
    assert scrape(http)[("clearserve_requests_rejected_total", (("status", "503"),))] == 1


def test_latency_histograms_come_from_the_stage_times(http):
    http.post("/v1/completions", json={"prompt": "x"})  # three one-token outputs, 0.1 s apart
    m = scrape(http)
    first_streamed = fake_engine.OUTPUT_EVERY + fake_engine.STREAMED_AFTER_SAMPLED
    assert m[("clearserve_time_to_first_token_seconds_count", ())] == 1
    assert m[("clearserve_time_to_first_token_seconds_sum", ())] == pytest.approx(first_streamed, abs=1e-6)
    assert m[("clearserve_inter_token_latency_seconds_count", ())] == 2
    assert m[("clearserve_inter_token_latency_seconds_sum", ())] == pytest.approx(
        2 * fake_engine.OUTPUT_EVERY, abs=1e-6
    )
    assert m[("clearserve_e2e_request_latency_seconds_sum", ())] == pytest.approx(
        3 * fake_engine.OUTPUT_EVERY + fake_engine.STREAMED_AFTER_SAMPLED, abs=1e-6
    )
    assert m[("clearserve_request_queue_time_seconds_sum", ())] == pytest.approx(
        fake_engine.FIRST_SCHEDULED_AFTER - fake_engine.QUEUED_AFTER, abs=1e-6
    )
    assert m[("clearserve_request_tokenization_time_seconds_sum", ())] == pytest.approx(
        fake_engine.TOKENIZED_AFTER, abs=1e-6
    )


def test_tokens_that_arrive_together_count_zero_gaps(http, engine):
    engine.script = Script(outputs=[("ab", [1, 2]), ("c", [3])])
    http.post("/v1/completions", json={"prompt": "x"})
    m = scrape(http)
    assert m[("clearserve_inter_token_latency_seconds_count", ())] == 2
    assert m[("clearserve_inter_token_latency_seconds_sum", ())] == pytest.approx(fake_engine.OUTPUT_EVERY, abs=1e-6)


def test_each_app_has_its_own_registry(engine):
    first, second = TestClient(build_app(engine)), TestClient(build_app(FakeEngineClient()))
    first.post("/v1/completions", json={"prompt": "x"})
    assert scrape(first)[("clearserve_prompt_tokens_total", ())] == 5
    assert scrape(second)[("clearserve_prompt_tokens_total", ())] == 0


def test_vllm_metric_names_carry_the_same_values_labelled_by_model_name(http, engine):
    engine.script = Script(finish_reason="length", outputs=[("a", [1]), ("bc", [2, 3])])
    http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "x"}], "stream": True})
    m = scrape(http)
    model = (("model_name", engine.limits.served_model_name),)
    assert m[("vllm:num_requests_running", model)] == m[("clearserve_num_requests_running", ())] == 3
    assert m[("vllm:num_requests_waiting", model)] == 2
    assert m[("vllm:kv_cache_usage_perc", model)] == pytest.approx(19 / 64)
    assert m[("vllm:gpu_cache_usage_perc", model)] == pytest.approx(19 / 64)
    assert m[("vllm:prefix_cache_hits_total", model)] == 100
    assert m[("vllm:prefix_cache_queries_total", model)] == 400
    assert m[("vllm:num_preemptions_total", model)] == 1
    assert m[("vllm:prompt_tokens_total", model)] == m[("clearserve_prompt_tokens_total", ())]
    assert m[("vllm:generation_tokens_total", model)] == 3
    assert m[("vllm:request_success_total", (("finished_reason", "length"), *model))] == 1
    for histogram in (
        "vllm:time_to_first_token_seconds",
        "vllm:inter_token_latency_seconds",
        "vllm:time_per_output_token_seconds",
        "vllm:e2e_request_latency_seconds",
        "vllm:request_queue_time_seconds",
    ):
        clearserve = histogram.replace("vllm:", "clearserve_").replace("time_per_output_token", "inter_token_latency")
        assert m[(f"{histogram}_count", model)] == m[(f"{clearserve}_count", ())] > 0, histogram


def test_an_observation_on_a_bucket_bound_counts_in_that_bucket_and_frontends_add_up():
    from frontend.metrics import LATENCY_BUCKETS, FrontendMetrics, RequestCounts

    one, other = FrontendMetrics(), RequestCounts()
    one.counts.latencies["e2e"].observe(LATENCY_BUCKETS[0])  # "le": less than or equal to the bound
    other.latencies["e2e"].observe(LATENCY_BUCKETS[-1] * 2)  # above every bound: only +Inf
    other.finished["stop"] = 2
    text = one.render(None, [other.to_payload()]).decode()
    m = {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }
    name = "clearserve_e2e_request_latency_seconds"
    assert m[(f"{name}_bucket", (("le", str(LATENCY_BUCKETS[0])),))] == 1
    assert m[(f"{name}_bucket", (("le", "+Inf"),))] == m[(f"{name}_count", ())] == 2
    assert m[(f"{name}_sum", ())] == LATENCY_BUCKETS[0] + LATENCY_BUCKETS[-1] * 2
    assert m[("clearserve_requests_finished_total", (("finish_reason", "stop"),))] == 2
