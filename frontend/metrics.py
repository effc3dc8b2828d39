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
from collections.abc import Iterator

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


# Our metrics that vLLM also has, and its names for them: exposed under both, from one measurement. They are
# recorded once, under our name, and copied under vLLM's (labelled model_name) when a scrape renders them: with
# several frontends every observation is a write to a shared memory-mapped file, and the inter-token latency
# alone, observed under three names, made metrics 14 % of a busy frontend's time (docs/benchmarks.md).
VLLM_ALIASES: dict[str, tuple[str, ...]] = {
    "clearserve_prompt_tokens": ("vllm:prompt_tokens",),
    "clearserve_generation_tokens": ("vllm:generation_tokens",),
    "clearserve_requests_finished": ("vllm:request_success",),
    "clearserve_time_to_first_token_seconds": ("vllm:time_to_first_token_seconds",),
    "clearserve_inter_token_latency_seconds": (
        "vllm:inter_token_latency_seconds",
        "vllm:time_per_output_token_seconds",
    ),
    "clearserve_e2e_request_latency_seconds": ("vllm:e2e_request_latency_seconds",),
    "clearserve_request_queue_time_seconds": ("vllm:request_queue_time_seconds",),
}
VLLM_LABEL_NAMES = {"finish_reason": "finished_reason"}  # vLLM's request_success label


class WithVllmNames(Collector):
    """Every metric of `source`, then a copy of each one vLLM also has (VLLM_ALIASES) under vLLM's name."""

    def __init__(self, source: Collector, model_name: str) -> None:
        self.source = source
        self.model_name = model_name

    def collect(self) -> Iterator[Metric]:
        for family in self.source.collect():
            yield family
            for alias in VLLM_ALIASES.get(family.name, ()):
                copy = Metric(alias, family.documentation, family.type, family.unit)
                for sample in family.samples:
                    labels = {VLLM_LABEL_NAMES.get(k, k): v for k, v in sample.labels.items()}
                    labels["model_name"] = self.model_name
                    copy.add_sample(alias + sample.name[len(family.name) :], labels, sample.value, sample.timestamp)
                yield copy


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

        def latency(name: str, doc: str) -> Histogram:
            return Histogram(name, doc, buckets=LATENCY_BUCKETS, registry=r)

        self.ttft = latency(
            "clearserve_time_to_first_token_seconds", "Arrival to the first output handed to the client"
        )
        self.inter_token = latency(
            "clearserve_inter_token_latency_seconds",
            "Gap between consecutive tokens as the frontend streams them "
            "(tokens that arrive together count a zero gap)",
        )
        self.e2e = latency("clearserve_e2e_request_latency_seconds", "Arrival to the last output")
        self.queue_time = latency("clearserve_request_queue_time_seconds", "Queued by the scheduler to first scheduled")
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
        self.tokenization_time.observe(max(0.0, times.tokenized - times.arrival))

    def rejected(self, status: int) -> None:
        self.requests_rejected.labels(status=str(status)).inc()

    def output(self, output: RequestOutput, times: StageTimes, previous_token_streamed: float | None) -> None:
        """One output of an accepted request; `previous_token_streamed` is when its previous token was
        streamed, None while it has none."""
        num_tokens = len(output.token_ids)
        self.generation_tokens.inc(num_tokens)
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

    def render(self, scheduler_stats: list[dict] | None) -> bytes:
        """`scheduler_stats`: every engine replica's scheduler's stats, summed into one set of metrics; None
        (or none at all) when a scheduler did not answer."""
        # Set and render with no await between: concurrent scrapes each see their own snapshot.
        payloads = scheduler_stats or []
        self.scheduler.snapshot = SchedulerStats.total([SchedulerStats.from_payload(p) for p in payloads]) or None
        rendered = CollectorRegistry()
        if self.multiprocess_dir is None:
            rendered.register(WithVllmNames(self.registry, self.model_name))
        else:
            every_frontend = multiprocess.MultiProcessCollector(None, self.multiprocess_dir)  # type: ignore[arg-type]
            rendered.register(WithVllmNames(every_frontend, self.model_name))
            rendered.register(self.scheduler)
        return generate_latest(rendered)
