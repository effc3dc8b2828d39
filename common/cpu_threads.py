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

Idle compute threads sleep (OMP_WAIT_POLICY=PASSIVE), where OpenMP's default has them spin after every parallel
op: a CPU forward's second thread then holds its core through the Python between ops, and the frontend, the
tokenizer workers and the scheduler, which share those cores, wait for it. On the 2-core CPU with other work
running (load average 6-7), the tiny Llama's lone prompt took 187-262 ms to its first token through the server
spinning and 9-16 ms sleeping, 32 prompts at once 950-1,390 ms against 73-132 ms (benchmarks/arrivals.py; the
offline engine's 31-token prefill 147-199 ms against 8-10). A policy the launcher was given wins, as the count does.

But not at once: sleeping right after every op, a thread is woken for the next one a few microseconds of Python
later, hundreds of times a token. They spin SHORT_SPIN turns first (GOMP_SPINCOUNT, GNU OpenMP's, which the torch
wheels bring; a fraction of a millisecond), enough to bridge the gaps between one forward's ops, then sleep. The
default SmolLM2 through the server on the 2-core CPU, alternated 6x (one request of 128 tokens / 16 at once):
13.5-14.7 / 99-121 tok/s sleeping at once, 15.0-16.9 / 110-146 spinning 10,000 turns first (Hugging Face's
generate in one process, 15.1-15.4 alone); 30,000 turns gave the burst back (123). Only a GPU worker whose
forward runs on the CPU spins (forward_on_cpu): one whose forward runs on a GPU enters few parallel regions, and
its many threads spinning after each would take the cores the serving processes use. A spin count the launcher
was given wins, and none is set under a policy it was given (GNU OpenMP would cap an ACTIVE one's spinning).
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager

THREADS_VARIABLE = "OMP_NUM_THREADS"
HOST_PROCESS_THREADS = 1
WAIT_POLICY_VARIABLE = "OMP_WAIT_POLICY"
IDLE_THREADS_SLEEP = "PASSIVE"
SPIN_COUNT_VARIABLE = "GOMP_SPINCOUNT"
SHORT_SPIN = "10000"  # turns an idle thread spins before it sleeps (see above)


def machine_cores() -> int:
    """The cores this process may run on (a container's or taskset's limit, not the host's count)."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def gpu_worker_threads(total: int, gpu_workers: int) -> int:
    """Each GPU worker's share of `total` cores (every replica's every tensor-parallel rank: `gpu_workers`)."""
    return max(1, total // gpu_workers)


def forward_on_cpu(device: str) -> bool:
    """Whether a GPU worker given --device `device` computes its forward on the CPU, decided without importing torch:
    "cpu", or "auto" on a machine with no NVIDIA device (where "auto" could still mean CPU, e.g. every GPU hidden,
    the answer is False: its threads sleep at once, as before the short spin)."""
    return device == "cpu" or (device == "auto" and not os.path.exists("/dev/nvidiactl"))


@contextmanager
def spawned_with_threads(threads: int, short_spin: bool = False) -> Iterator[None]:
    """Children spawned inside this block start with `threads` compute threads whose idle ones sleep (with
    `short_spin`, after spinning SHORT_SPIN turns: a GPU worker whose forward runs on the CPU), unless the launcher
    was given OMP_NUM_THREADS, OMP_WAIT_POLICY or GOMP_SPINCOUNT itself (then that one, as given; under its own
    policy no spin count is set)."""
    ours = {THREADS_VARIABLE: str(threads), WAIT_POLICY_VARIABLE: IDLE_THREADS_SLEEP}
    if short_spin and WAIT_POLICY_VARIABLE not in os.environ:
        ours[SPIN_COUNT_VARIABLE] = SHORT_SPIN
    ours = {name: value for name, value in ours.items() if name not in os.environ}
    os.environ.update(ours)
    try:
        yield
    finally:
        for name in ours:
            del os.environ[name]
