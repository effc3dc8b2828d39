"""What watches the GPU worker's steps without taking part in them, hung beside its loop (process.py):

    plan received   on_plan         its trip from the scheduler (StepTimings.plan_wait_s: scheduler/step_chain.py)
    launch          before_launch   a --profile-steps window opens on the plan that says so, and counts its plans
                    after_launch    the step's marker in the trace (the launch; on a CPU, the whole step)
    result          on_result       its plan's trip into its timings; the totals in /stats
    result sent     on_sent         the window's last step: the profiler stops (writing the trace delays no one)

The window: the scheduler opens it on a plan (StepPlan.profile_steps); plans run in order, one step each, so
counting launches keeps it on exactly those steps. Its last step is finished before any later one is launched
(ends_window), and the profiler stops there.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass

from common.messages import StepPlan, StepResult
from common.profiling import ProcessProfiler, epoch_us


@dataclass(slots=True)
class StepTotals:
    steps: int = 0
    prepare_s: float = 0.0
    forward_s: float = 0.0
    sample_s: float = 0.0


class StepObserver:
    def __init__(self, profiler: ProcessProfiler):
        self.profiler = profiler
        self.totals = StepTotals()
        self.profile_launches_left = 0
        self.profile_last_step: int | None = None
        self._plan_waits: dict[int, float] = {}  # step id -> its plan's trip
        self._launch_started = 0.0

    def answer(self, kind: str) -> dict:
        """The reply to a control command for the profiler (start_profile, stop_profile)."""
        return self.profiler.answer(kind)

    def stats(self) -> dict:
        return dataclasses.asdict(self.totals)

    def on_plan(self, plan: StepPlan) -> None:
        if plan.sent_time:
            self._plan_waits[plan.step_id] = max(0.0, time.time() - plan.sent_time)

    def ends_window(self, step_id: int | None) -> bool:
        """Whether this step (the oldest in flight) is the profile window's last: it is finished first."""
        return step_id is not None and step_id == self.profile_last_step

    def before_launch(self, plan: StepPlan) -> None:
        if plan.profile_steps:
            self.profiler.start()
            self.profile_launches_left = plan.profile_steps
        if self.profile_launches_left:
            self.profile_launches_left -= 1
            if self.profile_launches_left == 0:
                self.profile_last_step = plan.step_id
        self._launch_started = epoch_us()

    def after_launch(self, plan: StepPlan) -> None:
        """The step's marker in the trace: the scheduler's plan of the same step id says how its tokens split
        into prefill and decode."""
        if not self.profiler.active:
            return
        args = {"step_id": plan.step_id, "tokens": sum(plan.num_tokens), "rids": plan.rids}
        self.profiler.mark(f"step {plan.step_id}", self._launch_started, args)

    def on_result(self, result: StepResult) -> None:
        result.timings.plan_wait_s = self._plan_waits.pop(result.step_id, 0.0)
        totals = self.totals
        totals.steps += 1
        totals.prepare_s += result.timings.prepare_s
        totals.forward_s += result.timings.forward_s
        totals.sample_s += result.timings.sample_s

    def on_sent(self, result: StepResult) -> None:
        if result.step_id == self.profile_last_step:
            self.profile_last_step = None
            self.profiler.stop()
