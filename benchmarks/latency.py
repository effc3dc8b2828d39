"""Latency arithmetic of the serving benchmark: per-request stage times in, percentiles out. Pure: no I/O.

One request's clock, every stamp from time.time() on the same machine:

    submit ─▶ arrival ─▶ tokenized ─▶ (queued) ─▶ first_scheduled ─▶ sampled[0] ─▶ streamed[0] ... streamed[n-1]
    client    frontend   tokenizer     scheduler   scheduler          GPU worker    frontend        frontend

    submit latency      arrival − submit               client → HTTP handler (connection, request body)
    tokenize            tokenized − arrival            frontend → tokenizer worker, tokenizing
    queue wait          first_scheduled − tokenized    hop to the scheduler, then waiting for a step that
                                                       admits it (the scheduler reads new requests only
                                                       between steps, so `queued` alone would hide part of it)
    prefill→first token sampled[0] − first_scheduled  the prefill step(s), including chunks and waits between
    TTFT                streamed[0] − submit
    TPOT                (streamed[n-1] − streamed[0]) / (n − 1)    none for a one-token request
    ITL                 streamed[i] − streamed[i-1], every gap of every request pooled
    ITL as sampled      sampled[i] − sampled[i-1], likewise: the engine's own gaps, before the tokens travel;
                        where ITL is longer, the serving path (tokenizer worker, frontend) held them
    end-to-end          finished − submit              finished: when the output carrying finish_reason streamed

Token times are `streamed`: where the frontend hands a token to the client's stream, not where this
client happens to read it. Tokens that arrive in one output share its times (a zero gap).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

# (key, label) of every per-request latency the benchmark reports, in the order it prints them.
LATENCY_METRICS: list[tuple[str, str]] = [
    ("submit_latency", "submit latency"),
    ("tokenize", "tokenize"),
    ("queue_wait", "queue wait (tokenized→scheduled)"),
    ("prefill_to_first_token", "prefill→first token"),
    ("ttft", "TTFT"),
    ("tpot", "TPOT"),
    ("itl", "ITL"),
    ("itl_sampled", "ITL as sampled (GPU worker)"),
    ("e2e", "end-to-end"),
]
PERCENTILES = (50, 95, 99)


@dataclass(slots=True)
class RequestTimings:
    """What one request saw; times in seconds since the epoch. `error` set: it failed, no metrics."""

    submit: float
    prompt_tokens: int = 0
    completion_tokens: int = 0
    num_cached_tokens: int = 0
    finish_reason: str | None = None
    arrival: float = 0.0
    tokenized: float = 0.0
    queued: float = 0.0
    first_scheduled: float = 0.0
    token_sampled: list[float] = field(default_factory=list)  # one per token
    token_streamed: list[float] = field(default_factory=list)  # one per token
    finished: float = 0.0  # streamed time of the output that carried finish_reason
    done: float = 0.0  # client clock: the response's last line read
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None and bool(self.token_streamed)


@dataclass(slots=True)
class Percentiles:
    count: int
    mean: float | None
    p50: float | None
    p95: float | None
    p99: float | None

    def get(self, stat: str) -> float | None:
        return getattr(self, stat)


def percentile(values: list[float], p: float) -> float | None:
    """The p-th percentile, interpolating linearly between the closest ranks (numpy's default); None if empty."""
    if not values:
        return None
    if not 0 <= p <= 100:
        raise ValueError(f"percentile {p} is outside 0..100")
    ordered = sorted(values)
    rank = (len(ordered) - 1) * p / 100
    low = math.floor(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def percentiles(values: list[float]) -> Percentiles:
    ordered = sorted(values)
    mean = sum(ordered) / len(ordered) if ordered else None
    p50, p95, p99 = (percentile(ordered, p) for p in PERCENTILES)
    return Percentiles(len(ordered), mean, p50, p95, p99)


def ttft(r: RequestTimings) -> float:
    return r.token_streamed[0] - r.submit


def tpot(r: RequestTimings) -> float | None:
    """Mean time per output token after the first; None for a one-token request (there is no gap)."""
    n = len(r.token_streamed)
    if n < 2:
        return None
    return (r.token_streamed[-1] - r.token_streamed[0]) / (n - 1)


def inter_token_latencies(r: RequestTimings) -> list[float]:
    times = r.token_streamed
    return [b - a for a, b in zip(times, times[1:])]


def sampled_gaps(r: RequestTimings) -> list[float]:
    times = r.token_sampled
    return [b - a for a, b in zip(times, times[1:])]


def request_latencies(r: RequestTimings) -> dict[str, float | None]:
    """Every single-valued latency of one successful request, in seconds (ITL excluded: it has many)."""
    return {
        "submit_latency": r.arrival - r.submit,
        "tokenize": r.tokenized - r.arrival,
        "queue_wait": r.first_scheduled - r.tokenized,
        "prefill_to_first_token": r.token_sampled[0] - r.first_scheduled,
        "ttft": ttft(r),
        "tpot": tpot(r),
        "e2e": (r.finished or r.token_streamed[-1]) - r.submit,
    }


@dataclass(slots=True)
class Summary:
    latencies_ms: dict[str, Percentiles]
    completed: int
    failed: int
    duration_s: float
    prompt_tokens: int
    completion_tokens: int

    @property
    def request_throughput(self) -> float:
        return self.completed / self.duration_s if self.duration_s > 0 else 0.0

    @property
    def completion_throughput(self) -> float:
        return self.completion_tokens / self.duration_s if self.duration_s > 0 else 0.0

    @property
    def total_throughput(self) -> float:
        return (self.prompt_tokens + self.completion_tokens) / self.duration_s if self.duration_s > 0 else 0.0


def summarize(requests: list[RequestTimings]) -> Summary:
    """Percentiles (in ms) over the successful requests; throughput over the run's wall time, from the
    first submit to the last response read."""
    ok = [r for r in requests if r.ok]
    samples: dict[str, list[float]] = {key: [] for key, _ in LATENCY_METRICS}
    for r in ok:
        for key, value in request_latencies(r).items():
            if value is not None:
                samples[key].append(value * 1000)
        samples["itl"].extend(gap * 1000 for gap in inter_token_latencies(r))
        samples["itl_sampled"].extend(gap * 1000 for gap in sampled_gaps(r))
    duration = 0.0
    if ok:
        duration = max(r.done or r.finished for r in ok) - min(r.submit for r in requests)
    return Summary(
        latencies_ms={key: percentiles(values) for key, values in samples.items()},
        completed=len(ok),
        failed=len(requests) - len(ok),
        duration_s=duration,
        prompt_tokens=sum(r.prompt_tokens for r in ok),
        completion_tokens=sum(r.completion_tokens for r in ok),
    )
