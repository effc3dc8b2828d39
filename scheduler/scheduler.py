"""Continuous batching: which requests compute which tokens in the next forward.

One step (schedule), in order:
  0. retire: running requests whose last sample is already planned become FINISHING: they give up their
     seat and their blocks at once and only wait for that token (see below).
  1. running (_schedule_running), oldest first (--scheduling-policy priority: most urgent first): a decode
     computes its one new token; a prompt being chunked takes its next chunk from the prompt-token budget
     (fixed, or sized from measured step times to keep a step within an ITL target: prefill_budget.py).
     Short of blocks, the prefix cache evicts, then the last running request (the newest, or least urgent) is
     preempted (blocks freed, recomputed later with the tokens it had).
  2. admit (_admit), unless step 1 preempted: waiting requests in their queue's order (arrival, or priority
     then arrival: scheduler/waiting_queue.py), while there is room (--max-num-seqs
     seats, --max-prefill-requests per step, --max-num-batched-tokens prompt tokens): each reuses its
     longest cached prefix and computes the rest (a chunk of it, if it does not fit the budget and
     chunking is on). The first request that cannot be admitted stops admission: order is kept.
All of a step's chunks go to the worker as one plan, computed in one forward.

Prompts that arrive together are prefilled together. A plan made ahead (another is still in flight) is held
back while the running batch is nothing but the newcomers of the plan in flight (the engine was idle, or has
only requests left whose last token is planned already: they leave the batch at the next plan): it
would only carry their first decodes, and the prompts arriving behind the first one, while its prefill runs,
would then wait for two plans instead of one. Held, they all join the next plan, made when the result comes
(the worker waits one turnaround for it, once each time the batch starts over). A batch with older requests in
it, or a full one, is planned ahead as ever.

Results arrive PIPELINE_DEPTH - 1 steps late (the next plan is made while the GPU runs this one), so a
request that sampled EOS may be scheduled once more; that extra token is discarded here. A request that
reaches max_tokens is known to be done without the result: the next plan can admit a successor into its
seat and blocks. (The worker runs plans in order, so the successor writes those blocks only after the
step that last used them.)
"""

from __future__ import annotations

import bisect
import math
import random
import time
from dataclasses import dataclass, field, replace
from itertools import compress
from typing import cast

from common.config import EngineConfig
from common.messages import (
    FirstTokens,
    Logprobs,
    NewRequestSpec,
    RequestAccepted,
    RequestRejected,
    StepPlan,
    StepResult,
    TokenBatch,
    TokenizedRequest,
    WorkerLimits,
)
from common.model_info import ModelInfo
from common.sampling_params import SamplingParams
from common.scheduler_stats import SchedulerStats
from scheduler.block_manager import BlockManager
from scheduler.compile_worker import GrammarRefused
from scheduler.grammars import Grammars
from scheduler.prefill_budget import PrefillBudget
from scheduler.prefix_cache import InsertCursor, PrefixCache
from scheduler.request import Request, RequestStatus
from scheduler.waiting_queue import WaitingQueue, priority_key


@dataclass(slots=True)
class _StepDraft:
    """A plan being built: what schedule()'s parts add to, and the prompt-token budget they share. Its
    entries are the plan's columns (StepPlan)."""

    budget: int
    start_budget: int
    rids: list[int] = field(default_factory=list)
    starts: list[int] = field(default_factory=list)
    num_tokens: list[int] = field(default_factory=list)
    samples: list[bool] = field(default_factory=list)
    new_block_ids: dict[int, list[int]] = field(default_factory=dict)
    token_bitmasks: dict[int, bytes] = field(default_factory=dict)
    new_requests: list[NewRequestSpec] = field(default_factory=list)
    decode_tokens: int = 0
    preempted: bool = False  # a running request lost its blocks: admit nobody ahead of it this step


