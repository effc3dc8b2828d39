"""The worker's mirror of each running request, and the slot each one holds.

A slot is a request's row in every per-slot array the worker keeps between steps: the persistent batch's block
table (input_batch.py), its sampling parameters (sampler.SamplingRows), its samples so far, its token counts
(penalties), and the device's last-token slots (ModelRunner.last_tokens). A plan's changes reach the mirrors
first thing in a launch (`update`): released requests give their slots back, new ones take one, blocks are
appended. A released slot may be reused at once: the device runs steps in order, so the old owner's last
write lands before the new owner's; on the host, a step finishing after that records its token in the old
owner's mirror alone (PersistentBatch.occupant).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from common.messages import NewRequestSpec, StepPlan
from common.sampling_params import SamplingParams
from gpu_worker.input_batch import PersistentBatch, StepInputs, pick
from gpu_worker.sampler import SamplingRows
from gpu_worker.token_counts import TokenCounts


@dataclass(slots=True)
class RequestMirror:
    """The worker's copy of a running request: its tokens so far and its block table."""

    token_ids: list[int]  # prompt and the sampled tokens read back so far
    sampling: SamplingParams
    slot: int  # its row in ModelRunner.last_tokens (and in the token counts, for penalties)
    # Prompt positions [1, prompt_logprobs_end) still get their logprobs computed: the prompt's length
    # when the request asked for them and arrives fresh (a resumed one has sent them already), else 0.
    prompt_logprobs_end: int = 0


class RequestMirrors:
    def __init__(self, num_slots: int, table_width: int, block_size: int, vocab_size: int, device: torch.device):
        """table_width: the most blocks a request holds (its context's)."""
        self.by_rid: dict[int, RequestMirror] = {}
        self.num_slots = num_slots
        self._free_slots = list(range(num_slots - 1, -1, -1))
        self.batch = PersistentBatch(num_slots, table_width, block_size)
        self.sampling_rows = SamplingRows(num_slots, vocab_size)
        # Samples launched per slot, including one whose token may not be read back yet: the index in its
        # output of the token a request samples next (seeds its draws).
        self.num_sampled = np.zeros(num_slots, dtype=np.int64)
        self.token_counts: TokenCounts | None = None  # made when a request first asks for a penalty
        self._vocab_size = vocab_size
        self._device = device
        self.num_prompt_logprobs = 0  # mirrors still computing prompt logprobs: their rows are looked for
        self.num_structured = 0  # mirrors whose samples are masked (structured output)

    def __getitem__(self, rid: int) -> RequestMirror:
        return self.by_rid[rid]

    def update(self, plan: StepPlan) -> None:
        """The plan's changes: released mirrors dropped, new ones added, block tables extended."""
        for rid in plan.released:
            mirror = self.by_rid.pop(rid, None)
            if mirror is not None:
                self._free_slots.append(mirror.slot)
                self.num_prompt_logprobs -= mirror.prompt_logprobs_end > 0
                self.num_structured -= mirror.sampling.structured is not None
        for spec in plan.new_requests:
            self.by_rid[spec.rid] = self._add(spec)
        for rid, block_ids in plan.new_block_ids.items():
            self.batch.append_blocks(self.by_rid[rid].slot, block_ids)

    def step_inputs(self, plan: StepPlan) -> tuple[list[RequestMirror], StepInputs]:
        """The plan's requests' mirrors (plan order), and the step's inputs (input_batch.py, layout order)."""
        step_mirrors = pick(self.by_rid, plan.rids)
        n = len(step_mirrors)
        inputs = self.batch.prepare(
            plan.rids,
            np.fromiter(plan.starts, np.int64, n),
            np.fromiter(plan.num_tokens, np.int64, n),
            np.frombuffer(bytes(plan.samples), np.bool_),  # (bools as bytes: half np.array's time)
            np.fromiter([m.slot for m in step_mirrors], np.int64, n),
            lambda i: step_mirrors[i].token_ids,
        )
        return step_mirrors, inputs

    def record_samples(
        self, mirrors: list[RequestMirror], slots: np.ndarray, occupants: np.ndarray, tokens: torch.Tensor
    ) -> list[int]:
        """A finished step's tokens, one per mirror (in `slots`, whose occupants were `occupants` when it
        launched), reached the host: they join the mirrors' tokens. Returns them as a list."""
        values = tokens.numpy()
        token_ids = values.tolist()
        for mirror, token in zip(mirrors, token_ids):
            mirror.token_ids.append(token)
        self.batch.record_samples(slots, occupants, values)
        return token_ids

    def _add(self, spec: NewRequestSpec) -> RequestMirror:
        s = spec.sampling
        if s.seed is None:
            raise ValueError(f"request {spec.rid} arrived without a seed; the scheduler assigns one")
        if not self._free_slots:
            raise RuntimeError("more live requests than --max-num-seqs allows (seated plus finishing)")
        slot = self._free_slots.pop()
        prompt_len = len(spec.token_ids) - spec.num_sampled
        if s.has_penalties:
            if self.token_counts is None:
                self.token_counts = TokenCounts(self.num_slots, self._vocab_size, self._device)
            self.token_counts.reset(slot, spec.token_ids[:prompt_len], spec.token_ids[prompt_len:])
        fresh = spec.num_sampled == 0 and s.prompt_logprobs is not None
        self.num_prompt_logprobs += fresh and prompt_len > 0
        self.batch.reset(slot, spec.token_ids)
        self.sampling_rows.set(slot, s)
        self.num_sampled[slot] = spec.num_sampled
        self.num_structured += s.structured is not None
        return RequestMirror(list(spec.token_ids), s, slot, prompt_len if fresh else 0)
