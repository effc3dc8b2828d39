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
