"""What watches the scheduler's loop without taking part in it, hung beside it (process.py): the --profile-steps
window, a marker per plan and per result in the trace, and the step chain's links (step_chain.py).

    result received  before_result   the result's trip; the first of a wake-up starts the scheduler's link
    result processed after_result    its marker; the window counts it
    planning         before_plan     (the plan's marker starts)
    plan made        on_plan         the window opens on the first plan with work
    plan sent        after_plan      the scheduler's link, if it answers this wake-up's results; its marker
    wake-up over     wake_up_done    no later plan answers this wake-up's results
"""

from __future__ import annotations

import time

import zmq

from common.messages import ControlRequest, StepPlan, StepResult
from common.profiling import ProcessProfiler, epoch_us
from common.transport import Endpoints, push_socket, send
from scheduler.scheduler import Scheduler
from scheduler.step_chain import StepChain


class ProfileWindow:
    """--profile-steps N: every process profiles the first N steps with work, then stops by itself.

    The scheduler counts steps, so it coordinates:
    - the GPU worker: the window's first plan carries `profile_steps=N`; the worker starts its profiler before
      that step and stops after the N-th (it counts plans, which run in order, one step each: exactly the
      window's steps, whatever the overlap);
    - the scheduler itself: starts with that first plan, stops once the N-th step's result is processed;
    - tokenizer workers and the frontends: start_profile / stop_profile on their control sockets at those
      two moments (their loops have no steps: their window is the same span of time). Nobody waits for
      their answers (reply_to ""); the profilers log where the traces went.
    One window per run: the next steps are not profiled.
    """

    def __init__(self, steps: int, profiler: ProcessProfiler, endpoints: Endpoints, others: list[str]):
        self.steps = steps
        self.profiler = profiler
        ctx: zmq.Context = zmq.Context.instance()
        self.others = [push_socket(ctx, endpoints.control(role)) for role in others]
        self.results_left: int | None = None  # None: not opened yet; 0: closed

    def on_plan(self, plan: StepPlan) -> None:
        if self.results_left is not None:
            return
        # No plan was sent before this one (it is the first step with work), so none is in flight: the next
        # `steps` results are exactly the window's steps.
        self.results_left = self.steps
        plan.profile_steps = self.steps
        self.profiler.start()
        self._tell_others("start_profile")

    def on_result(self) -> None:
        if not self.results_left:
            return
        self.results_left -= 1
        if self.results_left == 0:
            self.profiler.stop()
            self._tell_others("stop_profile")

    def _tell_others(self, kind: str) -> None:
        for sock in self.others:
            send(sock, ControlRequest(kind))


class SchedulerObserver:
    def __init__(self, scheduler: Scheduler, profiler: ProcessProfiler, window: ProfileWindow | None):
        self.scheduler = scheduler
        self.profiler = profiler
        self.window = window
        self.chain = StepChain()
        self._first_result_received: float | None = None  # in this wake-up, answered by its first plan
        self._started = 0.0  # the current plan's or result's marker start (epoch_us)

    def stats(self) -> dict[str, float]:
        return self.chain.to_payload()

    def before_result(self, result: StepResult) -> None:
        received = time.time()
        self.chain.on_result(result, received)
        if self._first_result_received is None:
            self._first_result_received = received
        self._started = epoch_us()

    def after_result(self, result: StepResult) -> None:
        if self.profiler.active:
            args = {"step_id": result.step_id, "sampled": len(result.token_ids)}
            self.profiler.mark(f"result {result.step_id}", self._started, args)
        if self.window is not None:
            self.window.on_result()

    def before_plan(self) -> None:
        self._started = epoch_us()

    def on_plan(self, plan: StepPlan) -> None:
        if self.window is not None:
            self.window.on_plan(plan)

    def after_plan(self, plan: StepPlan) -> None:
        if self._first_result_received is not None:
            self.chain.on_reply_plan(self._first_result_received, plan.sent_time)
            self._first_result_received = None
        self._mark_plan(plan)

    def wake_up_done(self) -> None:
        self._first_result_received = None

    def _mark_plan(self, plan: StepPlan) -> None:
        """The step's marker in the trace: what it computes, for whom (the GPU worker's has the same step id)."""
        if not self.profiler.active:
            return  # a plan's work is microseconds: no marker arguments built for nobody
        s = self.scheduler.stats
        args = {
            "step_id": plan.step_id,
            "prefill_tokens": s.last_step_prefill_tokens,
            "decode_tokens": s.last_step_decode_tokens,
            "admitted": len(plan.new_requests),
            "rids": plan.rids,
        }
        self.profiler.mark(f"plan {plan.step_id}", self._started, args)
