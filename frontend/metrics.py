"""Prometheus metrics of one server, in a registry of the app's own (two apps in one process never mix).

With several frontend processes (the launcher sets PROMETHEUS_MULTIPROC_DIR for them), each one writes its
counters and histograms to its own files there, and whichever frontend a scrape reaches adds them all up
(prometheus_client's multiprocess mode): /metrics counts every request, whichever process served it.

Two sources:
- per-request latencies and token counts, measured here from the stage times the events carry
  (arrival, tokenized, queued, first scheduled, each output's streamed time), so a latency breakdown
  and /metrics agree;
- the scheduler's state and counters, asked for at scrape time (`control("stats")`) and exposed as the
  metrics `common/scheduler_stats.py` names. With several engine replicas, their schedulers' figures are
  summed (blocks, requests, tokens: the server's totals); /stats has each replica's own.

Every measure vLLM also has is exposed twice: as `clearserve_*`, and under vLLM's name (`vllm:*`, labelled
`model_name` as vLLM's are) so Grafana dashboards made for vLLM work unchanged. README.md lists the pairs.
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Sequence

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest, multiprocess
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from common.messages import RequestOutput, StageTimes
from common.scheduler_stats import SchedulerStats

LATENCY_BUCKETS = (
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.075,
    0.1,
    0.15,
    0.2,
    0.3,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    10.0,
    20.0,
    40.0,
    80.0,
)


VLLM_LABELS = ("model_name",)


class SchedulerStatsCollector(Collector):
    """Exposes the latest scheduler stats snapshot; nothing when the scheduler did not answer."""

    def __init__(self, model_name: str) -> None:
        self.model_name = model_name
        self.snapshot: SchedulerStats | None = None

    def collect(self) -> Iterator[Metric]:
        stats = self.snapshot
        if stats is None:
            return
        for key, kind, name, doc, vllm_name in SchedulerStats.metrics():
            family = GaugeMetricFamily if kind == "gauge" else CounterMetricFamily
            yield family(name, doc, value=getattr(stats, key))
            if vllm_name is not None:
                yield self._vllm(family, vllm_name, doc, getattr(stats, key))
        yield GaugeMetricFamily(
            "clearserve_prefix_cache_hit_rate",
            "Share of admitted prompt tokens served from the prefix cache",
            value=stats.cache_hit_rate,
        )
        usage_doc = "KV cache usage: share of the blocks held by requests (1 = full)"
        yield self._vllm(GaugeMetricFamily, "vllm:kv_cache_usage_perc", usage_doc, stats.kv_cache_usage)
        yield self._vllm(GaugeMetricFamily, "vllm:gpu_cache_usage_perc", usage_doc, stats.kv_cache_usage)

    def _vllm(self, family: type[GaugeMetricFamily | CounterMetricFamily], name: str, doc: str, value: float) -> Metric:
        metric = family(name, doc, labels=VLLM_LABELS)
        metric.add_metric([self.model_name], value)
        return metric


class TwinHistogram:
    """One latency under our name and vLLM's name(s), observed together."""

    def __init__(self, name: str, vllm_names: Sequence[str], doc: str, model_name: str, registry: CollectorRegistry):
        self.histograms = [Histogram(name, doc, buckets=LATENCY_BUCKETS, registry=registry)]
        for vllm_name in vllm_names:
            labelled = Histogram(vllm_name, doc, VLLM_LABELS, buckets=LATENCY_BUCKETS, registry=registry)
            self.histograms.append(labelled.labels(model_name=model_name))  # type: ignore[arg-type]

    def observe(self, seconds: float) -> None:
        for histogram in self.histograms:
            histogram.observe(seconds)


