"""StepQueue: the launch-then-finish loop the worker process and LLM.generate share."""

from __future__ import annotations

import pytest

from common.messages import StepPlan, StepResult, StepTimings
from common.pipeline import PIPELINE_DEPTH
from gpu_worker.step_queue import StepQueue


class FakeRunner:
    """Records launches and finishes; a launched step is its plan's id."""

    def __init__(self, launches_async: bool):
        self.launches_async = launches_async
        self.events: list[str] = []

    def launch(self, plan: StepPlan):
        self.events.append(f"launch {plan.step_id}")
        return plan

    @staticmethod
    def is_done(plan: StepPlan) -> bool:
        return True

    def finish(self, plan: StepPlan) -> StepResult:
        self.events.append(f"finish {plan.step_id}")
        return StepResult(plan.step_id, [], [], 0.0, StepTimings())


def plan(step_id: int) -> StepPlan:
    return StepPlan.of(step_id, [], [], [])


def test_an_async_runner_launches_the_next_step_before_finishing_the_previous_one():
    runner = FakeRunner(launches_async=True)
    steps = StepQueue(runner)
    assert steps.depth == PIPELINE_DEPTH
    for step_id in range(1, PIPELINE_DEPTH):
        assert steps.launch(plan(step_id)) == []
    assert [r.step_id for r in steps.launch(plan(PIPELINE_DEPTH))] == [1]
    assert steps.oldest_step_id == 2 and len(steps) == PIPELINE_DEPTH - 1
    while steps:
        steps.finish_oldest()
    launches = [f"launch {i}" for i in range(1, PIPELINE_DEPTH + 1)]
    assert runner.events == launches + [f"finish {i}" for i in range(1, PIPELINE_DEPTH + 1)]


def test_a_synchronous_runner_finishes_each_step_at_once():
    steps = StepQueue(FakeRunner(launches_async=False))
    assert [r.step_id for r in steps.launch(plan(1))] == [1]
    assert not steps and steps.oldest_step_id is None


def test_a_depth_beyond_the_pipeline_is_refused():
    with pytest.raises(ValueError, match="PIPELINE_DEPTH"):
        StepQueue(FakeRunner(launches_async=True), depth=PIPELINE_DEPTH + 1)