class Scheduler:
    def __init__(self, config: EngineConfig, info: ModelInfo, limits: WorkerLimits):
        """limits: as the GPU worker decided them for its device (WorkerReady); config's own are not read."""
        self.config = config
        self.max_num_seqs = limits.max_num_seqs
        self.max_num_batched_tokens = limits.max_num_batched_tokens  # the ceiling: the worker is sized for it
        target = config.target_itl_ms / 1000 if limits.adaptive_prefill_budget else None
        self.prefill_budget = PrefillBudget(limits.max_num_batched_tokens, target)
        self.block_size = config.block_size
        self.blocks = BlockManager(limits.num_kv_blocks, config.block_size)
        self.cache = PrefixCache(self.blocks) if config.enable_prefix_caching else None
        self.max_model_len = limits.max_model_len  # within the KV store: a request must fit it alone
        self.eos_token_ids = frozenset(info.eos_token_ids)
        # Structured output's grammars: the compile worker starts with the server (scheduler/process.py: it
        # prepares the vocabulary while the server serves), or on the first grammar.
        self.grammars = Grammars(config.model, info.vocab_size, info.eos_token_ids, config.grammar_compile_timeout)
        self.requests: dict[int, Request] = {}
        self.waiting = WaitingQueue(config.scheduling_policy)
        self._arrivals = 0  # requests that arrived so far: each one's arrival order
        self.running: list[Request] = []  # the batch: at most max_num_seqs, oldest (or most urgent) first
        # Requests whose last token is in flight: no seat, no blocks; they finish when it arrives.
        self.finishing: dict[int, Request] = {}
        self.stats = SchedulerStats()  # counters and the last step's sizes; snapshot() adds the state
        self._released: list[int] = []  # rids whose worker mirror must be dropped, sent with the next plan
        self._last_sampled: list[Request] = []  # planned their last sample in the latest plan
        self._newcomers: set[int] = set()  # the rids the latest plan admitted
        self._step_id = 0
        self._seeds = random.Random()

    # ------------------------------------------------------------------ inputs

    def add_request(self, msg: TokenizedRequest) -> RequestAccepted | RequestRejected | None:
        """The request's verdict; None while its grammar is compiled: take_grammar_verdicts() gives it then."""
        prompt = msg.prompt_token_ids
        rejection = self._validate(msg.rid, prompt, msg.sampling)
        if rejection is None and msg.priority and not self.waiting.by_priority:
            rejection = RequestRejected(
                msg.rid, 400, "priority needs a server started with --scheduling-policy priority", "priority"
            )
        if rejection is not None:
            return rejection
        sampling = msg.sampling
        if sampling.seed is None:
            sampling.seed = self._seeds.getrandbits(63)
        max_tokens = self.max_model_len - len(prompt)
        if sampling.max_tokens is not None:
            max_tokens = min(max_tokens, sampling.max_tokens)
        elif self.config.default_max_tokens:
            max_tokens = min(max_tokens, self.config.default_max_tokens)
        stop_token_ids = frozenset(sampling.stop_token_ids)
        if not sampling.ignore_eos:
            stop_token_ids |= self.eos_token_ids
        request = Request(
            msg.rid,
            list(prompt),
            sampling,
            max_tokens,
            msg.times,
            stop_token_ids=stop_token_ids,
            priority=msg.priority,
            arrival=self._arrivals,
            cache_salt=msg.cache_salt,
        )
        self.requests[msg.rid] = request
        if sampling.structured is not None:
            request.grammar = self.grammars.cached(sampling.structured)
            if request.grammar is None:
                request.status = RequestStatus.WAITING_FOR_GRAMMAR
                self.grammars.submit(msg.rid, sampling.structured)
                return None
        return self._queue(request)

    def take_grammar_verdicts(self, timeout_s: float = 0.0) -> list[RequestAccepted | RequestRejected]:
        """The verdicts of requests whose grammar came since the last call: queued, or refused (a 400 naming the
        field); and of those that waited past their bound (a 503: grammars.py). timeout_s: wait that long for a
        grammar if none has come (offline.LLM; the server's loop polls grammars.doorbell and grammars.overdue())."""
        verdicts: list[RequestAccepted | RequestRejected] = []
        for rid, grammar in self.grammars.take_ready(timeout_s):
            request = self.requests[rid]
            if isinstance(grammar, GrammarRefused):
                assert request.sampling.structured is not None
                field = request.sampling.structured.field if grammar.status == 400 else None
                verdicts.append(RequestRejected(rid, grammar.status, grammar.message, field))
                request.status = RequestStatus.FINISHED
                del self.requests[rid]
            else:
                request.grammar = grammar
                request.status = RequestStatus.WAITING
                verdicts.append(self._queue(request))
        return verdicts

    def _queue(self, request: Request) -> RequestAccepted:
        request.times.queued = time.time()
        request.arrival = self._arrivals
        self._arrivals += 1
        self.waiting.add(request)
        return RequestAccepted(request.rid, len(request.prompt_ids), request.times)

    def _validate(self, rid: int, prompt: list[int], sampling: SamplingParams) -> RequestRejected | None:
        if rid in self.requests:
            return RequestRejected(rid, 400, f"request id {rid} is already in use")
        if len(prompt) >= self.max_model_len:
            return RequestRejected(
                rid,
                400,
                f"the prompt has {len(prompt)} tokens; this server's context is {self.max_model_len} "
                f"tokens, and at least one must be left to generate",
                "prompt",
            )
        if sampling.max_tokens is not None and len(prompt) + sampling.max_tokens > self.max_model_len:
            return RequestRejected(
                rid,
                400,
                f"max_tokens={sampling.max_tokens} plus the prompt's {len(prompt)} tokens exceeds the "
                f"context length {self.max_model_len}",
                "max_tokens",
            )
        if len(self.waiting) + self.grammars.num_waiting >= self.config.max_waiting_requests:
            return RequestRejected(
                rid,
                503,
                f"the server is at its queue limit ({self.config.max_waiting_requests} waiting requests); retry later",
            )
        return None

    def abort_request(self, rid: int, reason: str = "abort") -> bool:
        """Stop a request now; its blocks are free before the next plan. False if it had already ended."""
        request = self.requests.get(rid)
        if request is None:
            return False
        self._finish(request, reason)
        return True

    def close(self) -> None:
        """Stop the compile worker (offline.LLM's close; a scheduler process's worker dies with it)."""
        self.grammars.close()

    # ------------------------------------------------------------------ the step

    def has_unfinished(self) -> bool:
        return bool(self.requests)

    def snapshot(self) -> SchedulerStats:
        """The counters, with the state as it is now."""
        evictable = self.cache.num_evictable if self.cache is not None else 0
        return replace(
            self.stats,
            num_running=len(self.running),
            num_waiting=len(self.waiting),
            kv_blocks_total=self.blocks.num_blocks,
            kv_blocks_free=self.blocks.num_free,
            kv_blocks_cached=evictable,
            kv_blocks_used=self.blocks.num_blocks - self.blocks.num_free - evictable,
            prefill_budget=self.prefill_budget.tokens,
            num_waiting_for_grammar=self.grammars.num_waiting,
            grammar_vocabulary_ready=int(self.grammars.vocabulary_ready),
            grammar_wait_refusals=self.grammars.wait_refusals,
        )

    def schedule(self, ahead: bool = False) -> StepPlan | None:
        """The next step's plan, or None when nothing can run. ahead: another plan is still in flight (the server's
        loop); such a plan is held back while the batch is only that plan's newcomers (see the module docstring)."""
        if ahead and self._only_newcomers_running():
            return None
        self._retire_last_sampled()
        budget = self.prefill_budget.tokens
        step = _StepDraft(budget=budget, start_budget=budget)
        self._schedule_running(step)
        if not step.preempted:
            self._admit(step)
        plan = self._emit(step)
        if plan is not None and plan.rids:
            self.prefill_budget.planned(plan.step_id, self.stats.last_step_prefill_tokens, time.time())
        return plan

    def _only_newcomers_running(self) -> bool:
        """The running batch has room and holds only requests the latest plan admitted, besides those whose last
        sample is planned already: they leave the batch at the next plan (_retire_last_sampled), so a plan ahead
        would carry nothing of theirs either."""
        newcomers = self._newcomers
        if not newcomers:
            return False
        leaving = {r.rid for r in self._last_sampled} if self._last_sampled else ()
        staying = 0
        for request in self.running:  # oldest first: in a busy batch the first one answers
            if request.rid in leaving:
                continue
            if request.rid not in newcomers:
                return False
            staying += 1
        return 0 < staying < self.max_num_seqs

    def _retire_last_sampled(self) -> None:
        """Running requests whose last sample is planned (max_tokens or the context reached) only wait
        for that token now: they leave the batch, giving their seat and their blocks away. Blocks whose
        tokens are all known go to the prefix cache; the final token is never computed. Done at the start
        of the next plan, not the one that samples it: that plan's forward still writes those blocks."""
        for request in self._last_sampled:
            if request.status is not RequestStatus.RUNNING:
                continue  # its last token arrived already (or it stopped, or was aborted)
            self._free_request_blocks(request)
            self.running.remove(request)
            request.status = RequestStatus.FINISHING
            self.finishing[request.rid] = request
        self._last_sampled = []

    def _schedule_running(self, step: _StepDraft) -> None:
        """Running requests, oldest first: a decode computes its one new token, a prompt being chunked its
        next chunk from the budget. Short of blocks, the newest running requests are preempted."""
        bs = self.block_size
        running_status = RequestStatus.RUNNING
        rids, starts, num_tokens, samples = step.rids, step.starts, step.num_tokens, step.samples
        last_sampled = self._last_sampled
        decodes = 0  # decodes planned by the fast path below
        blocks = self.blocks
        free_blocks = blocks.num_free  # kept in step with the fast path's allocations; the slow path re-reads it
        for request in list(self.running):
            if request.status is not running_status:
                continue  # preempted earlier in this loop to make room
            num_computed = request.num_computed
            prefilling = num_computed < request.num_resume_tokens
            planned = len(request.prompt_ids) + request.num_samples_planned  # request.num_tokens_planned
            grammar = request.grammar
            if prefilling:
                n = min(request.num_resume_tokens - num_computed, step.budget)
                if n == 0:
                    continue
            elif planned == num_computed:
                continue  # its next token is in flight
            elif grammar is not None and request.num_samples_in_flight:
                continue  # its mask needs the token in flight
            elif num_computed < (held := len(request.block_ids) * bs) or (
                num_computed == held and (free_blocks or self._make_free(1))
            ):
                # The common case, kept cheap (one step of every running request passes here): the next
                # token fits in the request's last block, or in a free one, or in one the prefix cache gives up
                # (once the cache holds every block it is the free list: the slow path's insert per filled block
                # cost a burst on a full cache ~20 µs a block). What _reserve_blocks (with nothing to preempt),
                # _plan_chunk and _count_sample do, inline.
                if num_computed == held:
                    new_block = blocks.allocate(1)
                    free_blocks = blocks.num_free
                    request.block_ids += new_block
                    step.new_block_ids[request.rid] = new_block
                rids.append(request.rid)
                starts.append(num_computed)
                num_tokens.append(1)
                samples.append(True)
                if grammar is not None:
                    step.token_bitmasks[request.rid] = grammar.next_bitmask()
                request.num_computed = num_computed = num_computed + 1
                request.num_samples_planned = samples_planned = request.num_samples_planned + 1
                if samples_planned >= request.max_tokens:  # (max_tokens is within the context: add_request)
                    last_sampled.append(request)  # can sample no more
                # The blocks a decode fills go to the prefix cache when the request lets go of them (it finishes
                # or is preempted: _free_request_blocks), all in one insert, not one trie insert per block here.
                decodes += 1
                continue
            else:
                n = 1
            victims = self._reserve_blocks(request, request.num_computed + n)
            step.preempted |= bool(victims)
            if request in victims:
                continue
            self._plan_chunk(step, request, n, worker_has_blocks=len(request.block_ids))
            free_blocks = blocks.num_free  # evictions, preemptions and allocations changed it
            if prefilling:
                step.budget -= n
            else:
                step.decode_tokens += 1
        step.decode_tokens += decodes

    def _emit(self, step: _StepDraft) -> StepPlan | None:
        """The draft as a plan, with the releases since the last one; the step's counters."""
        self.stats.last_step_prefill_tokens = step.start_budget - step.budget
        self.stats.last_step_decode_tokens = step.decode_tokens
        if not step.rids and not self._released:
            return None
        self.stats.steps += bool(step.rids)  # a plan that only releases requests runs no forward
        self.stats.prompt_tokens_computed += self.stats.last_step_prefill_tokens
        self.stats.decode_tokens_computed += step.decode_tokens
        self._step_id += 1
        self._newcomers = {spec.rid for spec in step.new_requests}
        released, self._released = self._released, []
        return StepPlan(
            self._step_id,
            step.new_requests,
            step.rids,
            step.starts,
            step.num_tokens,
            step.samples,
            released,
            step.new_block_ids,
            step.token_bitmasks,
        )

    def _admit(self, step: _StepDraft) -> None:
        """Waiting requests, in their queue's order, into the seats, the per-step admission limit and the budget
        left. The first that cannot be admitted stops admission: order is kept."""
        full_budget = step.start_budget
        free_seats = self.max_num_seqs - len(self.running)
        limit = min(free_seats, self.config.max_prefill_requests or self.max_num_seqs)
        admitted = 0
        while self.waiting and step.budget > 0 and admitted < limit:
            request = self.waiting.first()
            if request.num_samples_in_flight:
                break  # preempted with a sample still on the GPU: resume once it has arrived
            tokens = request.known_token_ids()
            cached: list[int] = []
            cursor = InsertCursor()
            if self.cache is not None and request.sampling.prompt_logprobs is None:
                # (Prompt logprobs need every prompt position computed: no prefix is reused for them.)
                # Leave the last token uncached: it must be computed to sample from it, into a block
                # this request holds alone (shared blocks are never written).
                cached, cursor = self.cache.match(tokens, (len(tokens) - 1) // self.block_size, request.cache_salt)
            num_cached = len(cached) * self.block_size
            n = len(tokens) - num_cached
            if n > step.budget:
                oversized_and_first = n > full_budget and step.budget == full_budget
                if not (self.config.enable_chunked_prefill or oversized_and_first):
                    self._release_blocks(cached)
                    break  # waits for the next step, keeping its place
                n = step.budget
            needed = self.blocks.blocks_for_tokens(num_cached + n) - len(cached)
            if not self._make_free(needed):
                self._release_blocks(cached)
                break
            self.waiting.pop_first()
            request.status = RequestStatus.RUNNING
            request.block_ids = cached
            request.num_computed = num_cached
            request.num_resume_tokens = len(tokens)
            request.num_samples_planned = len(request.output_ids)
            request.cache_cursor = cursor
            if request.num_preemptions == 0:
                request.num_cached_tokens = num_cached
                request.times.first_scheduled = time.time()
                self.stats.cache_hit_tokens += num_cached
                self.stats.prompt_tokens_admitted += len(tokens)
            self._seat(request)
            step.new_requests.append(NewRequestSpec(request.rid, tokens, request.sampling, len(request.output_ids)))
            self._plan_chunk(step, request, n, worker_has_blocks=0)
            step.budget -= n
            admitted += 1

    def _plan_chunk(self, step: _StepDraft, request: Request, n: int, worker_has_blocks: int) -> None:
        """Advance the request by n tokens (room already made) and add it to the step for the worker, whose
        mirror of the block table has its first `worker_has_blocks` entries."""
        needed = self.blocks.blocks_for_tokens(request.num_computed + n)
        request.block_ids.extend(self.blocks.allocate(needed - len(request.block_ids)))
        start = request.num_computed
        request.num_computed += n
        sample = request.num_computed == request.num_tokens_planned
        if sample:
            self._count_sample(request)
        self._cache_computed_blocks(request)
        rid = request.rid
        step.rids.append(rid)
        step.starts.append(start)
        step.num_tokens.append(n)
        step.samples.append(sample)
        if len(request.block_ids) > worker_has_blocks:
            step.new_block_ids[rid] = request.block_ids[worker_has_blocks:]
        if sample and request.grammar is not None:
            step.token_bitmasks[rid] = request.grammar.next_bitmask()

    def _count_sample(self, request: Request) -> None:
        request.num_samples_planned += 1
        if not request.can_sample_more():
            self._last_sampled.append(request)

    def _cache_computed_blocks(self, request: Request) -> None:
        """Offer the prefix cache every newly completed block whose tokens are all known."""
        if self.cache is None or request.cache_cursor.stopped:
            return
        known = len(request.prompt_ids) + len(request.output_ids)
        full = min(request.num_computed, known) // self.block_size
        if full > request.cache_cursor.next_block:
            start = request.cache_cursor.resume_position(self.block_size)
            tokens = request.token_span(start, full * self.block_size)
            self.cache.insert(tokens, request.block_ids, request.cache_cursor, start, request.cache_salt)

    # ------------------------------------------------------------------ blocks

    def _seat(self, request: Request) -> None:
        """Into the running batch, which is kept in admission order, or under the priority policy in (priority,
        arrival) order: planned most urgent first, preempted least urgent first."""
        if self.waiting.by_priority:
            bisect.insort(self.running, request, key=priority_key)
        else:
            self.running.append(request)

    def _reserve_blocks(self, request: Request, num_tokens: int) -> list[Request]:
        """Make room for `request` to reach num_tokens, preempting the last running requests (the newest; under
        the priority policy the least urgent) until there is, perhaps `request` itself, last. Returns the
        requests preempted. The running requests before `request` are planned already and never touched."""
        needed = self.blocks.blocks_for_tokens(num_tokens) - len(request.block_ids)
        victims: list[Request] = []
        while not self._make_free(needed):
            victim = self.running[-1]
            self._preempt(victim)
            victims.append(victim)
            if victim is request:
                break
        return victims

    def top_up_free_blocks(self) -> int:
        """Free the prefix cache's least recently used blocks until there is one free block per running request
        (the most a step of decodes takes); returns how many were freed. The server's loop calls it once a plan
        is sent and the tokens are streamed, while the device runs: on a full cache every block a step takes is
        first evicted (a trie removal and a heap pop, microseconds each), and done here that work is off the
        chain from a step's result to the next plan. The cache only gives up, a step early, what the step's
        blocks would have evicted anyway, in the same order."""
        return self._evict_until_free(len(self.running))

    def _make_free(self, needed: int) -> bool:
        self._evict_until_free(needed)
        return self.blocks.num_free >= needed

    def _evict_until_free(self, needed: int) -> int:
        """The prefix cache's least recently used blocks freed until `needed` are free, or it has none left;
        returns how many it freed."""
        short = needed - self.blocks.num_free
        if short <= 0 or self.cache is None:
            return 0
        return self.cache.evict(short)

    def _release_blocks(self, blocks: list[int]) -> None:
        release = self.cache.release if self.cache is not None else self.blocks.release
        for block in blocks:
            release(block)

    def _free_request_blocks(self, request: Request) -> None:
        self._cache_computed_blocks(request)
        self._release_blocks(request.block_ids)
        request.block_ids = []

    def _preempt(self, request: Request) -> None:
        self._free_request_blocks(request)
        self.running.remove(request)
        request.status = RequestStatus.WAITING
        request.num_computed = 0
        request.cache_cursor = InsertCursor()
        request.num_preemptions += 1
        self.stats.preemptions += 1
        self.waiting.add_preempted(request)
        self._released.append(request.rid)

    def _finish(self, request: Request, reason: str) -> None:
        if request.status is RequestStatus.RUNNING:
            self._free_request_blocks(request)
            self.running.remove(request)
            self._released.append(request.rid)
        elif request.status is RequestStatus.FINISHING:
            del self.finishing[request.rid]
            self._released.append(request.rid)
        elif request.status is RequestStatus.WAITING:
            self.waiting.remove(request)
        elif request.status is RequestStatus.WAITING_FOR_GRAMMAR:
            self.grammars.cancel(request.rid)
        request.status = RequestStatus.FINISHED
        request.finish_reason = reason
        del self.requests[request.rid]

    # ------------------------------------------------------------------ results

    def process_result(self, result: StepResult) -> TokenBatch:
        """The step's tokens appended to their requests; the batch of them to stream (those of requests that
        ended meanwhile left out), with the requests they finish."""
        self.prefill_budget.on_result(result.step_id, result.sampled_time)
        for item in result.prompt_logprobs:
            request = self.requests.get(item.rid)
            if request is None:
                continue
            if request.prompt_logprobs is None:
                request.prompt_logprobs = item.logprobs
            else:
                request.prompt_logprobs.extend(item.logprobs)
        held, rids, tokens = self._live_entries(result)
        batch = TokenBatch(result.sampled_time, rids, tokens)
        finished = batch.finish_reasons
        for request, token in zip(held, tokens):
            output_ids = request.output_ids
            output_ids.append(token)
            # Its finish reason: a stop token (EOS among them unless ignored: add_request), else max_tokens (within the
            # context).
            if token in request.stop_token_ids:
                reason: str | None = "stop"
            elif len(output_ids) >= request.max_tokens:
                reason = "length"
            else:
                reason = None
            if request.grammar is not None and (not request.grammar.accept(token) or request.grammar.terminated):
                reason = "stop"  # the grammar is complete (and EOS sampled), or (never, under its mask) broken
            if not request.first_tokens_sent:
                batch.firsts.append(self._first_tokens(request))
            if reason is not None:
                finished[request.rid] = reason
                self._finish(request, reason)
        if result.logprobs:
            kept = set(rids)
            batch.logprobs = [item for item in result.logprobs if item.rid in kept]
        self.stats.generated_tokens += len(rids)
        return batch

    def _live_entries(self, result: StepResult) -> tuple[list[Request], list[int], list[int]]:
        """The result's requests that are still alive, with their rids and tokens: the result's own columns, unless
        some finished while the step ran (their extra tokens are discarded). Columns, not an append per token."""
        requests = self.requests
        held = [requests.get(rid) for rid in result.rids]
        if all(held):  # (a Request is always true)
            return cast(list[Request], held), result.rids, result.token_ids
        alive = [request is not None for request in held]
        rids, tokens = list(compress(result.rids, alive)), list(compress(result.token_ids, alive))
        return cast(list[Request], list(compress(held, alive))), rids, tokens

    def _first_tokens(self, request: Request) -> FirstTokens:
        """What the request's first sampled token carries, once."""
        request.first_tokens_sent = True
        prompt_logprobs = None
        if request.sampling.prompt_logprobs is not None:
            prompt_logprobs = self._whole_prompt_logprobs(request)
        return FirstTokens(request.rid, request.times.first_scheduled, request.num_cached_tokens, prompt_logprobs)

    @staticmethod
    def _whole_prompt_logprobs(request: Request) -> Logprobs:
        """Every prompt position: the first token has no logprob (NaN, null in the API), then the worker's."""
        whole = Logprobs(0, request.prompt_ids[:1], [math.nan], [[]], [[]])
        if request.prompt_logprobs is not None:
            whole.extend(request.prompt_logprobs)
        return whole

    # ------------------------------------------------------------------ checks

    def check_integrity(self) -> None:
        """free + evictable + in use == total, and every block's count equals its holders; a running request
        with no sample left to plan is about to retire."""
        self.blocks.check_integrity()
        holders = [0] * self.blocks.num_blocks
        for request in self.running:
            for block in request.block_ids:
                holders[block] += 1
        for request in [*self.waiting, *self.finishing.values()]:
            assert not request.block_ids, f"{request.status.value} request {request.rid} holds blocks"
        for request in self.running:
            if not request.is_prefilling and not request.can_sample_more():
                assert request in self._last_sampled, f"request {request.rid} runs with no sample left to plan"
        evictable = 0
        if self.cache is not None:
            self.cache.check_integrity()
            for block in self.cache.node_of_block:
                holders[block] += 1
            evictable = self.cache.num_evictable
        assert holders == self.blocks.ref_counts, "reference counts differ from holders"
        in_use = sum(1 for c in self.blocks.ref_counts if c > 0) - evictable
        assert self.blocks.num_free + evictable + in_use == self.blocks.num_blocks
