"""Prometheus metrics of one server, rendered by whichever frontend a scrape reaches.

Each frontend counts its own requests in plain memory (`RequestCounts`: counters, and histograms as counts per
bucket): a streamed token costs a few additions. A scrape asks every process for its stats over the control
channel, as it does for the schedulers', and adds up the frontends' counts: /metrics counts every request,
whichever process served it. (prometheus_client's multiprocess mode, used before, wrote every observation to a
shared memory-mapped file under a lock: ~15 % of a busy frontend's time.)

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

import itertools
from bisect import bisect_left
from collections.abc import Iterator
from dataclasses import dataclass, field

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString

from common.messages import RequestOutput, StageTimes
from common.scheduler_stats import SchedulerStats
from frontend.replicas import EngineReplicas

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
# counted once, under our name, and copied under vLLM's (labelled model_name) when a scrape renders them, so a
# streamed token's inter-token latency is one observation, not three (docs/notes/benchmark-history.md).
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


REQUEST_METRICS = "request_metrics"  # the key of a frontend's counts in its stats

# (name, documentation) of the per-request latency histograms.
LATENCIES = {
    "ttft": ("clearserve_time_to_first_token_seconds", "Arrival to the first output handed to the client"),
    "inter_token": (
        "clearserve_inter_token_latency_seconds",
        "Gap between consecutive tokens as the frontend streams them (tokens that arrive together count a zero gap)",
    ),
    "e2e": ("clearserve_e2e_request_latency_seconds", "Arrival to the last output"),
    "queue_time": ("clearserve_request_queue_time_seconds", "Queued by the scheduler to first scheduled"),
    "tokenization_time": ("clearserve_request_tokenization_time_seconds", "Arrival to tokenized"),
}


class LatencyHistogram:
    """What a Prometheus histogram holds: observations per bucket of LATENCY_BUCKETS (the last: above them all),
    and their sum."""

    __slots__ = ("counts", "sum")

    def __init__(self) -> None:
        self.counts = [0] * (len(LATENCY_BUCKETS) + 1)
        self.sum = 0.0

    def observe(self, seconds: float) -> None:
        self.counts[bisect_left(LATENCY_BUCKETS, seconds)] += 1  # the first bucket whose bound is >= seconds
        self.sum += seconds


@dataclass(slots=True)
class RequestCounts:
    """One frontend's request metrics (or several frontends' added up), as plain numbers."""

    prompt_tokens: int = 0
    generation_tokens: int = 0
    finished: dict[str, int] = field(default_factory=dict)  # by finish reason
    rejected: dict[str, int] = field(default_factory=dict)  # by HTTP status
    latencies: dict[str, LatencyHistogram] = field(default_factory=lambda: {k: LatencyHistogram() for k in LATENCIES})

    def to_payload(self) -> dict:
        """For the control channel (msgpack): plain numbers only."""
        return {
            "prompt_tokens": self.prompt_tokens,
            "generation_tokens": self.generation_tokens,
            "finished": dict(self.finished),
            "rejected": dict(self.rejected),
            "latencies": {k: [*h.counts, h.sum] for k, h in self.latencies.items()},
        }

    def add(self, payload: dict) -> None:
        """Add another frontend's counts (its to_payload())."""
        self.prompt_tokens += payload["prompt_tokens"]
        self.generation_tokens += payload["generation_tokens"]
        for mine, theirs in ((self.finished, payload["finished"]), (self.rejected, payload["rejected"])):
            for key, count in theirs.items():
                mine[key] = mine.get(key, 0) + count
        for key, values in payload["latencies"].items():
            histogram = self.latencies[key]
            histogram.counts = [a + b for a, b in zip(histogram.counts, values[:-1])]
            histogram.sum += values[-1]

    def collect(self) -> Iterator[Metric]:
        yield CounterMetricFamily("clearserve_prompt_tokens", "Prompt tokens of accepted requests", self.prompt_tokens)
        yield CounterMetricFamily("clearserve_generation_tokens", "Tokens streamed to clients", self.generation_tokens)
        for name, doc, label, counts in (
            ("clearserve_requests_finished", "Requests finished, by finish reason", "finish_reason", self.finished),
            ("clearserve_requests_rejected", "Requests the engine refused, by HTTP status", "status", self.rejected),
        ):
            family = CounterMetricFamily(name, doc, labels=[label])
            for key, count in sorted(counts.items()):
                family.add_metric([key], count)
            yield family
        for key, (name, doc) in LATENCIES.items():
            histogram = self.latencies[key]
            cumulative = list(itertools.accumulate(histogram.counts))
            bounds = [floatToGoString(b) for b in LATENCY_BUCKETS] + ["+Inf"]
            yield HistogramMetricFamily(name, doc, buckets=list(zip(bounds, cumulative)), sum_value=histogram.sum)


