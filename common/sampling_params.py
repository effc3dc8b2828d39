"""Sampling parameters: what a request asks of the sampler and of the stop conditions."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

# OpenAI's limits: penalties in [-2, 2], logit_bias values in [-100, 100] (for at most MAX_LOGIT_BIAS tokens:
# their entries travel in the worker's fixed per-step staging buffer).
MAX_LOGIT_BIAS = 300
MAX_STOP_TOKEN_IDS = 64  # likewise: masked (as -inf biases) until min_tokens
MAX_LOGPROBS = 20  # vLLM's --max-logprobs default (OpenAI's top_logprobs bound); the server's is the frontend's flag
MAX_ABS_PENALTY = 2.0
MAX_ABS_LOGIT_BIAS = 100.0


class InvalidParameter(ValueError):
    """A request parameter out of its domain; `field` names it for the OpenAI-style error body."""

    def __init__(self, field: str, message: str):
        super().__init__(message)
        self.field = field


@dataclass(slots=True)
class StructuredOutput:
    """A grammar the output must follow, compiled by the scheduler (scheduler/structured_output.py)."""

    # "json" (spec: a JSON schema) | "json_object" | "regex" (spec: the pattern) | "choice" (spec: a JSON list) |
    # "grammar" (spec: an EBNF grammar, xgrammar's dialect, whose start rule is `root`)
    kind: str
    spec: str = ""
    field: str = "response_format"  # the request field it came from, named in errors

    @property
    def kind_name(self) -> str:
        """The kind in the API's terms, for messages."""
        return STRUCTURED_KIND_NAMES.get(self.kind, self.kind)

    def check_size(self, max_bytes: int) -> None:
        """--max-grammar-bytes: a grammar's source is refused past it, before it travels on or is compiled
        (checked where requests enter: the frontend, offline.LLM)."""
        size = len(self.spec.encode())
        if size > max_bytes:
            raise InvalidParameter(
                self.field,
                f"the {self.kind_name} is {size} bytes; this server compiles grammars of at most {max_bytes} bytes "
                f"(--max-grammar-bytes)",
            )


STRUCTURED_KIND_NAMES = {
    "json": "JSON schema",
    "json_object": "JSON object grammar",
    "regex": "regex",
    "choice": "choice list",
    "grammar": "grammar",
}
STRUCTURED_KINDS = tuple(STRUCTURED_KIND_NAMES)


@dataclass(slots=True)
class SamplingParams:
    max_tokens: int | None = 16  # None: up to the context length
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: no top-k cut
    min_p: float = 0.0  # 0: no min-p cut
    seed: int | None = None
    stop: list[str] = field(default_factory=list)  # stop strings, matched on text by the tokenizer worker
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    min_tokens: int = 0  # EOS and stop_token_ids are masked until this many tokens are out
    # OpenAI's additive penalties (on counts of output tokens) and the multiplicative repetition penalty
    # of CTRL / Hugging Face (on tokens of the prompt and the output).
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] = field(default_factory=dict)  # token id -> added to its logit
    logprobs: int | None = None  # None: none; k: each output token's logprob and the k most likely
    prompt_logprobs: int | None = None  # None: none; k: each prompt token's logprob and the k most likely
    structured: StructuredOutput | None = None
    # How the output's text is made from its tokens (the tokenizer worker's detokenizer): special tokens dropped
    # or shown, and for a slow tokenizer whether they are set apart by spaces (a fast one decides that itself).
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True

    @property
    def has_penalties(self) -> bool:
        return self.presence_penalty != 0.0 or self.frequency_penalty != 0.0 or self.repetition_penalty != 1.0

    def stop_reason_of(self, token: int) -> int | None:
        """vLLM's stop_reason for a request the engine stopped ("stop") on `token`: the token where it is one
        of stop_token_ids, else None (EOS, or a structured output complete)."""
        return token if token in self.stop_token_ids else None

    def validate(self, max_logprobs: int = MAX_LOGPROBS) -> None:
        for name in ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty"):
            if not math.isfinite(getattr(self, name)):
                raise InvalidParameter(name, f"{name} must be a finite number, got {getattr(self, name)}")
        if self.max_tokens is not None and (not isinstance(self.max_tokens, int) or self.max_tokens <= 0):
            raise InvalidParameter("max_tokens", f"max_tokens must be a positive integer, got {self.max_tokens!r}")
        if self.temperature < 0:
            raise InvalidParameter("temperature", f"temperature must be >= 0, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise InvalidParameter("top_p", f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < -1:
            raise InvalidParameter("top_k", f"top_k must be -1, 0 (disabled) or positive, got {self.top_k}")
        if not 0.0 <= self.min_p <= 1.0:
            raise InvalidParameter("min_p", f"min_p must be in [0, 1], got {self.min_p}")
        if self.seed is not None and not 0 <= self.seed < 2**63:
            raise InvalidParameter("seed", f"seed must be in [0, 2**63), got {self.seed}")
        if any(not s for s in self.stop):
            raise InvalidParameter("stop", "stop strings must be non-empty")
        if len(self.stop_token_ids) > MAX_STOP_TOKEN_IDS:
            raise InvalidParameter("stop_token_ids", f"at most {MAX_STOP_TOKEN_IDS} stop token ids")
        if any(t < 0 for t in self.stop_token_ids):
            raise InvalidParameter("stop_token_ids", "stop token ids must be non-negative")
        if self.min_tokens < 0 or (self.max_tokens is not None and self.min_tokens > self.max_tokens):
            raise InvalidParameter("min_tokens", f"min_tokens must be in [0, max_tokens], got {self.min_tokens}")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -MAX_ABS_PENALTY <= getattr(self, name) <= MAX_ABS_PENALTY:
                raise InvalidParameter(name, f"{name} must be in [-2, 2], got {getattr(self, name)}")
        if not self.repetition_penalty > 0:
            raise InvalidParameter(
                "repetition_penalty", f"repetition_penalty must be > 0, got {self.repetition_penalty}"
            )
        if len(self.logit_bias) > MAX_LOGIT_BIAS:
            raise InvalidParameter("logit_bias", f"logit_bias may name at most {MAX_LOGIT_BIAS} tokens")
        for token, bias in self.logit_bias.items():
            if token < 0 or not -MAX_ABS_LOGIT_BIAS <= bias <= MAX_ABS_LOGIT_BIAS:
                raise InvalidParameter(
                    "logit_bias", f"logit_bias maps token ids >= 0 to values in [-100, 100], got {token}: {bias}"
                )
        if self.structured is not None and self.structured.kind not in STRUCTURED_KINDS:
            raise InvalidParameter(self.structured.field, f"unknown structured output kind {self.structured.kind!r}")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and not 0 <= value <= max_logprobs:
                raise InvalidParameter(name, f"{name} must be in [0, {max_logprobs}], got {value}")

    def check_token_ids(self, vocab_size: int) -> None:
        """The checks that need the vocabulary (made by the tokenizer worker, which knows it)."""
        for name, ids in (("logit_bias", self.logit_bias), ("stop_token_ids", self.stop_token_ids)):
            bad = [t for t in ids if t >= vocab_size]
            if bad:
                raise InvalidParameter(name, f"{name} names token ids outside the vocabulary [0, {vocab_size}): {bad}")
        for name in ("logprobs", "prompt_logprobs"):  # the worker's top-k: a --max-logprobs over the vocabulary
            value = getattr(self, name)
            if value is not None and value > vocab_size:
                raise InvalidParameter(name, f"{name} must be at most the vocabulary's {vocab_size} tokens")
