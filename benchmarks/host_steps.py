"""Where the host's time goes in each pass of LLM.generate's loop, for benchmarks.offline's host figures.

    llm.generate(prompts, params, observer=log)       log = HostStepLog(): one HostStepTimes per pass

A pass plans and launches one step and finishes and processes the one before it (PIPELINE_DEPTH 2), so in a steady
decode both are the same kind of step. Waiting for the device is left out: the rest is what the host costs a
step, which bounds the engine when the device is faster.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass

from common.messages import StepPlan, StepResult
from offline.generate_observer import GenerateObserver

HOST_PARTS = ("schedule", "wire", "prepare", "forward", "finish", "process", "total")  # HostStepTimes' parts


@dataclass(slots=True)
class HostStepTimes:
    """One pass's host time (seconds). The worker's parts are the StepTimings of the steps finished in the pass
    (launched in the one before)."""

    planned_rids: int  # requests in the plan launched
    planned_tokens: int  # tokens it computes (== planned_rids: a decode-only step)
    finished: int  # steps finished in the pass
    schedule_s: float  # Scheduler.schedule
    wire_s: float  # the plan through the wire codec, as the worker process receives it
    prepare_s: float  # worker: mirrors and the batch's inputs (ModelRunner.launch up to the forward)
    forward_s: float  # worker: the forward's launch (graph replay), sampling, the copy to the host queued
    finish_s: float  # worker: tokens read back into the mirrors, the result built (ModelRunner.finish)
    process_s: float  # the result through the codec, Scheduler.process_result, outputs collected
    total_s: float  # the whole pass: these and what falls between them
    wall_s: float  # the whole pass with its waits for the device: in a steady decode, one step's time


class HostStepLog(GenerateObserver):
    def __init__(self) -> None:
        self.passes: list[HostStepTimes] = []
        self._started = self._planned = self._sent = self._ran = 0.0

    def started(self) -> None:
        self._started = time.perf_counter()

    def planned(self) -> None:
        self._planned = self._sent = time.perf_counter()  # a pass that planned nothing sends nothing

    def sent(self) -> None:
        self._sent = time.perf_counter()

    def ran(self) -> None:
        self._ran = time.perf_counter()

    def ended(self, plan: StepPlan | None, results: list[StepResult]) -> None:
        ended = time.perf_counter()
        timings = [r.timings for r in results]
        waited = sum(t.wait_s for t in timings)
        self.passes.append(
            HostStepTimes(
                len(plan.rids) if plan is not None else 0,
                sum(plan.num_tokens) if plan is not None else 0,
                len(results),
                self._planned - self._started,
                self._sent - self._planned,
                sum(t.prepare_s for t in timings),
                sum(t.forward_s for t in timings),
                sum(t.sample_s - t.wait_s for t in timings),
                ended - self._ran,
                ended - self._started - waited,
                ended - self._started,
            )
        )

    def host_ms_per_step(self) -> float:
        """The host's time per step finished, over every pass (all but waiting for the device)."""
        return 1000 * sum(t.total_s for t in self.passes) / max(1, sum(t.finished for t in self.passes))

    def full_decode_host_ms(self) -> dict | None:
        """Medians (ms) of each host part over the passes that ran the fullest decode-only steps (every running
        request one token: the steady state), with their batch size and count."""
        decodes = [t for t in self.passes if t.planned_rids and t.planned_tokens == t.planned_rids]
        if not decodes:
            return None
        batch = max(t.planned_rids for t in decodes)
        full = [t for t in decodes if t.planned_rids == batch]
        parts = {name: 1000 * statistics.median(getattr(t, f"{name}_s") for t in full) for name in HOST_PARTS}
        step_ms = 1000 * statistics.median(t.wall_s for t in full)
        return {"batch": batch, "passes": len(full), **parts, "step_wall": step_ms}
