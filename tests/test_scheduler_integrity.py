"""Randomized: any sequence of admissions, steps, finishes, aborts and evictions keeps the block
accounting exact (free + evictable + in use == total; reference counts equal holders)."""

from __future__ import annotations

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from common.config import EngineConfig
from common.messages import StageTimes, StepPlan, StepResult, StepTimings, TokenizedRequest
from common.model_info import ModelInfo
from common.sampling_params import SamplingParams
from gpu_worker.limits import decide_limits
from scheduler.scheduler import Scheduler

EOS = 0
VOCAB = 6  # a tiny vocabulary: prompts collide, so prefixes are shared and evicted often


class FakeWorker:
    """Samples a token from (rid, output index), EOS now and then; checks each plan is well formed."""

    def __init__(self):
        self.known: dict[int, int] = {}  # rid -> tokens the worker knows

    def execute(self, plan: StepPlan) -> StepResult:
        for rid in plan.released:
            self.known.pop(rid, None)
        for spec in plan.new_requests:
            self.known[spec.rid] = len(spec.token_ids)
        rids, tokens = [], []
        for chunk in plan.chunks:
            assert chunk.start + chunk.num_tokens <= self.known[chunk.rid], "computes a token it does not know"
            if chunk.sample:
                self.known[chunk.rid] += 1
                rids.append(chunk.rid)
                tokens.append((chunk.rid * 7 + self.known[chunk.rid]) % VOCAB)
        return StepResult(plan.step_id, rids, tokens, 0.0, StepTimings())


operations = st.lists(
    st.one_of(
        st.tuples(st.just("add"), st.lists(st.integers(1, VOCAB - 1), min_size=1, max_size=40), st.integers(1, 24)),
        st.tuples(st.just("step"), st.integers(1, 3)),
        st.tuples(st.just("abort"), st.integers(0, 30)),
    ),
    min_size=1,
    max_size=60,
)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    ops=operations,
    block_size=st.sampled_from([1, 2, 4]),
    num_blocks=st.integers(12, 40),
    budget=st.integers(1, 24),
    chunked=st.booleans(),
    overlap=st.booleans(),
)
def test_block_accounting_stays_exact(ops, block_size, num_blocks, budget, chunked, overlap):
    config = EngineConfig(
        block_size=block_size, max_num_seqs=4, max_num_batched_tokens=budget, enable_chunked_prefill=chunked
    )
    info = ModelInfo("llama", 64, [EOS], VOCAB)
    scheduler = Scheduler(config, info, decide_limits(config, info, on_gpu=False, num_kv_blocks=num_blocks))
    worker = FakeWorker()
    in_flight: list[StepResult] = []  # with overlap, a plan is made before the previous result is read
    next_rid = 0

    def step():
        plan = scheduler.schedule()
        scheduler.check_integrity()
        if plan is not None:
            in_flight.append(worker.execute(plan))
        while in_flight and (len(in_flight) > int(overlap) or plan is None):
            scheduler.process_result(in_flight.pop(0))
            scheduler.check_integrity()

    for op in ops:
        if op[0] == "add":
            scheduler.add_request(TokenizedRequest(next_rid, op[1], SamplingParams(max_tokens=op[2]), StageTimes()))
            next_rid += 1
        elif op[0] == "step":
            for _ in range(op[1]):
                step()
        else:
            scheduler.abort_request(op[1])
        scheduler.check_integrity()
    for _ in range(2000):  # everything finishes: no deadlock
        if not scheduler.has_unfinished() and not in_flight:
            break
        step()
    assert not scheduler.has_unfinished()
    cached = scheduler.cache.num_evictable if scheduler.cache else 0
    assert scheduler.blocks.num_free + cached == num_blocks, "every block is free or evictable at the end"


def test_on_a_full_prefix_cache_a_decode_takes_the_least_recently_used_leaf_and_preempts_nothing():
    """Once finished requests' blocks fill the cache, the free list is empty: a decode that fills its block
    takes the cache's least recently used evictable block, a leaf, and the running batch is left alone."""
    config = EngineConfig(block_size=2, max_num_seqs=2, max_num_batched_tokens=64)
    info = ModelInfo("llama", 64, [EOS], VOCAB)
    scheduler = Scheduler(config, info, decide_limits(config, info, on_gpu=False, num_kv_blocks=12))
    worker = FakeWorker()

    def serve(rid: int, prompt: list[int], max_tokens: int) -> None:
        sampling = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
        scheduler.add_request(TokenizedRequest(rid, prompt, sampling, StageTimes()))
        while scheduler.has_unfinished():
            plan = scheduler.schedule()
            assert plan is not None
            scheduler.process_result(worker.execute(plan))
            scheduler.check_integrity()

    older, newer = [1, 2, 3, 4, 5, 1, 2, 3], [5, 4, 3, 2]
    serve(0, older, 1)  # leaves 4 full blocks in the cache
    serve(1, newer, 1)  # and 2 more, used after them
    assert scheduler.blocks.num_free == 6 and scheduler.cache.num_evictable == 6
    serve(2, [3] * 12, 3)  # its prompt takes the 6 free blocks; its decode needs a 7th
    assert scheduler.stats.preemptions == 0
    assert len(scheduler.cache.match(older, 4)[0]) == 3, "the older chain lost its leaf, and only that"
    assert len(scheduler.cache.match(newer, 2)[0]) == 2, "the newer chain is whole"


def test_between_steps_the_cache_frees_a_block_per_running_request_least_recently_used_first():
    """top_up_free_blocks (the server's loop, once a plan is sent): a step's worth of free blocks, so the next
    plan's decodes evict nothing; the cache gives up its least recently used blocks, and no more than that."""
    config = EngineConfig(block_size=2, max_num_seqs=2, max_num_batched_tokens=64)
    info = ModelInfo("llama", 64, [EOS], VOCAB)
    scheduler = Scheduler(config, info, decide_limits(config, info, on_gpu=False, num_kv_blocks=12))
    worker = FakeWorker()
    older, newer = [1, 2, 3, 4, 5, 1, 2, 3], [5, 4, 3, 2]
    for rid, prompt in enumerate((older, newer)):  # 4 + 2 full blocks left in the cache
        scheduler.add_request(TokenizedRequest(rid, prompt, SamplingParams(max_tokens=1), StageTimes()))
        while scheduler.has_unfinished():
            scheduler.process_result(worker.execute(scheduler.schedule()))
    scheduler.add_request(TokenizedRequest(2, [3] * 12, SamplingParams(max_tokens=3, ignore_eos=True), StageTimes()))
    scheduler.process_result(worker.execute(scheduler.schedule()))  # its prompt took the 6 free blocks
    assert scheduler.blocks.num_free == 0 and len(scheduler.running) == 1
    assert scheduler.top_up_free_blocks() == 1
    assert scheduler.top_up_free_blocks() == 0, "one free block per running request, no more"
    assert scheduler.blocks.num_free == 1
    assert len(scheduler.cache.match(older, 4)[0]) == 3, "the older chain's leaf went"
    assert len(scheduler.cache.match(newer, 2)[0]) == 2
