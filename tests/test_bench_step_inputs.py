"""benchmarks.step_inputs times the worker's input building for a decode step and a mixed one."""

from __future__ import annotations

from benchmarks.step_inputs import main


def test_a_decode_step_and_a_mixed_step_are_timed():
    summary = main(["--decodes", "8", "--prompts", "2", "--prompt-len", "20", "--repeats", "5"])
    assert set(summary) == {"decode", "mixed"}
    assert all(seconds > 0 for seconds in summary.values())
