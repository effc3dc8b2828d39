"""Scheduling features never change outputs, and do what they promise: prefix reuse computes only
what is new, one admission round is one forward, the prompt budget and chunking bound each step,
and preemption under a tiny KV pool still finishes every request with the same tokens."""

from __future__ import annotations

import pytest

from common.config import EngineConfig
from common.messages import StageTimes, StepPlan, StepResult, StepTimings, TokenizedRequest
from common.model_info import ModelInfo
from common.sampling_params import SamplingParams
from gpu_worker.limits import decide_limits
from offline import LLM
from scheduler.scheduler import Scheduler
from tests.tiny_models import random_prompts

GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)


def make_llm(folder, **args) -> LLM:
    llm = LLM(str(folder), device="cpu", dtype="float32", **args)
    llm.record_plans = True
    return llm


def run(llm: LLM, prompts, params=GREEDY) -> list[list[int]]:
    return [o.token_ids for o in llm.generate(prompts, params, on_step=llm.scheduler.check_integrity)]


def test_one_admission_round_of_hits_misses_and_duplicates_is_one_forward(tiny_llama):
    llm = make_llm(tiny_llama, block_size=16)
    shared, other, dup = random_prompts(3, [40, 37, 50], vocab=512, seed=3)
    run(llm, [shared])  # warms the cache with `shared`
    llm.plans_executed.clear()
    hit = shared + [7, 8, 9]
    outs = run(llm, [hit, other, dup, dup])
    first = llm.plans_executed[0]
    computed = {c.rid: c.num_tokens for c in first.chunks}
    assert len(first.chunks) == 4, "every admitted request is in the first forward"
    assert all(len(p.new_requests) == 0 for p in llm.plans_executed[1:]), "no later prefill"
    rids = [s.rid for s in first.new_requests]
    assert computed[rids[0]] == len(hit) - 32, "the hit computes only its uncached suffix"
    assert computed[rids[1]] == len(other)
    assert computed[rids[2]] == len(dup)
    assert computed[rids[3]] == len(dup) - 48, "the duplicate shares the first copy's full blocks"
    assert outs[2] == outs[3]
    assert outs == run(make_llm(tiny_llama, block_size=16, enable_prefix_caching=False), [hit, other, dup, dup])


def test_prompt_plus_one_token_computes_exactly_one_token(tiny_llama):
    llm = make_llm(tiny_llama, block_size=16)
    [prompt] = random_prompts(1, [64], vocab=512, seed=4)
    run(llm, [prompt], SamplingParams(max_tokens=1, temperature=0.0))
    llm.plans_executed.clear()
    run(llm, [prompt + [5]], SamplingParams(max_tokens=1, temperature=0.0))
    assert [c.num_tokens for c in llm.plans_executed[0].chunks] == [1]
    assert llm.scheduler.stats.cache_hit_tokens == 64


def test_fully_cached_prompt_still_computes_its_last_token(tiny_llama):
    llm = make_llm(tiny_llama, block_size=16)
    [prompt] = random_prompts(1, [48], vocab=512, seed=5)
    first = run(llm, [prompt])
    llm.plans_executed.clear()
    assert run(llm, [prompt]) == first
    assert [c.num_tokens for c in llm.plans_executed[0].chunks] == [16], "the last block is recomputed"


@pytest.mark.parametrize(
    "engine_args",
    [
        {"enable_prefix_caching": False},
        {"max_num_batched_tokens": 8},
        {"max_num_batched_tokens": 8, "enable_chunked_prefill": False},
        {"max_num_batched_tokens": 20, "block_size": 4},
        {"max_prefill_requests": 1},
        {"max_num_seqs": 2},
        {"max_num_seqs": 2, "scheduling_policy": "priority"},
        {"max_num_batched_tokens": "auto"},
    ],
)
def test_scheduling_options_leave_outputs_unchanged(tiny_model, engine_args):
    prompts = random_prompts(6, [3, 17, 40, 9, 25, 61], vocab=512, seed=6)
    prompts.append(prompts[2][:30] + [11, 12])  # shares a prefix with another prompt
    baseline = run(make_llm(tiny_model), prompts)
    assert run(make_llm(tiny_model, **engine_args), prompts) == baseline


