"""--max-num-batched-tokens auto: the prompt-token budget sized from step times to keep a step within the ITL target."""

from __future__ import annotations

import random

from scheduler.prefill_budget import FLOOR, WINDOW, PrefillBudget

FIXED_S, PER_TOKEN_S = 0.002, 20e-6  # a step: 2 ms, plus 20 µs per prompt token


def run_back_to_back(budget: PrefillBudget, prompt_tokens: list[int], fixed_s: float = FIXED_S, start: float = 100.0):
    """Steps the worker ran back to back: each planned before the previous one's tokens were read."""
    now = start
    budget.on_result(0, now)
    for step_id, tokens in enumerate(prompt_tokens, start=1):
        budget.planned(step_id, tokens, now - 0.001)
        now += fixed_s + PER_TOKEN_S * tokens
        budget.on_result(step_id, now)


def test_the_budget_keeps_a_step_within_the_target():
    budget = PrefillBudget(ceiling=16384, target_s=0.050)
    assert budget.tokens == 16384, "the ceiling until steps have been measured"
    run_back_to_back(budget, [0, 100, 500, 2000] * WINDOW)
    assert abs(budget.tokens - (0.050 - FIXED_S) / PER_TOKEN_S) <= 1  # 2,400 tokens: 2 ms + 48 ms


def test_the_budget_stays_within_the_floor_and_the_ceiling():
    tight = PrefillBudget(ceiling=16384, target_s=0.001)  # decodes alone take longer than the target
    run_back_to_back(tight, [0, 100, 500, 2000] * WINDOW)
    assert tight.tokens == FLOOR
    loose = PrefillBudget(ceiling=1024, target_s=1.0)
    run_back_to_back(loose, [0, 100, 500, 2000] * WINDOW)
    assert loose.tokens == 1024


def test_a_step_the_worker_waited_for_is_not_measured():
    budget = PrefillBudget(ceiling=16384, target_s=0.050)
    budget.on_result(0, 100.0)
    budget.planned(1, 500, 100.5)  # planned after step 0's tokens came: the worker was idle meanwhile
    budget.on_result(1, 101.0)
    assert not budget._samples


def test_a_fixed_budget_is_the_ceiling_whatever_the_steps_take():
    budget = PrefillBudget(ceiling=4096)
    run_back_to_back(budget, [0, 100, 500, 2000] * WINDOW)
    assert budget.tokens == 4096


def test_a_backlog_at_the_budget_still_follows_a_growing_decode_batch():
    # Every step takes the whole budget: the slope already known stays, the fixed part is read again.
    budget = PrefillBudget(ceiling=16384, target_s=0.050)
    run_back_to_back(budget, [0, 100, 500, 2000] * WINDOW)
    run_back_to_back(budget, [budget.tokens] * WINDOW, fixed_s=0.012, start=1000.0)  # decodes: 12 ms a step
    # 1,900 tokens keep a step at 50 ms now; the window mixed both regimes for a while, so within 10 %.
    assert abs(budget.tokens - (0.050 - 0.012) / PER_TOKEN_S) <= 190


def test_noisy_steps_leave_room_so_nearly_every_step_meets_the_target():
    """The line predicts a step's mean; the ITL target holds for 99 % of steps when the budget leaves the
    residuals' spread free."""
    rng = random.Random(0)
    noise_s = 0.003
    budget = PrefillBudget(ceiling=16384, target_s=0.050)
    now = 100.0
    budget.on_result(0, now)
    for step_id, tokens in enumerate([0, 100, 500, 2000] * WINDOW, start=1):
        budget.planned(step_id, tokens, now - 0.001)
        now += FIXED_S + PER_TOKEN_S * tokens + rng.gauss(0.0, noise_s)
        budget.on_result(step_id, now)
    at_the_mean = (0.050 - FIXED_S) / PER_TOKEN_S
    assert budget.tokens < at_the_mean - 200, "room left below the budget that puts the mean step at the target"
    steps = [FIXED_S + PER_TOKEN_S * budget.tokens + rng.gauss(0.0, noise_s) for _ in range(20000)]
    late = sum(step > 0.050 for step in steps) / len(steps)
    assert late <= 0.02
