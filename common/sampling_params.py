"""Sampling parameters: what a request asks of the sampler and of the stop conditions."""

from __future__ import annotations

from dataclasses import dataclass, field


class InvalidParameter(ValueError):
    """A request parameter out of its domain; `field` names it for the OpenAI-style error body."""

    def __init__(self, field: str, message: str):
        super().__init__(message)
        self.field = field


@dataclass(slots=True)
class SamplingParams:
    max_tokens: int | None = 16  # None: up to the context length
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: no top-k cut
    seed: int | None = None
    stop: list[str] = field(default_factory=list)  # stop strings, matched on text by the tokenizer worker
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False

    def validate(self) -> None:
        if self.max_tokens is not None and (not isinstance(self.max_tokens, int) or self.max_tokens <= 0):
            raise InvalidParameter("max_tokens", f"max_tokens must be a positive integer, got {self.max_tokens!r}")
        if self.temperature < 0:
            raise InvalidParameter("temperature", f"temperature must be >= 0, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise InvalidParameter("top_p", f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < -1:
            raise InvalidParameter("top_k", f"top_k must be -1, 0 (disabled) or positive, got {self.top_k}")
        if self.seed is not None and not 0 <= self.seed < 2**63:
            raise InvalidParameter("seed", f"seed must be in [0, 2**63), got {self.seed}")
        if any(not s for s in self.stop):
            raise InvalidParameter("stop", "stop strings must be non-empty")
        if any(t < 0 for t in self.stop_token_ids):
            raise InvalidParameter("stop_token_ids", "stop token ids must be non-negative")
