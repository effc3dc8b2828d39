"""The scheduler's stats: one typed definition for the scheduler that counts them, the control reply that
carries them (flat JSON: `/stats` shows these keys as they are) and the frontend's /metrics.

Each field names its Prometheus metric, and where vLLM has the same measure, vLLM's name too (`vllm:*`, so
dashboards made for vLLM work); gauges are the scheduler's state at the moment of the snapshot, counters
only grow.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields
from typing import Any, Literal


def _metric(kind: Literal["gauge", "counter"], name: str, doc: str, vllm: str | None = None) -> Any:
    return field(default=0, metadata={"kind": kind, "name": name, "doc": doc, "vllm": vllm})


@dataclass(slots=True)
class SchedulerStats:
    # State, filled in by Scheduler.snapshot().
    num_running: int = _metric(
        "gauge", "clearserve_num_requests_running", "Requests in the running batch", "vllm:num_requests_running"
    )
    num_waiting: int = _metric(
        "gauge", "clearserve_num_requests_waiting", "Requests waiting for admission", "vllm:num_requests_waiting"
    )
    kv_blocks_total: int = _metric("gauge", "clearserve_kv_blocks_total", "KV cache blocks in the pool")
    kv_blocks_free: int = _metric("gauge", "clearserve_kv_blocks_free", "KV cache blocks on the free list")
    kv_blocks_cached: int = _metric(
        "gauge",
        "clearserve_kv_blocks_cached",
        "KV cache blocks held only by the prefix cache: reusable by a matching prompt, evicted when needed",
    )
    kv_blocks_used: int = _metric("gauge", "clearserve_kv_blocks_used", "KV cache blocks held by running requests")
    prefill_budget: int = _metric(
        "gauge",
        "clearserve_prefill_budget_tokens",
        "Prompt tokens the next step may compute (sized from step times under --max-num-batched-tokens auto)",
    )
    num_waiting_for_grammar: int = _metric(
        "gauge",
        "clearserve_num_requests_waiting_for_grammar",
        "Structured-output requests waiting for their grammar to compile (or for the grammar vocabulary)",
    )
    grammar_vocabulary_ready: int = _metric(
        "gauge",
        "clearserve_grammar_vocabulary_ready",
        "Engine replicas whose grammar compile worker has prepared the vocabulary (until then grammars wait)",
    )
    grammar_wait_refusals: int = _metric(
        "counter",
        "clearserve_grammar_wait_refusals",
        "Structured-output requests refused (503) because their grammar was not ready within 10x "
        "--grammar-compile-timeout of their arrival (the server busy compiling, or preparing the vocabulary)",
    )
    # The last step's sizes and the cumulative counters, kept up to date by the scheduler as it plans.
    last_step_prefill_tokens: int = _metric(
        "gauge", "clearserve_last_step_prefill_tokens", "Prompt tokens computed by the last step"
    )
    last_step_decode_tokens: int = _metric(
        "gauge", "clearserve_last_step_decode_tokens", "Decode tokens computed by the last step"
    )
    steps: int = _metric("counter", "clearserve_scheduler_steps", "Step plans sent to the GPU worker")
    prompt_tokens_computed: int = _metric(
        "counter", "clearserve_prompt_tokens_computed", "Prompt tokens run through the model"
    )
    decode_tokens_computed: int = _metric(
        "counter", "clearserve_decode_tokens_computed", "Decode tokens run through the model"
    )
    generated_tokens: int = _metric(
        "counter", "clearserve_scheduler_generated_tokens", "Tokens sampled, as the scheduler counts them"
    )
    prompt_tokens_admitted: int = _metric(
        "counter",
        "clearserve_prompt_tokens_admitted",
        "Prompt tokens of admitted requests",
        "vllm:prefix_cache_queries",  # vLLM: tokens looked up in the prefix cache
    )
    # Prompt tokens served from the prefix cache at first admission.
    cache_hit_tokens: int = _metric(
        "counter",
        "clearserve_prefix_cache_hit_tokens",
        "Prompt tokens served from the prefix cache",
        "vllm:prefix_cache_hits",
    )
    preemptions: int = _metric(
        "counter", "clearserve_preemptions", "Requests preempted to free KV blocks", "vllm:num_preemptions"
    )

    @property
    def cache_hit_rate(self) -> float:
        """Share of admitted prompt tokens served from the prefix cache."""
        return self.cache_hit_tokens / self.prompt_tokens_admitted if self.prompt_tokens_admitted else 0.0

    def to_payload(self) -> dict[str, int]:
        return asdict(self)

    @classmethod
    def total(cls, replicas: list[SchedulerStats]) -> SchedulerStats | None:
        """The server's figures from each engine replica's: every gauge and counter summed (the hit rate and
        the usage, ratios of sums, follow). None for no replica."""
        if not replicas:
            return None
        return cls(**{f.name: sum(getattr(s, f.name) for s in replicas) for f in fields(cls)})

    @classmethod
    def from_payload(cls, payload: dict[str, Any]) -> SchedulerStats:
        """The stats in a control reply, which also carries the process's own activity keys."""
        return cls(**{f.name: payload[f.name] for f in fields(cls) if f.name in payload})

    @property
    def kv_cache_usage(self) -> float:
        """Share of the KV blocks held by requests (0-1; blocks only the prefix cache holds are reusable)."""
        return self.kv_blocks_used / self.kv_blocks_total if self.kv_blocks_total else 0.0

    @classmethod
    def metrics(cls) -> list[tuple[str, str, str, str, str | None]]:
        """(field, kind, metric name, help, vLLM's name or None) of every field."""
        return [
            (f.name, f.metadata["kind"], f.metadata["name"], f.metadata["doc"], f.metadata["vllm"]) for f in fields(cls)
        ]
