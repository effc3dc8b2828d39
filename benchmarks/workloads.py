"""Workload generators shared by the benchmarks: seeded, so two runs see the same requests."""

from __future__ import annotations

import random


def parse_range(text: str) -> tuple[int, int]:
    """'64-512' -> (64, 512), inclusive; '128' -> (128, 128)."""
    low, _, high = text.partition("-")
    lo, hi = int(low), int(high or low)
    if lo < 1 or hi < lo:
        raise ValueError(f"bad range {text!r}: want LOW-HIGH with 1 <= LOW <= HIGH")
    return lo, hi


def random_token_prompts(num: int, length_range: tuple[int, int], vocab_size: int, seed: int = 0,
                         avoid: frozenset[int] = frozenset()) -> list[list[int]]:
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
