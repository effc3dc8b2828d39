"""What watches LLM.generate's loop without taking part in it (benchmarks/host_steps.py times its host work).

Each pass of the loop plans a step and launches it (with nothing to plan, it finishes the oldest step in flight
instead), then processes the results of the steps it finished; the hooks mark where each part ends:

    started ─ schedule ─▶ planned ─ wire codec ─▶ sent ─ launch (finish) ─▶ ran ─ process results ─▶ ended

`sent` is skipped in a pass that planned nothing. The hooks here do nothing; a subclass overrides those it needs.
"""

from __future__ import annotations

from common.messages import StepPlan, StepResult


class GenerateObserver:
    def started(self) -> None:
        """A pass begins."""

    def planned(self) -> None:
        """The scheduler planned the pass's step (or nothing)."""

    def sent(self) -> None:
        """The plan went through the wire codec, as the worker process receives it."""

    def ran(self) -> None:
        """The step was launched, and the steps it pushed out of flight finished (or the oldest one was)."""

    def ended(self, plan: StepPlan | None, results: list[StepResult]) -> None:
        """The finished steps' results were processed and collected: the pass is over."""
