"""Per-process profiling, and the per-process summary every process reports in its stats.

    --profile-dir DIR      POST /start_profile ... POST /stop_profile  ->  DIR/{role}-{pid}-{run}.trace.json per
                           process (run: 1, 2, ... a new file each time), and one merged trace of them all
                           (frontend/trace_merge.py)
    --profile-steps N      the same, opened at the first step with work and closed after N steps (the
                           scheduler coordinates: scheduler/step_observer.py ProfileWindow)

Two kinds of profiler behind one interface, `start(dir, role)` then `stop() -> path`:
- PythonProfiler (frontend, tokenizer workers, scheduler): viztracer, every Python call of every thread as a
  Chrome "X" (complete) event; a ring buffer of MAX_PYTHON_EVENTS, so a long profile keeps its latest
  events and its memory stays bounded.
- TorchProfiler (GPU worker): torch.profiler, CPU operators plus CUDA kernels where there is a GPU.
Both write Chrome trace-event JSON, which Perfetto (ui.perfetto.dev) and chrome://tracing open.

One clock: viztracer counts from the monotonic clock and torch.profiler from its own base; each names its
base in the file (`baseTimeNanoseconds`, Unix epoch). Every trace is rewritten with `ts` in Unix epoch
microseconds, so the processes' traces overlay. Markers (`mark`: a step, with its id and tokens) are taken
with time.time() on the same clock and written on a lane of their own ("steps").
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING

from common.garbage import process_gc_pauses
from common.process import at_child_exit, sigterm_deferred
from common.transport import SocketStats

if TYPE_CHECKING:  # both are imported only where a profiler starts
    import torch.profiler
    from viztracer import VizTracer

log = logging.getLogger(__name__)

# About 100 bytes per event in memory and 150 in the JSON: tens of MB at most per process.
MAX_PYTHON_EVENTS = 200_000
NOT_ENABLED = "the server was started without --profile-dir"
# A lane (Chrome trace "tid") of its own for the markers: they span work whose events come from another clock
# read, and slices on one lane must nest exactly.
MARKER_TID = 0x7FFF_0000


@dataclass(frozen=True, slots=True)
class ProfileConfig:
    dir: str | None = None  # where traces go; None: profiling is off
    steps: int | None = None  # profile this many scheduler steps from the first one with work, then stop


def trace_path(dir: str, role: str, run: int) -> str:
    return os.path.join(dir, f"{role}-{os.getpid()}-{run}.trace.json")


def merged_trace_path(dir: str, run: int) -> str:
    """The merged trace of every process (frontend/trace_merge.py), named after the merging frontend's run."""
    return os.path.join(dir, f"merged-{os.getpid()}-{run}.trace.json")


def epoch_us() -> float:
    return time.time() * 1e6


