"""A server process's own CPU seconds, read from /proc, for the serving benchmark's cost per token.

    cpu = process_cpu_s(pid, role)      # user + system seconds of every thread since it started; None if unknown

/stats' `busy_s` is wall time around each loop's work: on a machine with fewer free cores than processes it counts
the time a process waited for a core too, so it grows with the machine's load. The kernel's count does not: CPU
seconds per delivered token stay about the same whatever else runs, which is what lets a 2-core machine say
what each process would cost on a 16-core one.
"""

from __future__ import annotations

import os

from common.process import PROCESS_NAME_BYTES

CLOCK_TICKS_PER_S = os.sysconf("SC_CLK_TCK")


def process_cpu_s(pid: int, role: str) -> float | None:
    """User + system CPU seconds of process `pid`, or None where it is not this machine's process of that role
    (a server elsewhere: its pids mean nothing here; every child names itself after its role, common/process.py)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            stat = f.read()
    except OSError:
        return None
    # "pid (comm) state ppid ...": comm may hold spaces and parentheses, so split after its last ")".
    comm = stat[stat.index("(") + 1 : stat.rindex(")")]
    if comm != role[:PROCESS_NAME_BYTES]:
        return None
    fields = stat[stat.rindex(")") + 2 :].split()
    utime, stime = int(fields[11]), int(fields[12])  # fields 14 and 15 of proc(5), counted from "state" (3)
    return (utime + stime) / CLOCK_TICKS_PER_S
