"""benchmarks.step_inputs times the worker's host parts of a decode step and a mixed one."""

from __future__ import annotations

from benchmarks.step_inputs import main


def test_each_host_part_of_a_decode_step_and_a_mixed_step_is_timed():
    summary = main(["--decodes", "8", "--prompts", "2", "--prompt-len", "20", "--repeats", "5"])
    assert set(summary["decode"]) == {"plan", "update", "inputs"}
    assert set(summary["mixed"]) == {"plan", "update", "inputs", "graph"}
    assert all(seconds > 0 for times in summary.values() for seconds in times.values())