def test_a_budget_that_changes_between_steps_leaves_outputs_unchanged(tiny_model):
    # As --max-num-batched-tokens auto resizes it: prompts are chunked at whatever the budget is at each step.
    prompts = random_prompts(6, [3, 17, 40, 9, 25, 61], vocab=512, seed=6)
    baseline = run(make_llm(tiny_model), prompts)
    llm = make_llm(tiny_model)
    sizes = iter([5, 23, 8, 64, 3] * 100)
    llm.scheduler.prefill_budget.tokens = next(sizes)

    def resize() -> None:
        llm.scheduler.check_integrity()
        llm.scheduler.prefill_budget.tokens = next(sizes)

    assert [o.token_ids for o in llm.generate(prompts, GREEDY, on_step=resize)] == baseline
    prefill = [c.num_tokens for p in llm.plans_executed for c in p.chunks if c.num_tokens > 1]
    assert len(prefill) > len(prompts), "some prompts were chunked"


def test_prompt_budget_bounds_every_step_and_keeps_fifo_order(tiny_llama):
    llm = make_llm(tiny_llama, max_num_batched_tokens=16, enable_prefix_caching=False)
    prompts = random_prompts(5, [10, 10, 30, 4, 4], vocab=512, seed=7)
    run(llm, prompts)
    admitted = [s.rid for p in llm.plans_executed for s in p.new_requests]
    assert admitted == sorted(admitted), "requests are admitted in arrival order"
    for plan in llm.plans_executed:
        new = {s.rid for s in plan.new_requests}
        prompt_tokens = sum(c.num_tokens for c in plan.chunks if c.num_tokens > 1 or c.rid in new)
        assert prompt_tokens <= 16


def test_without_chunking_a_request_that_overflows_waits_for_the_next_step(tiny_llama):
    llm = make_llm(tiny_llama, max_num_batched_tokens=16, enable_chunked_prefill=False, enable_prefix_caching=False)
    prompts = random_prompts(2, [10, 10], vocab=512, seed=8)
    run(llm, prompts)
    first, second = llm.plans_executed[0], llm.plans_executed[1]
    assert [c.num_tokens for c in first.chunks] == [10]
    assert [s.rid for s in second.new_requests] == [1] and 10 in [c.num_tokens for c in second.chunks]


def test_an_oversized_first_request_is_chunked_even_without_chunking(tiny_llama):
    llm = make_llm(tiny_llama, max_num_batched_tokens=16, enable_chunked_prefill=False, enable_prefix_caching=False)
    [prompt] = random_prompts(1, [40], vocab=512, seed=9)
    out = run(llm, [prompt])
    assert [c.num_tokens for c in llm.plans_executed[0].chunks] == [16]
    assert out == run(make_llm(tiny_llama), [prompt])


def test_chunked_prefill_lets_running_requests_decode_meanwhile(tiny_llama):
    llm = make_llm(tiny_llama, max_num_batched_tokens=8, enable_prefix_caching=False)
    short, long = random_prompts(2, [4, 60], vocab=512, seed=10)
    run(llm, [short, long], SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True))
    long_chunks = [p for p in llm.plans_executed if any(c.rid == 1 and c.num_tokens > 1 for c in p.chunks)]
    assert len(long_chunks) >= 7, "the long prompt is spread over many steps"
    assert all(any(c.rid == 0 for c in p.chunks) for p in long_chunks[1:]), "the short one decodes in each"


def test_preemption_under_a_tiny_kv_pool_gives_the_same_outputs(tiny_model):
    prompts = random_prompts(6, [20, 33, 7, 41, 15, 28], vocab=512, seed=11)
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    baseline = run(make_llm(tiny_model, block_size=4), prompts, params)
    tight = make_llm(tiny_model, block_size=4, num_kv_blocks=20)
    assert run(tight, prompts, params) == baseline
    assert tight.scheduler.stats.preemptions > 0