class _Families(Collector):
    def __init__(self, families: Iterator[Metric] | list[Metric]) -> None:
        self.families = list(families)

    def collect(self) -> Iterator[Metric]:
        return iter(self.families)


class FrontendMetrics:
    def __init__(self, model_name: str = "") -> None:
        """`model_name`: the served name, the `model_name` label of the `vllm:*` metrics."""
        self.model_name = model_name
        self.counts = RequestCounts()
        self._latency = self.counts.latencies
        self._inter_token = self._latency["inter_token"]
        self.scheduler = SchedulerStatsCollector(model_name)

    def accepted(self, prompt_tokens: int, times: StageTimes) -> None:
        self.counts.prompt_tokens += prompt_tokens
        self._latency["tokenization_time"].observe(max(0.0, times.tokenized - times.arrival))

    def rejected(self, status: int) -> None:
        rejected = self.counts.rejected
        rejected[str(status)] = rejected.get(str(status), 0) + 1

    def output(self, output: RequestOutput, times: StageTimes, previous_token_streamed: float | None) -> None:
        """One output of an accepted request; `previous_token_streamed` is when its previous token was
        streamed, None while it has none."""
        num_tokens = len(output.token_ids)
        if num_tokens:
            self.counts.generation_tokens += num_tokens
            if previous_token_streamed is not None:  # every token but a request's first: tested first, kept cheap
                self._inter_token.observe(max(0.0, output.streamed_time - previous_token_streamed))
            else:
                latency = self._latency
                latency["ttft"].observe(max(0.0, output.streamed_time - times.arrival))
                if output.first_scheduled:
                    latency["queue_time"].observe(max(0.0, output.first_scheduled - times.queued))
            for _ in range(num_tokens - 1):
                self._inter_token.observe(0.0)
        if output.finish_reason:
            self.finished(output.finish_reason)
            self._latency["e2e"].observe(max(0.0, output.streamed_time - times.arrival))

    def finished(self, finish_reason: str) -> None:
        finished = self.counts.finished
        finished[finish_reason] = finished.get(finish_reason, 0) + 1

    def render(
        self,
        scheduler_stats: list[dict] | None,
        other_frontends: list[dict] | None = None,
        replicas: EngineReplicas | None = None,
    ) -> bytes:
        """`scheduler_stats`: every serving engine replica's scheduler's stats, summed into one set of metrics;
        None (or none at all) when a scheduler did not answer. `other_frontends`: the other frontends' counts
        (RequestCounts.to_payload), added to this one's. `replicas`: how many engine replicas serve, of how many."""
        # Set and render with no await between: concurrent scrapes each see their own snapshot.
        payloads = scheduler_stats or []
        self.scheduler.snapshot = SchedulerStats.total([SchedulerStats.from_payload(p) for p in payloads]) or None
        total = RequestCounts()
        for counts in [self.counts.to_payload(), *(other_frontends or [])]:
            total.add(counts)
        rendered = CollectorRegistry()
        rendered.register(WithVllmNames(_Families(total.collect()), self.model_name))
        rendered.register(self.scheduler)
        rendered.register(_Families(replica_gauges(replicas or EngineReplicas())))
        return generate_latest(rendered)


def replica_gauges(replicas: EngineReplicas) -> list[Metric]:
    return [
        GaugeMetricFamily("clearserve_engine_replicas", "Engine replicas the server started", value=replicas.total),
        GaugeMetricFamily(
            "clearserve_engine_replicas_alive",
            "Engine replicas serving (the others failed and were taken out)",
            value=replicas.alive,
        ),
    ]
