"""Sampling on the device: one batched call for every request of the step.

Greedy rows take the argmax. Random rows apply temperature, top-k and top-p, then draw with the
exponential-race trick (argmax of p_i / E_i with E_i ~ Exp(1) picks i with probability p_i). The E_i come
from a counter-based hash of (request seed, output index, token id): a request's draws depend only on
its own seed and how many tokens it has produced, never on which other requests share the batch, so
a seeded request gives the same output alone, batched, chunked or recomputed after preemption.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

_MASK32 = 0xFFFFFFFF


@dataclass(slots=True)
class SamplingBatch:
    """Per-row parameters on the device; all None when every row is greedy (nothing to copy then)."""

    all_greedy: bool
    temperature: torch.Tensor | None = None  # [S] float32; 0 for greedy rows
    top_p: torch.Tensor | None = None  # [S] float32; 1 where disabled
    top_k: torch.Tensor | None = None  # [S] int64; vocab size where disabled
    seed: torch.Tensor | None = None  # [S] int64
    output_index: torch.Tensor | None = None  # [S] int64: index of the token being sampled in its output
    any_top_k: bool = False
    any_top_p: bool = False

    @classmethod
    def build(
        cls,
        rows: list[tuple[float, int, float, int, int]],
        vocab_size: int,
        upload: Callable[[Any, torch.dtype], torch.Tensor],
    ) -> SamplingBatch:
        """rows: (temperature, top_k, top_p, seed, output_index) per sampled request; upload puts host
        values on the device (the runner's staging ring)."""
        top_k = [r[1] if 0 < r[1] < vocab_size else vocab_size for r in rows]
        greedy = [r[0] == 0.0 or k == 1 for r, k in zip(rows, top_k)]
        if all(greedy):
            return cls(all_greedy=True)
        floats = upload([[0.0 if g else r[0] for g, r in zip(greedy, rows)], [r[2] for r in rows]], torch.float32)
        ints = upload([top_k, [r[3] for r in rows], [r[4] for r in rows]], torch.long)
        return cls(
            all_greedy=False,
            temperature=floats[0],
            top_p=floats[1],
            top_k=ints[0],
            seed=ints[1],
            output_index=ints[2],
            any_top_k=any(not g and k < vocab_size for g, k in zip(greedy, top_k)),
            any_top_p=any(not g and r[2] < 1.0 for g, r in zip(greedy, rows)),
        )


def sample(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """logits: [S, V] float32. Returns [S] int64 token ids."""
    greedy_tokens = logits.argmax(dim=-1)
    if batch.all_greedy:
        return greedy_tokens
    greedy_rows = batch.temperature == 0
    scaled = logits / torch.where(greedy_rows, 1.0, batch.temperature)[:, None]
    if batch.any_top_k or batch.any_top_p:
        scaled = apply_top_k_top_p(scaled, batch.top_k, batch.top_p)
    probs = torch.softmax(scaled, dim=-1)
    noise = exponential_noise(batch.seed, batch.output_index, logits.shape[1])
    drawn = (probs / noise).argmax(dim=-1)
    return torch.where(greedy_rows, greedy_tokens, drawn)


def apply_top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Set to -inf every logit outside the row's top-k and outside its top-p nucleus (at least one kept)."""
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    vocab = logits.shape[1]
    ranks = torch.arange(vocab, device=logits.device)[None, :]
    drop = ranks >= top_k[:, None]
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    probs = torch.softmax(sorted_logits, dim=-1)
    mass_before = torch.cumsum(probs, dim=-1) - probs
    drop |= (mass_before >= top_p[:, None]) & (ranks > 0)
    return logits.scatter(1, order, sorted_logits.masked_fill(drop, float("-inf")))


def _mix32(h: torch.Tensor) -> torch.Tensor:
    # MurmurHash3's 32-bit finalizer, in int64 arithmetic masked to 32 bits (wrapping products are fine:
    # only the low 32 bits are kept).
    h = h ^ (h >> 16)
    h = (h * 0x85EBCA6B) & _MASK32
    h = h ^ (h >> 13)
    h = (h * 0xC2B2AE35) & _MASK32
    return h ^ (h >> 16)


def exponential_noise(seed: torch.Tensor, output_index: torch.Tensor, vocab: int) -> torch.Tensor:
    """[S, V] float32 draws of Exp(1), a pure function of (seed, output_index, token id)."""
    row = _mix32((seed & _MASK32) ^ _mix32(((seed >> 32) & _MASK32) ^ _mix32(output_index & _MASK32)))
    token = torch.arange(vocab, device=seed.device, dtype=torch.long)
    h = _mix32(row[:, None] ^ ((token * 0x9E3779B1) & _MASK32)[None, :])
    h = _mix32(h ^ (row[:, None] >> 7))
    uniform = ((h >> 8).float() + 0.5) * (1.0 / (1 << 24))  # in (0, 1)
    return -torch.log(uniform)
