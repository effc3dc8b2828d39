"""How the server's processes share the machine's cores between their compute threads.

Left alone, torch sizes its thread pool in every process that imports it as if that process had the machine to
itself: with tensor-parallel ranks or several replicas on a CPU, each GPU worker's forward asked for every
core while the others did too, and threads that wait on each other's cores at every parallel op slow a CPU
forward down (tests/conftest.py gives each process 1 for that reason). Instead the launcher gives each process
its share, decided here once:

    GPU workers (a CPU forward's matrix products)  the cores split between them, at least 1 each
    tokenizer workers, schedulers, HTTP frontends  1 (their work is Python; torch, where imported, only idles)

The share reaches a child as OMP_NUM_THREADS in its environment at spawn (torch reads it as it is imported,
before any parallel op). An OMP_NUM_THREADS the launcher itself was given wins for every process: the user's
own choice (the test suite sets 1).
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager

THREADS_VARIABLE = "OMP_NUM_THREADS"
HOST_PROCESS_THREADS = 1


def machine_cores() -> int:
    """The cores this process may run on (a container's or taskset's limit, not the host's count)."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def gpu_worker_threads(total: int, gpu_workers: int) -> int:
    """Each GPU worker's share of `total` cores (every replica's every tensor-parallel rank: `gpu_workers`)."""
    return max(1, total // gpu_workers)


@contextmanager
def spawned_with_threads(threads: int) -> Iterator[None]:
    """Children spawned inside this block start with `threads` compute threads, unless the launcher was given
    OMP_NUM_THREADS itself (then that)."""
    if THREADS_VARIABLE in os.environ:
        yield
        return
    os.environ[THREADS_VARIABLE] = str(threads)
    try:
        yield
    finally:
        del os.environ[THREADS_VARIABLE]
