"""A frontend's heap keeps what large request bodies freed (frontend/heap.py), and the first burst finds it
faulted in already (frontend/process.py: prepare_for_large_bodies): in a fresh interpreter, as a frontend
process sets it."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

BURST = """
import json, resource, sys
def faults():
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt
def burst():  # eight 16 MiB bodies at once, each written whole, then freed
    before = faults()
    bodies = [b"x" * (16 * 2**20) for _ in range(8)]
    del bodies
    return faults() - before
"""
BURSTS = (
    BURST
    + """
from frontend.heap import keep_freed_heap
kept = keep_freed_heap()
print(json.dumps({"kept": kept, "first": burst(), "second": burst()}))
"""
)
STARTED = (
    BURST
    + """
from frontend.heap import keep_freed_heap
from frontend.limits import HttpLimits
from frontend.process import prepare_for_large_bodies
before = faults()
prepare_for_large_bodies(HttpLimits(max_request_body_bytes=16 * 2**20))
at_start = faults() - before
print(json.dumps({"kept": keep_freed_heap(), "at_start": at_start, "first": burst(),
                  "switch_interval": sys.getswitchinterval()}))
"""
)
PAGES = 8 * 16 * 2**20 // 4096


def run_fresh(script: str) -> dict:
    return json.loads(subprocess.run([sys.executable, "-c", script], capture_output=True, check=True).stdout)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc is what frontend/heap.py sets")
def test_a_second_burst_of_large_bodies_reuses_the_memory_the_first_freed():
    faults = run_fresh(BURSTS)
    if not faults["kept"]:
        pytest.skip("this interpreter's C library is not glibc: its malloc keeps its own policy")
    assert faults["first"] >= PAGES // 2  # the memory was new to the process: its pages faulted in
    assert faults["second"] < PAGES // 20  # the freed memory was kept: almost no page faulted again


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc is what frontend/heap.py sets")
def test_the_first_burst_after_a_frontend_starts_finds_its_memory_faulted_in_at_start():
    faults = run_fresh(STARTED)
    if not faults["kept"]:
        pytest.skip("this interpreter's C library is not glibc: its malloc keeps its own policy")
    assert faults["at_start"] >= PAGES  # eight bodies' heap, and more, resident before any body came
    assert faults["first"] < PAGES // 20  # so the first burst faulted almost none in


def test_a_frontend_hands_the_gil_to_its_event_loop_sooner_than_cpythons_default():
    from frontend.body_parse import GIL_SWITCH_INTERVAL_S

    assert run_fresh(STARTED)["switch_interval"] == GIL_SWITCH_INTERVAL_S < 0.005
