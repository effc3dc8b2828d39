"""Workload generators shared by the benchmarks: seeded, so two runs see the same requests."""

from __future__ import annotations

import itertools
import json
import random
from dataclasses import dataclass


def parse_range(text: str) -> tuple[int, int]:
    """'64-512' -> (64, 512), inclusive; '128' -> (128, 128)."""
    low, _, high = text.partition("-")
    lo, hi = int(low), int(high or low)
    if lo < 1 or hi < lo:
        raise ValueError(f"bad range {text!r}: want LOW-HIGH with 1 <= LOW <= HIGH")
    return lo, hi


def random_token_prompts(
    num: int, length_range: tuple[int, int], vocab_size: int, seed: int = 0, avoid: frozenset[int] = frozenset()
) -> list[list[int]]:
    """`num` prompts of random token ids, lengths uniform in length_range (inclusive)."""
    rng = random.Random(seed)
    prompts = []
    for _ in range(num):
        length = rng.randint(*length_range)
        prompt = []
        while len(prompt) < length:
            token = rng.randrange(vocab_size)
            if token not in avoid:
                prompt.append(token)
        prompts.append(prompt)
    return prompts


def random_lengths(num: int, length_range: tuple[int, int], seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randint(*length_range) for _ in range(num)]


@dataclass(slots=True)
class WorkloadRequest:
    """One request of a serving benchmark: a text prompt or token ids, and how many tokens to generate
    (None: the server's default)."""

    max_tokens: int | None
    prompt: str | None = None
    input_ids: list[int] | None = None
    send_at_s: float | None = None  # when to send it, seconds after the first request (a prompts file's "at_ms")


def parse_repeats(text: str) -> list[int]:
    """'1,1,1,64' -> [1, 1, 1, 64]; a range counts up: '900-903' -> [900, 901, 902, 903]."""
    repeats: list[int] = []
    for item in text.split(","):
        low, high = parse_range(item.strip())
        repeats.extend(range(low, high + 1))
    return repeats


def repeated_text_prompts(text: str, repeats: list[int], num: int, unique: bool = False) -> list[str]:
    """Request i's prompt is `text` repeated repeats[i % len(repeats)] times. `unique` puts the request's
    index first, so no two prompts share even their first KV block and the prefix cache cannot help."""
    prompts = []
    for i in range(num):
        prompt = text * repeats[i % len(repeats)]
        prompts.append(unique_prompt(i, prompt) if unique else prompt)
    return prompts


def unique_prompt(index: int, prompt: str) -> str:
    """The prompt with the request's index first: the first KV block differs, so nothing is shared."""
    return f"[{index}] {prompt}"


def load_prompts_file(path: str) -> list[tuple[str, int | None, float | None]]:
    """A JSON list of prompts, each a string or {"prompt": str, "max_tokens": int, "at_ms": number} (both
    optional; at_ms: when to send it, in milliseconds after the first request, given for every item or none)."""
    with open(path) as f:
        items = json.load(f)
    if not isinstance(items, list) or not items:
        raise ValueError(f"{path}: want a non-empty JSON list of prompts")
    prompts: list[tuple[str, int | None, float | None]] = []
    for i, item in enumerate(items):
        if isinstance(item, str):
            prompts.append((item, None, None))
        elif isinstance(item, dict) and isinstance(item.get("prompt"), str):
            prompts.append((item["prompt"], item.get("max_tokens"), item.get("at_ms")))
        else:
            raise ValueError(f"{path}: item {i} is neither a string nor an object with a 'prompt' string")
    if len({at is None for _, _, at in prompts}) > 1:
        raise ValueError(f"{path}: give 'at_ms' for every item or for none")
    return prompts


def poisson_gaps(num: int, rate: float, seed: int) -> list[float]:
    """`num` gaps (seconds) between the arrivals of a Poisson process of `rate` requests per second."""
    if rate <= 0:
        raise ValueError(f"request rate must be positive, got {rate}")
    rng = random.Random(seed)
    return [rng.expovariate(rate) for _ in range(num)]


def send_offsets(num: int, interval_s: float | None = None, rate: float | None = None, seed: int = 0) -> list[float]:
    """When to send each request, in seconds after the first: every `interval_s`, at Poisson arrivals of
    `rate` per second, or (neither) all at once. The first request always goes at 0."""
    if interval_s is not None and rate is not None:
        raise ValueError("give a fixed interval or a request rate, not both")
    if interval_s is not None:
        return [i * interval_s for i in range(num)]
    if rate is not None:
        return list(itertools.accumulate(poisson_gaps(num - 1, rate, seed), initial=0.0))[:num]
    return [0.0] * num
