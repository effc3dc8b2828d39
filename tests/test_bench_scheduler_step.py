"""benchmarks.scheduler_step times every part of the scheduler's loop, and the parts add up to the step."""

from __future__ import annotations

import gc

from benchmarks.scheduler_step import PARTS, main


def test_each_part_of_a_scheduler_step_is_timed_and_the_parts_make_the_step():
    try:
        summary = main(["--requests", "8", "--steps", "60", "--prompt-len", "20"])
    finally:
        gc.unfreeze()  # the benchmark freezes its heap, as the scheduler process does
    assert set(summary) == {*PARTS, "total"}
    assert all(summary[part] > 0 for part in PARTS)
    assert summary["total"] >= max(summary[part] for part in PARTS)


def test_bursts_of_requests_that_come_and_go_are_timed_each():
    try:
        summary = main(["--bursts", "2", "--requests", "6", "--max-num-seqs", "4", "--num-blocks", "160"])
    finally:
        gc.unfreeze()
    assert list(summary) == ["burst 1", "burst 1 chain", "burst 2", "burst 2 chain"]
    assert all(0 < summary[f"burst {b} chain"] < summary[f"burst {b}"] for b in (1, 2))


def test_requests_arriving_over_time_arrive_finish_and_each_part_of_their_steps_is_timed():
    try:
        summary = main(["--arrival-rate", "800", "--step-ms", "4", "--warmup-steps", "20", "--steps", "100"])
    finally:
        gc.unfreeze()
    assert summary["arrived"] > 0 and summary["finished"] > 0
    assert all(summary[part] > 0 for part in PARTS)
    assert 0 < summary["results to plans p50"] <= summary["results to plans p99"]