class Profiler(ABC):
    """One process's profiler. Start and stop it on the thread that runs the process's loop."""

    def __init__(self) -> None:
        self._path: str | None = None
        self.runs = 0  # profiles taken: each one writes a new file
        self._markers: list[dict] = []

    @property
    def active(self) -> bool:
        return self._path is not None

    def start(self, dir: str, role: str) -> None:
        if self.active:
            raise RuntimeError("the profiler is already running")
        os.makedirs(dir, exist_ok=True)
        self.runs += 1
        self._path = trace_path(dir, role, self.runs)
        self._markers = []
        self._start()

    def stop(self) -> str:
        """Stop, write the trace (Unix epoch µs, markers added), and return its path."""
        if self._path is None:
            raise RuntimeError("the profiler is not running")
        path, self._path = self._path, None
        # Written beside its name and renamed when whole: a reader never opens half a trace. A large one takes
        # seconds, and a SIGTERM meanwhile (the server stopping just after --profile-steps' last step) waits.
        partial = path.removesuffix(".json") + ".partial.json"  # viztracer picks its format by the suffix
        with sigterm_deferred():
            # A trace shows what ran, prompts' token ids included: the owner's only (the file exists at 0600
            # before a byte is written; chmod again, as a writer may replace it).
            os.close(os.open(partial, os.O_CREAT | os.O_WRONLY | os.O_TRUNC, 0o600))
            self._stop_and_write(partial)
            with open(partial) as f:
                trace = json.load(f)
            to_epoch_us(trace, self._base_us(trace))
            trace["traceEvents"] += self._marker_events()
            with open(partial, "w") as f:
                json.dump(trace, f)
            os.chmod(partial, 0o600)
            os.replace(partial, path)
        return path

    def mark(self, name: str, started_us: float, args: dict) -> None:
        """A complete event from `started_us` (epoch_us()) to now on the markers' lane, while profiling."""
        if self.active:
            now = epoch_us()
            self._markers.append({"ph": "X", "name": name, "ts": started_us, "dur": now - started_us, "args": args})

    def _marker_events(self) -> list[dict]:
        pid = os.getpid()
        lane = {"ph": "M", "name": "thread_name", "pid": pid, "tid": MARKER_TID, "args": {"name": "steps"}}
        return [lane] + [{**m, "pid": pid, "tid": MARKER_TID, "cat": "marker"} for m in self._markers]

    @abstractmethod
    def _start(self) -> None: ...

    @abstractmethod
    def _stop_and_write(self, path: str) -> None: ...

    @abstractmethod
    def _base_us(self, trace: dict) -> float:
        """Unix epoch µs of the trace's ts 0."""


def to_epoch_us(trace: dict, base_us: float) -> None:
    """Shift every event of `trace` by `base_us`, and drop the base fields (a reader must not add them again)."""
    for event in trace["traceEvents"]:
        if "ts" in event:
            event["ts"] = float(event["ts"]) + base_us
    trace.pop("baseTimeNanoseconds", None)
    trace.get("viztracer_metadata", {}).pop("baseTimeNanoseconds", None)


class PythonProfiler(Profiler):
    def __init__(self, max_events: int = MAX_PYTHON_EVENTS) -> None:
        super().__init__()
        self.max_events = max_events
        self._tracer: VizTracer | None = None

    def _start(self) -> None:
        from viztracer import VizTracer

        # file_info=False: no copy of every traced source file in the trace; register_global=False: this
        # tracer is ours, not a process-wide singleton other code might pick up.
        self._tracer = VizTracer(tracer_entries=self.max_events, verbose=0, file_info=False, register_global=False)
        self._tracer.start()

    def _stop_and_write(self, path: str) -> None:
        assert self._tracer is not None, "stopped without a start"
        self._tracer.stop()
        self._tracer.save(path)
        self._tracer = None  # frees the ring buffer

    def _base_us(self, trace: dict) -> float:
        return trace["viztracer_metadata"]["baseTimeNanoseconds"] / 1e3


class TorchProfiler(Profiler):
    def __init__(self) -> None:
        super().__init__()
        self._profile: torch.profiler.profile | None = None

    def _start(self) -> None:
        import torch
        from torch.profiler import ProfilerActivity, profile

        activities = [ProfilerActivity.CPU]
        if torch.cuda.is_available():
            activities.append(ProfilerActivity.CUDA)
        self._profile = profile(activities=activities)
        self._profile.start()

    def _stop_and_write(self, path: str) -> None:
        assert self._profile is not None, "stopped without a start"
        self._profile.stop()
        self._profile.export_chrome_trace(path)
        self._profile = None

    def _base_us(self, trace: dict) -> float:
        return trace["baseTimeNanoseconds"] / 1e3


