"""benchmarks.step_inputs times the worker's host parts of a decode step and a mixed one."""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    # benchmarks.step_inputs imports the Triton attention kernels (the mixed graphs' fill plans their slices): they
    # must load in the interpreter, for this test and every later one in this process (see test_triton_attention).
    os.environ.setdefault("TRITON_INTERPRET", "1")

from benchmarks.step_inputs import main  # noqa: E402


def test_each_host_part_of_a_decode_step_and_a_mixed_step_is_timed():
    summary = main(["--decodes", "8", "--prompts", "2", "--prompt-len", "20", "--repeats", "5"])
    assert set(summary["decode"]) == {"plan", "update", "inputs"}
    assert set(summary["mixed"]) == {"plan", "update", "inputs", "graph"}
    assert all(seconds > 0 for times in summary.values() for seconds in times.values())
