"""One trace of every process, for Perfetto: the frontend answering /stop_profile merges the traces each
process wrote (common/profiling.py: all on one clock, Unix epoch µs) into one timeline.

    merge_traces({role: (pid, path)}, out_path)

Each process keeps its own lane (Chrome trace "pid"), named after its role. A trace can hold lanes that are
not a process of ours (torch.profiler puts a GPU's kernels under the device's number): those get a fresh
lane id, named "{role}: {their name}", so two processes' GPU lanes never merge.
"""

from __future__ import annotations

import itertools
import json

FIRST_EXTRA_LANE = 1 << 22  # above Linux's largest pid (pid_max is at most 2^22)


def merge_traces(traces: dict[str, tuple[int, str]], out_path: str) -> str:
    """`traces`: each process's pid and trace file, by role."""
    events: list[dict] = []
    extra_lanes = itertools.count(FIRST_EXTRA_LANE)
    for sort_index, (role, (pid, path)) in enumerate(sorted(traces.items())):
        with open(path) as f:
            trace = json.load(f)
        events += _relaned(role, pid, trace["traceEvents"], extra_lanes, sort_index)
    with open(out_path, "w") as f:
        json.dump({"traceEvents": events, "displayTimeUnit": "ms"}, f)
    return out_path


def _relaned(role: str, own_pid: int, events: list[dict], extra_lanes: itertools.count, sort_index: int) -> list[dict]:
    """The trace's events with their pids made unique across the merged trace, and every lane named."""
    names = {e["pid"]: e["args"]["name"] for e in events if e.get("ph") == "M" and e.get("name") == "process_name"}
    lanes: dict[object, int] = {}
    out = []
    for event in events:
        if event.get("ph") == "M" and event.get("name") in ("process_name", "process_sort_index"):
            continue  # renamed and reordered below
        if "pid" in event:
            pid = event["pid"]
            if pid not in lanes:
                lanes[pid] = pid if pid == own_pid else next(extra_lanes)
            event = {**event, "pid": lanes[pid]}
        out.append(event)
    for pid, lane in lanes.items():
        name = role if pid == own_pid else f"{role}: {names.get(pid, pid)}"
        out.append({"ph": "M", "name": "process_name", "pid": lane, "tid": 0, "args": {"name": name}})
        out.append({"ph": "M", "name": "process_sort_index", "pid": lane, "tid": 0, "args": {"sort_index": sort_index}})
    return out
