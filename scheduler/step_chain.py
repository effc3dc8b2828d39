"""Where a step's time goes between two processes: the chain from one step's tokens to the next plan's launch.

At PIPELINE_DEPTH 2 the worker launches plan N+2 only once the scheduler has seen step N's tokens, so while
step N+1 runs on the device this chain must complete, or the device waits:

    worker: step N sampled ──result_transit──▶ scheduler: result in ──scheduler──▶ plan N+2 sent
        ──plan_transit──▶ worker: plan taken ──worker_launch──▶ step N+2 on the device

    result_transit   the worker's send, the socket, the scheduler waking (or busy streaming the last tokens)
    scheduler        process the results, queue new requests, plan, encode, send
    plan_transit     the socket, and the worker busy finishing a step when the plan arrives
    worker_launch    the worker's host work for a launch (inputs, forward launch, sampling launch)

Clocks: time.time() in both processes (one host). The scheduler keeps running sums and counts (`chain_*` in
its `/stats`), so any two snapshots give the means between them (benchmarks/serve.py prints them).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from common.messages import StepResult


@dataclass(slots=True)
class StepChain:
    results: int = 0  # results received (each gives a result_transit, a plan_transit and a worker_launch)
    result_transit_s: float = 0.0
    plan_transit_s: float = 0.0
    worker_launch_s: float = 0.0
    plans: int = 0  # plans sent in reply to results (each gives a scheduler time)
    scheduler_s: float = 0.0

    def on_result(self, result: StepResult, received: float) -> None:
        self.results += 1
        self.result_transit_s += max(0.0, received - result.sampled_time)
        self.plan_transit_s += result.timings.plan_wait_s
        self.worker_launch_s += result.timings.prepare_s + result.timings.forward_s

    def on_reply_plan(self, first_result_received: float, sent: float) -> None:
        """A plan sent in the wake-up that received results, the first of them at `first_result_received`."""
        self.plans += 1
        self.scheduler_s += max(0.0, sent - first_result_received)

    def to_payload(self) -> dict[str, float]:
        return {f"chain_{key}": value for key, value in asdict(self).items()}
