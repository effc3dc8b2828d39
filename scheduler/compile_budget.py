"""A grammar compile's share of the machine: the cycles that serving leaves idle, and at most
--grammar-compile-timeout seconds of them.

    priority    the compile worker process and the scheduler's compile thread run under SCHED_IDLE (Linux; where it
                cannot be had, nice 19): a core is theirs only while no serving thread wants it, and a serving thread
                that wakes takes it back at once. Threads and processes they start inherit it (xgrammar's compile
                threads, the worker spawned by the thread).
    timeout     counted in the worker's CPU time since the grammar was handed over (per compile thread), not in wall
                time: a compile starved by serving is not refused for being starved, only for needing more work than
                the timeout allows; the time a request waits for the vocabulary, or behind other grammars, is in
                nobody's CPU count
    wait bound  WAIT_BOUND_FACTOR times the timeout, in wall time from the request's arrival at the scheduler: its
                whole wait for its grammar (the vocabulary, the grammars ahead of it, its compile) ends there, refused
                as the server's fault (503, retry later), not the grammar's (grammars.py keeps it). A compile that
                gets no CPU (a machine busy throughout) thus keeps nobody waiting past it; one that nobody waits for
                any more is given up for the next grammar wanted (compile_queue.py)

Why SCHED_IDLE (measured beside a running stream on two cores, CPU engine; docs/notes/benchmark-history.md,
"Grammars beside a running stream"): the CPU engine's forward runs two torch threads that wait on each other at
every parallel op, so a compile holding a core for one time slice stalls the step, however low its nice value: a
nice-10 compile left one ~700 ms gap (29x the median) during the 8,000-choice compile. A SCHED_IDLE thread runs only
where no normal thread wants the core (bar a 0.3 % share), and is preempted on that thread's wake-up, not at the end
of its slice. (Its own figure is for a quiet host: on a shared one, other processes' load hides a compile's stall.)
Nice 19 is not that: a smaller share (1.5 % of a nice-0 thread's weight), but still taken in slices while the torch
threads want the core.
The price: on a machine busy throughout, a compile waits, as its request does; hence the timeout in CPU time.

Priority inversion: a lock that the loop also takes, held by the compile thread when a serving thread preempts it,
holds the loop until the compile thread runs again, at the latest once the engine has run the plans it holds and a
core idles (a step or two). The thread holds the GIL only between xgrammar's calls (which release it),
microseconds at a time, and glibc's heap locks while it trims the heap after a large grammar (compile_worker.py).
"""

from __future__ import annotations

import os
import sys
import threading
import time
from dataclasses import dataclass, field

# A request may wait for its grammar this many times --grammar-compile-timeout in wall time from its arrival, CPU or
# not: 100 s at the default. Beside a stream on a 2-core machine that other sessions kept busy (load average 5-9),
# the 8,000 choices' trial (2.5 s of CPU) took 86 s on idle cycles: on a machine that busy, the grammars that need
# more than about a third of the timeout get the 503, and so do requests queued behind them. (A client waiting
# 300 s, as the soak's, hears the 503 in time to retry rather than giving up unanswered.)
WAIT_BOUND_FACTOR = 10
FALLBACK_NICENESS = 19  # where SCHED_IDLE is not to be had: the lowest nice value
_CLOCK_TICKS = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


# CLEARSERVE_GRAMMAR_COMPILE_PRIORITY=normal keeps compiles at the serving processes' priority: for a host busy
# throughout by design (a test suite on two cores, a CPU engine that is never idle), where idle cycles never come
# and every request would wait for its bound. Inherited by the processes the launcher spawns.
PRIORITY_ENV = "CLEARSERVE_GRAMMAR_COMPILE_PRIORITY"


def yield_to_serving(whole_process: bool = False) -> str:
    """Put the calling thread (with whole_process, outside Linux: the process) below every serving thread; what it
    starts from now on inherits that. Returns what was done, for the log."""
    if os.environ.get(PRIORITY_ENV, "idle") == "normal":
        return f"normal priority ({PRIORITY_ENV}=normal)"
    try:
        os.sched_setscheduler(threading.get_native_id(), os.SCHED_IDLE, os.sched_param(0))  # (Linux: one thread)
        return "SCHED_IDLE"
    except (AttributeError, OSError):  # not Linux, or not permitted here
        pass
    if sys.platform.startswith("linux"):  # a nice value is a thread's own
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), FALLBACK_NICENESS)
    elif whole_process:  # elsewhere a nice value is the process's: the worker's, never the scheduler's
        os.setpriority(os.PRIO_PROCESS, 0, FALLBACK_NICENESS)
    else:
        return "unchanged"
    return f"nice {FALLBACK_NICENESS}"


def process_cpu_seconds(pid: int) -> float | None:
    """The CPU time (user and system, every thread) of process `pid` so far; None where /proc cannot tell."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as stat:
            fields = stat.read().rsplit(b")", 1)[1].split()  # past the command name, which may hold spaces
    except (OSError, IndexError):
        return None
    return (int(fields[11]) + int(fields[12])) / _CLOCK_TICKS  # utime and stime: the stat's 14th and 15th fields


@dataclass(slots=True)
class CompileDeadline:
    """One compile's clocks in the worker `pid`, from its creation: the worker's CPU time per compile thread (wall
    time where /proc cannot tell) against timeout_s; wall time, for the log (the wait bound is its request's)."""

    pid: int
    timeout_s: float
    threads: int
    wall_started: float = field(default_factory=time.monotonic)
    cpu_started: float | None = None

    def __post_init__(self) -> None:
        self.cpu_started = process_cpu_seconds(self.pid)

    @property
    def wall_s(self) -> float:
        return time.monotonic() - self.wall_started

    @property
    def cpu_s(self) -> float:
        """The compile's CPU seconds per compile thread: about the wall time it takes with its cores to itself."""
        now = process_cpu_seconds(self.pid)
        if now is None or self.cpu_started is None:
            return self.wall_s
        return (now - self.cpu_started) / self.threads

    @property
    def past_timeout(self) -> bool:
        """The compile has had its timeout's CPU: the grammar needs more work than the server allows."""
        return self.cpu_s >= self.timeout_s