def test_seeded_sampling_survives_preemption_and_batching(tiny_llama):
    prompts = random_prompts(5, [20, 33, 7, 41, 15], vocab=512, seed=12)
    params = [
        SamplingParams(max_tokens=20, temperature=0.9, top_p=0.9, top_k=50, seed=100 + i, ignore_eos=True)
        for i in range(len(prompts))
    ]
    alone = [run(make_llm(tiny_llama), [p], [sp])[0] for p, sp in zip(prompts, params)]
    assert run(make_llm(tiny_llama, block_size=4, num_kv_blocks=24), prompts, params) == alone


def test_a_request_that_can_never_fit_is_rejected_clearly(tiny_llama):
    from common.sampling_params import InvalidParameter

    llm = make_llm(tiny_llama, block_size=4, num_kv_blocks=8)
    with pytest.raises(InvalidParameter, match="context length 32"):
        llm.add_request(list(range(1, 21)), SamplingParams(max_tokens=20))


def test_a_request_whose_last_token_is_in_flight_hands_its_seat_over_at_once():
    # Two plans in flight, as the server runs: plan 2 is made before plan 1's tokens are back. Request 0
    # reaches max_tokens in plan 1, so plan 2 can already give its seat to request 1.
    config, info = EngineConfig(block_size=4, max_num_seqs=1), ModelInfo("llama", 64, [0], 16)
    scheduler = Scheduler(config, info, decide_limits(config, info, on_gpu=False, num_kv_blocks=16))
    for rid, max_tokens in ((0, 1), (1, 4)):
        scheduler.add_request(TokenizedRequest(rid, [3, 4, 5], SamplingParams(max_tokens=max_tokens), StageTimes()))
    first, second = scheduler.schedule(), scheduler.schedule()
    assert [s.rid for s in first.new_requests] == [0]
    assert [s.rid for s in second.new_requests] == [1], "the seat is not left idle for a step"
    assert [c.rid for c in second.chunks] == [1], "request 0 computes nothing more"
    assert len(scheduler.finishing) == 1 and len(scheduler.running) == 1, (
        "request 0 only waits for its last token; request 1 holds the one seat"
    )
    scheduler.check_integrity()


def arrivals_scheduler(max_num_seqs: int = 64) -> Scheduler:
    config, info = EngineConfig(block_size=4, max_num_seqs=max_num_seqs), ModelInfo("llama", 256, [0], 64)
    return Scheduler(config, info, decide_limits(config, info, on_gpu=False, num_kv_blocks=512))


def arrive(scheduler: Scheduler, rids, max_tokens: int = 8) -> None:
    for rid in rids:
        prompt = [3 + rid % 50, 4, 5, 6, 7]
        scheduler.add_request(TokenizedRequest(rid, prompt, SamplingParams(max_tokens=max_tokens), StageTimes()))


def result_of(plan: StepPlan) -> StepResult:
    sampled = [c.rid for c in plan.chunks if c.sample]
    return StepResult(plan.step_id, sampled, [9] * len(sampled), 0.0, StepTimings())


def test_prompts_arriving_while_the_first_prefills_are_all_in_the_next_plan():
    # As the server's loop runs (two plans in flight at most): one prompt arrives at an idle engine and is
    # planned at once; 32 more arrive while its plan is in flight. They are all prefilled in the next plan,
    # not behind a plan made ahead with only the first prompt's decode in it.
    scheduler = arrivals_scheduler()
    arrive(scheduler, [0])
    first = scheduler.schedule()
    assert scheduler.schedule(ahead=True) is None, "nothing is planned ahead for the first prompt alone"
    arrive(scheduler, range(1, 33))
    assert scheduler.schedule(ahead=True) is None, "the arrivals wait for the plan in flight, together"
    scheduler.process_result(result_of(first))
    second = scheduler.schedule()
    assert sorted(s.rid for s in second.new_requests) == list(range(1, 33))
    assert sorted(c.rid for c in second.chunks) == list(range(33)), "the first prompt decodes beside them"
    scheduler.check_integrity()