class ProcessProfiler:
    """A process's answers to start_profile / stop_profile, from its control socket or --profile-steps:
    the reply payload is {"started": True}, {"trace": path}, or {"error": why, "status": HTTP status} (400: not
    enabled; 409: already / not profiling)."""

    def __init__(self, config: ProfileConfig, role: str, kind: type[Profiler] = PythonProfiler):
        self.config = config
        self.role = role
        self.profiler = kind()
        # A window still open when the process ends (the server stopped before its stop command came) is
        # written then: the profile asked for is not lost.
        at_child_exit(self._write_if_open)

    def _write_if_open(self) -> None:
        if self.profiler.active:
            log.info("profile written at exit to %s", self.profiler.stop())

    def start(self) -> dict:
        if self.config.dir is None:
            return {"error": NOT_ENABLED, "status": 400}
        if self.profiler.active:
            return {"error": f"{self.role} is already profiling", "status": 409}
        self.profiler.start(self.config.dir, self.role)
        log.info("profiling started")
        return {"started": True}

    def stop(self) -> dict:
        if not self.profiler.active:
            return {"error": f"{self.role} is not profiling", "status": 409}
        path = self.profiler.stop()
        log.info("profile written to %s", path)
        return {"trace": path}

    @property
    def active(self) -> bool:
        return self.profiler.active

    def mark(self, name: str, started_us: float, args: dict) -> None:
        self.profiler.mark(name, started_us, args)

    def answer(self, kind: str) -> dict:
        """The reply to a control command queued for the main thread."""
        if kind == "start_profile":
            return self.start()
        if kind == "stop_profile":
            return self.stop()
        return {"error": f"{self.role} does not support '{kind}'", "status": 400}


# ---------------------------------------------------------------- the per-process summary


class ProcessStats:
    """Busy vs idle time and socket traffic: the keys every process's stats share.

    busy: handling messages or computing, measured around the loop's work; idle: the rest of the time since
    the process started serving, i.e. waiting on a socket. Control traffic is not counted in the sockets:
    asking for stats should not change them.
    """

    def __init__(self) -> None:
        self.sockets = SocketStats()
        self.busy_s = 0.0
        self.gc = process_gc_pauses()
        self._started = time.perf_counter()

    @contextmanager
    def busy(self) -> Iterator[None]:
        started = time.perf_counter()
        try:
            yield
        finally:
            self.busy_s += time.perf_counter() - started

    def _busy_s(self) -> float:
        return self.busy_s

    def summary(self) -> dict:
        uptime = time.perf_counter() - self._started
        busy = min(self._busy_s(), uptime)
        return {
            "uptime_s": uptime,
            "busy_s": busy,
            "idle_s": uptime - busy,
            "busy_pct": round(100 * busy / uptime, 1) if uptime > 0 else 0.0,
            **dataclasses.asdict(self.sockets),
            **self.gc.summary(),
        }


class EventLoopStats(ProcessStats):
    """For an asyncio process, whose waiting happens inside the event loop where no hook tells it apart
    from work: busy is the CPU time of the loop's thread (create this on that thread)."""

    def __init__(self) -> None:
        super().__init__()
        self._clock = time.pthread_getcpuclockid(threading.get_ident())
        self._cpu_started = time.clock_gettime(self._clock)

    def _busy_s(self) -> float:
        return time.clock_gettime(self._clock) - self._cpu_started


def format_summary(stats_by_role: dict[str, dict]) -> str:
    """One line per process, for the launcher's shutdown."""
    lines = ["process summary (busy: handling messages or computing; idle: waiting on a socket)"]
    for role, s in stats_by_role.items():
        lines.append(
            f"  {role:<12} busy {s['busy_pct']:5.1f}% of {s['uptime_s']:7.1f} s   "
            f"messages in {s['messages_in']:>7} out {s['messages_out']:>7}   "
            f"bytes in {_size(s['bytes_in'])} out {_size(s['bytes_out'])}   "
            f"msgpack {s['msgpack_encode_s'] + s['msgpack_decode_s']:6.3f} s   "
            f"gc {s['gc_collections']:>6} pauses, {s['gc_pause_s']:6.3f} s, longest {s['gc_max_pause_ms']:5.1f} ms"
        )
    return "\n".join(lines)


def _size(num_bytes: int) -> str:
    if num_bytes < 1e3:
        return f"{num_bytes:5d} B "
    if num_bytes < 1e6:
        return f"{num_bytes / 1e3:5.1f} kB"
    if num_bytes < 1e9:
        return f"{num_bytes / 1e6:5.1f} MB"
    return f"{num_bytes / 1e9:5.1f} GB"
