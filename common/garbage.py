"""The cyclic garbage collector, kept out of the way of steps and streams, and accounted for.

A process's heap after start-up is mostly modules and the objects they made: ~200,000 in a GPU worker (torch,
transformers), ~65,000 in a frontend (FastAPI, pydantic), ~30,000 in a scheduler. CPython's full collection
traverses all of them, every few hundred steps in a busy loop: ~90 ms in a GPU worker and ~12 ms in a scheduler
on a 2-core CPU (a scheduler loop of 256 decodes over 3,000 steps, a GPU worker's `gc.collect()` after its
imports), each a stall every request in the batch sees as one long inter-token gap. Frozen after start-up
(`gc.freeze`), they are out of the collector's sight for good; a full collection then traverses what requests
left, well under a millisecond in the scheduler.

CPython collects its youngest generation every 700 net allocations of container objects: a served step allocates
that many, so objects that live a few steps (a plan's lists, a request's state) survive a young collection or two,
are promoted and traversed again by every older one. After start-up each process raises that threshold to
YOUNG_THRESHOLD: most of them are gone before the first collection. The scheduler's loop under Poisson arrivals
(`python -m benchmarks.scheduler_step --arrival-rate 800 --step-ms 4 --steps 2000`, this 2-core CPU, alternated):
168 pauses and 278-324 ms of collection per 2,000 steps, one full collection of 31-60 ms among them, against 10
pauses and 22-25 ms, none full; its chain from results to plans mean 0.70-0.82 -> 0.59-0.67 ms, p99 2.6-3.0 ->
1.1-1.9 ms. What cycles hold lives a little longer (at most ~YOUNG_THRESHOLD more objects).

Every process counts its pauses (`GcPauses`, in its control stats): a p99 inter-token latency that a step's
timings do not explain may be a collection, and the stats say whether it was.
"""

from __future__ import annotations

import gc
import time
from dataclasses import dataclass

YOUNG_THRESHOLD = 10_000  # net container allocations between young collections (CPython's default: 700)


def freeze_startup_objects() -> None:
    """Call once, when start-up is over and the loop is about to serve: what is alive now stays alive."""
    gc.collect()
    gc.freeze()
    gc.collect()  # the oldest generation is now empty: CPython's own thresholds count requests' objects only
    gc.set_threshold(YOUNG_THRESHOLD, *gc.get_threshold()[1:])
    pauses = process_gc_pauses()
    pauses.reset()  # start-up's collections (~100-250 ms in a GPU worker) are not serving pauses
    # Counted once: gc.get_freeze_count() walks every frozen object, tens of milliseconds in a GPU worker,
    # holding the GIL (asked for on every /stats, it stalled the worker's steps).
    pauses.frozen_objects = gc.get_freeze_count()


@dataclass(slots=True)
class GcPauseTotals:
    collections: int = 0
    full_collections: int = 0  # of the oldest generation
    pause_s: float = 0.0
    max_pause_ms: float = 0.0


class GcPauses:
    """Times every collection of this process (gc.callbacks): how many, how long in all, the longest. One per
    process: `process_gc_pauses()`."""

    def __init__(self) -> None:
        self.totals = GcPauseTotals()
        self.frozen_objects = 0  # set by freeze_startup_objects
        self._started = 0.0
        gc.callbacks.append(self._on_collection)

    def _on_collection(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._started = time.perf_counter()
            return
        pause = time.perf_counter() - self._started
        t = self.totals
        t.collections += 1
        t.full_collections += info["generation"] == 2
        t.pause_s += pause
        t.max_pause_ms = max(t.max_pause_ms, 1e3 * pause)

    def reset(self) -> None:
        self.totals = GcPauseTotals()

    def summary(self) -> dict:
        t = self.totals
        return {
            "gc_collections": t.collections,
            "gc_full_collections": t.full_collections,
            "gc_pause_s": t.pause_s,
            "gc_max_pause_ms": t.max_pause_ms,
            "gc_frozen_objects": self.frozen_objects,
        }


_PROCESS_PAUSES: GcPauses | None = None


def process_gc_pauses() -> GcPauses:
    """This process's collection timer, started on first use (every ProcessStats shares it)."""
    global _PROCESS_PAUSES
    if _PROCESS_PAUSES is None:
        _PROCESS_PAUSES = GcPauses()
    return _PROCESS_PAUSES