def test_prompts_waiting_together_that_fit_the_budget_are_all_in_one_prefill_plan():
    scheduler = arrivals_scheduler()
    arrive(scheduler, range(32))
    plan = scheduler.schedule()
    assert sorted(s.rid for s in plan.new_requests) == list(range(32))
    assert all(c.sample for c in plan.chunks), "every prompt is computed whole and samples its first token"
    assert not scheduler.waiting


def test_arrivals_while_the_last_requests_finish_are_in_the_next_plan_not_two_later():
    # Request 0 (two tokens) samples its last token in the plan that prefills 1-4; 5-8 arrive while that plan is
    # in flight. Request 0 leaves the batch at the next plan, so a plan made ahead would only decode 1-4, and 5-8
    # would wait behind it: it is held, and 5-8 are prefilled in the next plan, beside 1-4's first decodes.
    scheduler = arrivals_scheduler()
    arrive(scheduler, [0], max_tokens=2)
    scheduler.process_result(result_of(scheduler.schedule()))
    arrive(scheduler, range(1, 5))
    second = scheduler.schedule()
    assert sorted(c.rid for c in second.chunks) == [0, 1, 2, 3, 4]
    assert scheduler.schedule(ahead=True) is None, "nothing but 1-4's first decodes would go ahead"
    arrive(scheduler, range(5, 9))
    scheduler.process_result(result_of(second))
    third = scheduler.schedule()
    assert sorted(s.rid for s in third.new_requests) == [5, 6, 7, 8]
    assert sorted(c.rid for c in third.chunks) == list(range(1, 9)), "request 0 is done, 1-4 decode beside them"
    scheduler.check_integrity()


def test_a_batch_with_older_requests_is_planned_ahead_with_the_arrivals_in_it():
    # Pipelining is kept once the engine is busy: the plan ahead decodes the older requests and admits
    # whatever has arrived.
    scheduler = arrivals_scheduler()
    arrive(scheduler, [0])
    scheduler.process_result(result_of(scheduler.schedule()))
    in_flight = scheduler.schedule()  # request 0's first decode
    arrive(scheduler, [1, 2])
    ahead = scheduler.schedule(ahead=True)
    assert ahead is not None and [s.rid for s in ahead.new_requests] == [1, 2]
    assert in_flight is not None
    scheduler.check_integrity()


def test_a_full_batch_of_newcomers_is_planned_ahead():
    # No seat is left for an arrival to take: holding the plan back would only idle the worker.
    scheduler = arrivals_scheduler(max_num_seqs=4)
    arrive(scheduler, range(4))
    scheduler.schedule()
    ahead = scheduler.schedule(ahead=True)
    assert ahead is not None and sorted(c.rid for c in ahead.chunks) == [0, 1, 2, 3]


def test_two_plans_in_flight_hand_seats_over_and_leave_outputs_unchanged(tiny_model):
    # As the server runs: each plan is made before the previous one's tokens are read. The first four
    # requests reach max_tokens in the same step, so the next plan seats the other four while the worker
    # still holds the first four: eight live requests on a decode batch of four.
    prompts = random_prompts(8, [5, 30, 9, 14, 3, 22, 11, 7], vocab=512, seed=13)
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    baseline = run(make_llm(tiny_model), prompts, params)
    overlapped = make_llm(tiny_model, max_num_seqs=4)
    overlapped.plans_in_flight = 2
    assert run(overlapped, prompts, params) == baseline
    admissions = [len(p.new_requests) for p in overlapped.plans_executed if p.new_requests]
    assert admissions == [4, 4], "the second four are seated in one plan, as the first four finish"


def test_preemption_with_two_plans_in_flight_gives_the_same_outputs(tiny_model):
    # Requests finishing while the next plan is made give their blocks back at once; the tiny pool makes
    # the scheduler preempt around them.
    prompts = random_prompts(6, [20, 33, 7, 41, 15, 28], vocab=512, seed=14)
    params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in (24, 6, 24, 9, 24, 24)]
    baseline = run(make_llm(tiny_model, block_size=4), prompts, params)
    tight = make_llm(tiny_model, block_size=4, num_kv_blocks=20)
    tight.plans_in_flight = 2
    assert run(tight, prompts, params) == baseline
    assert tight.scheduler.stats.preemptions > 0


