"""Sampling on the device: one batched call for every request of the step.

    logits ─▶ process: structured output's allowed tokens, logit_bias and min_tokens masks, then
              presence/frequency/repetition penalties
           ─▶ greedy rows: argmax
           ─▶ random rows: temperature, min-p, top-k, top-p, then one draw
    logprobs: log_softmax of the processed logits divided by the temperature (1 for greedy rows), i.e.
    the distribution the draw is made from, before its truncations (min-p, top-k, top-p).

Random rows draw with the exponential-race trick (argmax of p_i / E_i with E_i ~ Exp(1) picks i with
probability p_i). The E_i come from a counter-based hash of (request seed, output index, token id): a
request's draws depend only on its own seed and how many tokens it has produced, never on which other
requests share the batch, so a seeded request gives the same output alone, batched, chunked or
recomputed after preemption. Penalties read per-request token counts kept on the device (TokenCounts),
which depend on the request's own tokens only, so the same holds for them.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from common.sampling_params import SamplingParams
from gpu_worker.token_counts import TokenCounts

_MASK32 = 0xFFFFFFFF


@dataclass(slots=True)
class Penalties:
    rows: torch.Tensor  # [P] rows of the batch with a penalty
    slots: torch.Tensor  # [P] their rows in TokenCounts
    presence: torch.Tensor  # [P, 1] float32
    frequency: torch.Tensor  # [P, 1]
    repetition: torch.Tensor  # [P, 1]


@dataclass(slots=True)
class SamplingBatch:
    """Per-row parameters on the device; the random-draw ones are None when every row is greedy."""

    all_greedy: bool
    temperature: torch.Tensor | None = None  # [S] float32; 0 for greedy rows
    top_p: torch.Tensor | None = None  # [S] float32; 1 where disabled
    top_k: torch.Tensor | None = None  # [S] int64; vocab size where disabled
    min_p: torch.Tensor | None = None  # [S] float32; 0 where disabled
    seed: torch.Tensor | None = None  # [S] int64
    output_index: torch.Tensor | None = None  # [S] int64: index of the token being sampled in its output
    any_top_k: bool = False
    any_top_p: bool = False
    any_min_p: bool = False
    # (rows, token ids, values) added to the logits: logit_bias, and -inf on stop tokens before min_tokens.
    bias: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
    penalties: Penalties | None = None
    counts: TokenCounts | None = None
    # Structured output: (rows, [R, ceil(V / 32)] int32 words); bit j of word i allows token 32 i + j.
    bitmask: tuple[torch.Tensor, torch.Tensor] | None = None
    num_top_logprobs: int = -1  # -1: no row asks for logprobs; else the largest k asked in the batch
    logprob_rows: torch.Tensor | None = None  # [L] rows that ask for logprobs
    logprob_row_list: list[int] | None = None  # the same, on the host

    @classmethod
    def build(
        cls,
        params: list[SamplingParams],
        output_index: list[int],
        vocab_size: int,
        upload: Callable[[Any, torch.dtype], torch.Tensor],
        slots: list[int] | None = None,
        counts: TokenCounts | None = None,
        eos_token_ids: list[int] = (),
        bitmasks: list[bytes | None] | None = None,
    ) -> SamplingBatch:
        """One row per sampled request: its parameters, the index of the token it samples in its output,
        (for penalties) its row in `counts`, and (for structured output) its allowed tokens."""
        rows = SamplingRows(len(params), vocab_size)
        for row, p in enumerate(params):
            rows.set(row, p)
        index = np.asarray(output_index, dtype=np.int64)
        return rows.batch(np.arange(len(params)), index, upload, slots, counts, eos_token_ids, bitmasks)


class SamplingRows:
    """Sampling parameters kept per slot in arrays, set when a request arrives: a step's batch is gathered
    from them with numpy. Only rows with a `special` need (logit_bias, min_tokens, penalties, logprobs) are
    visited one by one."""

    def __init__(self, num_slots: int, vocab_size: int):
        self.vocab_size = vocab_size
        self.params: list[SamplingParams | None] = [None] * num_slots
        self.temperature = np.zeros(num_slots, dtype=np.float32)  # 0 for greedy rows
        self.top_p = np.ones(num_slots, dtype=np.float32)
        self.top_k = np.full(num_slots, vocab_size, dtype=np.int64)  # vocab size where disabled
        self.min_p = np.zeros(num_slots, dtype=np.float32)
        self.seed = np.zeros(num_slots, dtype=np.int64)
        self.greedy = np.ones(num_slots, dtype=bool)
        self.special = np.zeros(num_slots, dtype=bool)

    def set(self, slot: int, p: SamplingParams) -> None:
        top_k = p.top_k if 0 < p.top_k < self.vocab_size else self.vocab_size
        greedy = p.temperature == 0.0 or top_k == 1
        self.params[slot] = p
        self.temperature[slot] = 0.0 if greedy else p.temperature
        self.top_p[slot], self.top_k[slot], self.min_p[slot] = p.top_p, top_k, p.min_p
        self.seed[slot] = p.seed or 0
        self.greedy[slot] = greedy
        self.special[slot] = bool(p.logit_bias) or p.min_tokens > 0 or p.has_penalties or p.logprobs is not None

    def plain_greedy(self, slots: np.ndarray) -> bool:
        """Whether these rows all take their argmax, with no bias, penalty, min_tokens or logprobs to apply."""
        return bool(self.greedy[slots].all()) and not self.special[slots].any()

    def batch(
        self,
        slots: np.ndarray,
        output_index: np.ndarray,
        upload: Callable[[Any, torch.dtype], torch.Tensor],
        counts_slots: list[int] | None = None,
        counts: TokenCounts | None = None,
        eos_token_ids: list[int] = (),
        bitmasks: list[bytes | None] | None = None,
    ) -> SamplingBatch:
        """The batch of these slots' rows, in this order. output_index: the index in its output of the token
        each row samples; counts_slots: each row's row in `counts` (default: its slot)."""
        batch = SamplingBatch(all_greedy=True)
        masked = [row for row, mask in enumerate(bitmasks or []) if mask is not None]
        if masked:
            words = np.stack([np.frombuffer(bitmasks[row], dtype=np.int32) for row in masked])
            batch.bitmask = (upload(masked, torch.long), upload(words, torch.int32))
        special = np.flatnonzero(self.special[slots]).tolist()
        if special:
            self._special_rows(batch, special, slots, output_index, upload, counts_slots, counts, eos_token_ids)
        greedy = self.greedy[slots]
        if greedy.all():
            return batch
        top_k = self.top_k[slots]
        top_p, min_p = self.top_p[slots], self.min_p[slots]
        floats = upload(np.stack([self.temperature[slots], top_p, min_p]), torch.float32)
        ints = upload(np.stack([top_k, self.seed[slots], output_index]), torch.long)
        batch.all_greedy = False
        batch.temperature, batch.top_p, batch.min_p = floats[0], floats[1], floats[2]
        batch.top_k, batch.seed, batch.output_index = ints[0], ints[1], ints[2]
        random = ~greedy
        batch.any_top_k = bool((random & (top_k < self.vocab_size)).any())
        batch.any_top_p = bool((random & (top_p < 1.0)).any())
        batch.any_min_p = bool((random & (min_p > 0.0)).any())
        return batch

    def _special_rows(self, batch, rows, slots, output_index, upload, counts_slots, counts, eos_token_ids) -> None:
        """logit_bias and min_tokens masks (as biases), penalties and logprobs, for the rows that ask."""
        vocab_size = self.vocab_size
        params = {row: self.params[slots[row]] for row in rows}
        bias_rows, bias_ids, bias_values = [], [], []
        for row, p in params.items():
            for token, value in p.logit_bias.items():
                if token < vocab_size:
                    bias_rows.append(row), bias_ids.append(token), bias_values.append(value)
            if output_index[row] < p.min_tokens:
                for token in {*p.stop_token_ids, *([] if p.ignore_eos else eos_token_ids)}:
                    bias_rows.append(row), bias_ids.append(token), bias_values.append(float("-inf"))
        if bias_rows:
            batch.bias = (
                upload(bias_rows, torch.long),
                upload(bias_ids, torch.long),
                upload(bias_values, torch.float32),
            )
        penalized = [row for row, p in params.items() if p.has_penalties]
        if penalized:
            assert counts is not None, "penalties read the token counts"
            counts_of = slots if counts_slots is None else counts_slots
            values = upload(
                [
                    [params[r].presence_penalty, params[r].frequency_penalty, params[r].repetition_penalty]
                    for r in penalized
                ],
                torch.float32,
            )
            batch.penalties = Penalties(
                upload(penalized, torch.long),
                upload([int(counts_of[r]) for r in penalized], torch.long),
                values[:, 0:1],
                values[:, 1:2],
                values[:, 2:3],
            )
            batch.counts = counts
        wanting = [row for row, p in params.items() if p.logprobs is not None]
        if wanting:
            batch.num_top_logprobs = max(params[r].logprobs for r in wanting)
            batch.logprob_rows = upload(wanting, torch.long)
            batch.logprob_row_list = wanting