class FrontendMetrics:
    def __init__(self, model_name: str = "") -> None:
        """`model_name`: the served name, the `model_name` label of the `vllm:*` metrics."""
        self.registry = CollectorRegistry()
        r = self.registry
        self.prompt_tokens = Counter("clearserve_prompt_tokens", "Prompt tokens of accepted requests", registry=r)
        self.generation_tokens = Counter("clearserve_generation_tokens", "Tokens streamed to clients", registry=r)
        self.requests_finished = Counter(
            "clearserve_requests_finished", "Requests finished, by finish reason", ["finish_reason"], registry=r
        )
        self.requests_rejected = Counter(
            "clearserve_requests_rejected", "Requests the engine refused, by HTTP status", ["status"], registry=r
        )
        self.model_name = model_name
        self.vllm_prompt_tokens = Counter(
            "vllm:prompt_tokens", "Prompt tokens of accepted requests", VLLM_LABELS, registry=r
        ).labels(model_name=model_name)
        self.vllm_generation_tokens = Counter(
            "vllm:generation_tokens", "Tokens streamed to clients", VLLM_LABELS, registry=r
        ).labels(model_name=model_name)
        self.vllm_request_success = Counter(
            "vllm:request_success", "Requests finished, by finish reason", [*VLLM_LABELS, "finished_reason"], registry=r
        )
        self.ttft = TwinHistogram(
            "clearserve_time_to_first_token_seconds",
            ["vllm:time_to_first_token_seconds"],
            "Arrival to the first output handed to the client",
            model_name,
            r,
        )
        self.inter_token = TwinHistogram(
            "clearserve_inter_token_latency_seconds",
            ["vllm:inter_token_latency_seconds", "vllm:time_per_output_token_seconds"],
            "Gap between consecutive tokens as the frontend streams them "
            "(tokens that arrive together count a zero gap)",
            model_name,
            r,
        )
        self.e2e = TwinHistogram(
            "clearserve_e2e_request_latency_seconds",
            ["vllm:e2e_request_latency_seconds"],
            "Arrival to the last output",
            model_name,
            r,
        )
        self.queue_time = TwinHistogram(
            "clearserve_request_queue_time_seconds",
            ["vllm:request_queue_time_seconds"],
            "Queued by the scheduler to first scheduled",
            model_name,
            r,
        )
        self.tokenization_time = Histogram(
            "clearserve_request_tokenization_time_seconds", "Arrival to tokenized", buckets=LATENCY_BUCKETS, registry=r
        )
        self.scheduler = SchedulerStatsCollector(model_name)
        # Set in every frontend's environment by the launcher; prometheus_client reads it at import.
        self.multiprocess_dir = os.environ.get("PROMETHEUS_MULTIPROC_DIR")
        if self.multiprocess_dir is None:
            r.register(self.scheduler)

    def accepted(self, prompt_tokens: int, times: StageTimes) -> None:
        self.prompt_tokens.inc(prompt_tokens)
        self.vllm_prompt_tokens.inc(prompt_tokens)
        self.tokenization_time.observe(max(0.0, times.tokenized - times.arrival))

    def rejected(self, status: int) -> None:
        self.requests_rejected.labels(status=str(status)).inc()

    def output(self, output: RequestOutput, times: StageTimes, previous_token_streamed: float | None) -> None:
        """One output of an accepted request; `previous_token_streamed` is when its previous token was
        streamed, None while it has none."""
        num_tokens = len(output.token_ids)
        self.generation_tokens.inc(num_tokens)
        self.vllm_generation_tokens.inc(num_tokens)
        if num_tokens and previous_token_streamed is None:
            self.ttft.observe(max(0.0, output.streamed_time - times.arrival))
            if output.first_scheduled:
                self.queue_time.observe(max(0.0, output.first_scheduled - times.queued))
        elif num_tokens:
            self.inter_token.observe(max(0.0, output.streamed_time - previous_token_streamed))
        for _ in range(num_tokens - 1):
            self.inter_token.observe(0.0)
        if output.finish_reason:
            self.finished(output.finish_reason)
            self.e2e.observe(max(0.0, output.streamed_time - times.arrival))

    def finished(self, finish_reason: str) -> None:
        self.requests_finished.labels(finish_reason=finish_reason).inc()
        self.vllm_request_success.labels(model_name=self.model_name, finished_reason=finish_reason).inc()

    def render(self, scheduler_stats: list[dict] | None) -> bytes:
        """`scheduler_stats`: every engine replica's scheduler's stats, summed into one set of metrics; None
        (or none at all) when a scheduler did not answer."""
        # Set and render with no await between: concurrent scrapes each see their own snapshot.
        payloads = scheduler_stats or []
        self.scheduler.snapshot = SchedulerStats.total([SchedulerStats.from_payload(p) for p in payloads]) or None
        if self.multiprocess_dir is None:
            return generate_latest(self.registry)
        every_frontend = CollectorRegistry()
        multiprocess.MultiProcessCollector(every_frontend, self.multiprocess_dir)
        every_frontend.register(self.scheduler)
        return generate_latest(every_frontend)