@pytest.mark.parametrize(("default_max_tokens", "expected"), [(None, 48 - 3), (0, 48 - 3), (10, 10), (100, 48 - 3)])
def test_a_request_without_max_tokens_stops_at_the_server_default_or_the_context(default_max_tokens, expected):
    config = EngineConfig(block_size=4, default_max_tokens=default_max_tokens)
    info = ModelInfo("llama", 48, [0], 64)
    scheduler = Scheduler(config, info, decide_limits(config, info, on_gpu=False, num_kv_blocks=16))
    scheduler.add_request(TokenizedRequest(0, [3, 4, 5], SamplingParams(max_tokens=None), StageTimes()))
    scheduler.add_request(TokenizedRequest(1, [3, 4, 5], SamplingParams(max_tokens=7), StageTimes()))
    assert scheduler.requests[0].max_tokens == expected
    assert scheduler.requests[1].max_tokens == 7, "a request's own max_tokens wins over the default"


# ---------------------------------------------------------------- --scheduling-policy priority


def admission_order(llm: LLM) -> list[int]:
    return [spec.rid for plan in llm.plans_executed for spec in plan.new_requests]


def test_under_the_priority_policy_waiting_requests_are_admitted_most_urgent_first(tiny_llama):
    prompts = random_prompts(4, [9, 7, 11, 8], vocab=512, seed=31)
    short = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
    orders = {}
    for policy in ("fcfs", "priority"):
        llm = make_llm(tiny_llama, max_num_seqs=1, scheduling_policy=policy)
        priorities = [2, 0, 1, 0] if policy == "priority" else None
        outs = llm.generate(prompts, short, priority=priorities, on_step=llm.scheduler.check_integrity)
        rids = sorted(spec.rid for plan in llm.plans_executed for spec in plan.new_requests)
        orders[policy] = [rids.index(rid) for rid in admission_order(llm)], [o.token_ids for o in outs]
    assert orders["fcfs"][0] == [0, 1, 2, 3]
    assert orders["priority"][0] == [1, 3, 2, 0]  # lower first; arrival order between the two 0s
    assert orders["priority"][1] == orders["fcfs"][1], "each request's tokens are its own whatever the order"


def test_short_of_blocks_the_least_urgent_running_request_is_preempted(tiny_llama, monkeypatch):
    # Two requests run together until the pool runs short: the first to arrive is the less urgent one.
    prompts = random_prompts(2, [8, 8], vocab=512, seed=32)
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    baseline = run(make_llm(tiny_llama, block_size=4), prompts, params)
    first_victims = {}
    for policy, priorities in (("fcfs", None), ("priority", [5, 0])):
        llm = make_llm(tiny_llama, block_size=4, num_kv_blocks=12, max_num_seqs=2, scheduling_policy=policy)
        victims: list[int] = []
        preempt = llm.scheduler._preempt

        def recording(request, preempt=preempt, victims=victims):
            victims.append(request.arrival)
            preempt(request)

        monkeypatch.setattr(llm.scheduler, "_preempt", recording)
        outs = llm.generate(prompts, params, priority=priorities, on_step=llm.scheduler.check_integrity)
        assert [o.token_ids for o in outs] == baseline
        first_victims[policy] = victims[0]
    assert first_victims == {"fcfs": 1, "priority": 0}  # the newest, or the less urgent (the older one)


def test_priority_without_the_priority_policy_is_refused_naming_it(tiny_llama):
    from common.sampling_params import InvalidParameter

    llm = make_llm(tiny_llama)
    with pytest.raises(InvalidParameter) as refused:
        llm.add_request([5, 6, 7], GREEDY, priority=1)
    assert refused.value.field == "priority"
    assert llm.add_request([5, 6, 7], GREEDY, priority=0) >= 0
