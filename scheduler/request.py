"""A request as the scheduler sees it: tokens, blocks, and how far its computation has been planned.

    position:   0 ............ num_computed ............ num_tokens_planned
                |── KV written or planned ──|── known to the worker, KV not planned ──|

num_tokens_planned = prompt + every sample planned so far (some may still be in flight on the GPU).
The next chunk computes [num_computed, num_computed + n); it samples when it reaches num_tokens_planned.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum

from common.messages import Logprobs, StageTimes
from common.sampling_params import SamplingParams
from scheduler.prefix_cache import InsertCursor
from scheduler.structured_output import RequestGrammar


class RequestStatus(Enum):
    """Where a request is in its life:

        WAITING_FOR_GRAMMAR ──compiled──▶ WAITING ──admit──▶ RUNNING ──last sample planned──▶ FINISHING ──▶ FINISHED
                                             ▲                  │                           (last token back)
                                             └────preempt───────┘
        (EOS, a stop or an abort: from any state to FINISHED; a grammar that does not compile, or is not ready
        within its wait bound from the request's arrival: refused, FINISHED)

    A request waiting for its grammar (structured output not in the cache: grammars.py) is in no queue and has
    had no verdict yet. A FINISHING request has no seat and no blocks: it only waits for its last token.
    """

    WAITING_FOR_GRAMMAR = "waiting_for_grammar"
    WAITING = "waiting"
    RUNNING = "running"
    FINISHING = "finishing"
    FINISHED = "finished"


@dataclass(slots=True, eq=False)
class Request:
    rid: int
    prompt_ids: list[int]
    sampling: SamplingParams  # seed always set: the scheduler draws one for unseeded requests
    max_tokens: int  # resolved: never beyond the context (so reaching it is the only length limit to check)
    times: StageTimes
    output_ids: list[int] = field(default_factory=list)
    status: RequestStatus = RequestStatus.WAITING
    block_ids: list[int] = field(default_factory=list)
    num_computed: int = 0
    num_samples_planned: int = 0
    # Tokens the worker's mirror starts from: prompt, plus outputs when resumed after a preemption.
    num_resume_tokens: int = 0
    cache_cursor: InsertCursor = field(default_factory=InsertCursor)
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache at first admission
    num_preemptions: int = 0
    finish_reason: str | None = None
    first_tokens_sent: bool = False
    prompt_logprobs: Logprobs | None = None  # gathered chunk by chunk, sent with the first tokens
    grammar: RequestGrammar | None = None  # structured output: advanced with each output token
    # The tokens that stop it: the sampling's stop_token_ids and, unless it ignores EOS, the model's EOS ids. One set,
    # looked up for every output token.
    stop_token_ids: frozenset[int] = frozenset()
    priority: int = 0  # --scheduling-policy priority: lower first (scheduler/waiting_queue.py)
    arrival: int = 0  # the scheduler's count of requests when this one arrived: arrival order
    cache_salt: str | None = None  # its prefix-cache entries are shared only with requests of the same salt

    @property
    def num_tokens_planned(self) -> int:
        return len(self.prompt_ids) + self.num_samples_planned

    @property
    def num_samples_in_flight(self) -> int:
        return self.num_samples_planned - len(self.output_ids)

    @property
    def is_prefilling(self) -> bool:
        """Still computing tokens it was admitted with (prompt, or prompt + outputs after preemption)."""
        return self.num_computed < self.num_resume_tokens

    def known_token_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    def token_span(self, start: int, end: int) -> list[int]:
        """Known tokens [start, end), without copying the rest of the sequence."""
        prompt = self.prompt_ids
        if end <= len(prompt):
            return prompt[start:end]
        if start >= len(prompt):
            return self.output_ids[start - len(prompt) : end - len(prompt)]
        return prompt[start:] + self.output_ids[: end - len(prompt)]

    def can_sample_more(self) -> bool:
        return self.num_samples_planned < self.max_tokens