@dataclass(slots=True)
class SampledLogprobs:
    """Device tensors for the rows that asked: the sampled token's logprob and the top-k."""

    rows: list[int]  # [L] rows of the batch
    sampled: torch.Tensor  # [L] float32
    top_ids: torch.Tensor  # [L, k] int64
    top_logprobs: torch.Tensor  # [L, k] float32


def process_logits(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """The logits every row samples from (greedy ones included): bias and min_tokens masks, penalties."""
    if batch.bias is None and batch.penalties is None and batch.bitmask is None:
        return logits
    logits = logits.clone()
    if batch.bitmask is not None:
        rows, words = batch.bitmask
        shifts = torch.arange(32, device=words.device, dtype=torch.int32)
        allowed = ((words[:, :, None] >> shifts) & 1).reshape(len(words), -1)[:, : logits.shape[1]].bool()
        logits[rows] = logits[rows].masked_fill(~allowed, float("-inf"))
    if batch.bias is not None:
        rows, ids, values = batch.bias
        logits.index_put_((rows, ids), values, accumulate=True)
    if batch.penalties is not None:
        logits[batch.penalties.rows] = apply_penalties(logits[batch.penalties.rows], batch.penalties, batch.counts)
    return logits


def apply_penalties(logits: torch.Tensor, penalties: Penalties, counts: TokenCounts) -> torch.Tensor:
    """OpenAI's: logit[j] -= frequency * count[j] + presence * (count[j] > 0), counts over the output;
    then the repetition penalty on every token of the prompt or the output: a positive logit is divided
    by it, a negative one multiplied (CTRL, as Hugging Face and vLLM apply it)."""
    output_counts = counts.output[penalties.slots].to(logits.dtype)  # [P, V]
    in_output = output_counts > 0
    seen = in_output | counts.in_prompt[penalties.slots]
    repetition = penalties.repetition
    repeated = torch.where(logits > 0, logits / repetition, logits * repetition)
    logits = torch.where(seen, repeated, logits)
    return logits - penalties.frequency * output_counts - penalties.presence * in_output.to(logits.dtype)


def sample(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """logits: [S, V] float32, already processed. Returns [S] int64 token ids."""
    greedy_tokens = logits.argmax(dim=-1)
    if batch.all_greedy:
        return greedy_tokens
    greedy_rows = batch.temperature == 0
    scaled = logits / torch.where(greedy_rows, 1.0, batch.temperature)[:, None]
    if batch.any_min_p:
        # p_i < min_p * p_max  <=>  logit_i < logit_max + log(min_p)  (min_p = 0: log gives -inf, no cut)
        floor = scaled.max(dim=-1, keepdim=True).values + torch.log(batch.min_p)[:, None]
        scaled = scaled.masked_fill(scaled < floor, float("-inf"))
    if batch.any_top_k or batch.any_top_p:
        scaled = apply_top_k_top_p(scaled, batch.top_k, batch.top_p)
    probs = torch.softmax(scaled, dim=-1)
    noise = exponential_noise(batch.seed, batch.output_index, logits.shape[1])
    drawn = (probs / noise).argmax(dim=-1)
    return torch.where(greedy_rows, greedy_tokens, drawn)


def sampled_logprobs(logits: torch.Tensor, batch: SamplingBatch, tokens: torch.Tensor) -> SampledLogprobs | None:
    """Logprobs of the processed logits at the row's temperature (1 for greedy rows), for rows that ask."""
    if batch.logprob_rows is None:
        return None
    rows = batch.logprob_rows
    chosen = logits[rows]
    if not batch.all_greedy:
        temperature = batch.temperature[rows]
        chosen = chosen / torch.where(temperature == 0, 1.0, temperature)[:, None]
    logprobs = torch.log_softmax(chosen, dim=-1)
    sampled = logprobs.gather(1, tokens[rows][:, None])[:, 0]
    top = logprobs.topk(batch.num_top_logprobs, dim=-1)
    return SampledLogprobs(batch.logprob_row_list, sampled, top.indices, top.values)


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
