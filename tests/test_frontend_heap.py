"""A frontend's heap keeps what large request bodies freed (frontend/heap.py): in a fresh interpreter, as a
frontend process sets it."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

BURSTS = """
import json, resource, sys
from frontend.heap import keep_freed_heap
kept = keep_freed_heap()
def burst():  # eight 16 MiB bodies at once, each written whole, then freed
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    bodies = [b"x" * (16 * 2**20) for _ in range(8)]
    del bodies
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
print(json.dumps({"kept": kept, "first": burst(), "second": burst()}))
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc is what frontend/heap.py sets")
def test_a_second_burst_of_large_bodies_reuses_the_memory_the_first_freed():
    faults = json.loads(subprocess.run([sys.executable, "-c", BURSTS], capture_output=True, check=True).stdout)
    if not faults["kept"]:
        pytest.skip("this interpreter's C library is not glibc: its malloc keeps its own policy")
    pages = 8 * 16 * 2**20 // 4096
    assert faults["first"] >= pages // 2  # the memory was new to the process: its pages faulted in
    assert faults["second"] < pages // 20  # the freed memory was kept: almost no page faulted again
