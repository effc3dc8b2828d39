"""Launched steps not finished yet, oldest first: the one loop both the worker process and `LLM.generate`
run, so that the device never waits for the host between steps.

    launch(N+1) ─▶ finish(N) ─▶ launch(N+2) ─▶ finish(N+1) ...      (depth 2: one step queued behind another)

The depth is PIPELINE_DEPTH where launching returns before the step is computed (CUDA), 1 otherwise (on a
CPU, launching computes everything: holding a step back would only delay its tokens).
"""

from __future__ import annotations

from collections import deque
from typing import TYPE_CHECKING

from common.messages import StepPlan, StepResult
from common.pipeline import PIPELINE_DEPTH

if TYPE_CHECKING:
    from gpu_worker.model_runner import LaunchedStep, ModelRunner


class StepQueue:
    def __init__(self, runner: ModelRunner, depth: int | None = None):
        if depth is None:
            depth = PIPELINE_DEPTH if runner.launches_async else 1
        if not 1 <= depth <= PIPELINE_DEPTH:
            raise ValueError(f"depth {depth}: the host rings hold PIPELINE_DEPTH={PIPELINE_DEPTH} steps in flight")
        self.runner = runner
        self.depth = depth
        self._steps: deque[LaunchedStep] = deque()

    def __len__(self) -> int:
        return len(self._steps)

    @property
    def oldest_step_id(self) -> int | None:
        return self._steps[0].step_id if self._steps else None

    def has_room(self) -> bool:
        return len(self._steps) < self.depth

    def launch(self, plan: StepPlan) -> list[StepResult]:
        """Launch `plan`, then finish the oldest steps until fewer than `depth` are left unfinished (the
        previous step, for depth 2); their results, oldest first."""
        self._steps.append(self.runner.launch(plan))
        results = []
        while len(self._steps) >= self.depth:
            results.append(self.finish_oldest())
        return results

    def oldest_is_done(self) -> bool:
        """Whether the oldest step's results are on the host: finishing it would not wait."""
        return self.runner.is_done(self._steps[0])

    def finish_oldest(self) -> StepResult:
        return self.runner.finish(self._steps.popleft())
