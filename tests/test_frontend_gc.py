"""The frontend's garbage in reference cycles (dead connections, requests' exit stacks) is collected within a
period, not when CPython's thresholds get round to it (docs/notes/benchmark-history.md, the soak):
start-up's objects are frozen, so they neither delay nor slow a full collection, and one runs every
GARBAGE_COLLECTION_PERIOD_S (frontend/process.py)."""

from __future__ import annotations

import asyncio
import collections
import gc

from common.garbage import YOUNG_THRESHOLD, freeze_startup_objects
from frontend.process import collect_request_garbage

STARTUP_OBJECTS = 400_000  # about 6 times a real frontend's; unfrozen, ~100,000 garbage objects would pile up
REQUESTS = 400_000
ALIVE_AT_ONCE = 2_000  # long enough that each request outlives the young collections, as real ones do


class RequestState:
    """A request's objects in a reference cycle (as an asyncio transport holds itself), counted when freed."""

    freed = 0

    def __init__(self) -> None:
        self.itself = self

    def __del__(self) -> None:
        RequestState.freed += 1


def peak_uncollected_garbage() -> int:
    RequestState.freed = 0
    alive: collections.deque[RequestState] = collections.deque()
    peak = 0
    for made in range(1, REQUESTS + 1):
        alive.append(RequestState())
        if len(alive) > ALIVE_AT_ONCE:
            alive.popleft()
        peak = max(peak, made - len(alive) - RequestState.freed)
    return peak


def test_request_garbage_does_not_pile_up_in_proportion_to_what_startup_left_alive():
    startup = [[] for _ in range(STARTUP_OBJECTS)]
    thresholds = gc.get_threshold()
    freeze_startup_objects()
    try:
        peak = peak_uncollected_garbage()
    finally:
        gc.unfreeze()
        gc.set_threshold(*thresholds)
        del startup
    assert peak < STARTUP_OBJECTS / 10  # ~28,000 frozen (the collector's own pace), ~98,000 unfrozen


def test_objects_that_live_a_few_steps_are_gone_before_a_young_collection_after_startup():
    """A step's worth of short-lived containers (CPython's default would collect every 700) leaves nothing for
    the collector: freed by their counts before the raised threshold is reached."""
    thresholds = gc.get_threshold()
    freeze_startup_objects()
    try:
        young_collections = gc.get_stats()[0]["collections"]
        for _ in range(50):
            step = [[token] for token in range(YOUNG_THRESHOLD // 10)]  # a step's lists, dropped with it
            del step
        assert gc.get_stats()[0]["collections"] == young_collections
    finally:
        gc.unfreeze()
        gc.set_threshold(*thresholds)


def test_garbage_left_in_cycles_is_collected_within_the_period():
    async def leave_garbage_then_wait() -> int:
        gc.collect()  # what earlier tests left
        collector = asyncio.create_task(collect_request_garbage(period_s=0.05))
        RequestState.freed = 0
        gc.disable()  # only the periodic collection may free it
        try:
            for _ in range(1_000):
                RequestState()
            await asyncio.sleep(0.2)
        finally:
            gc.enable()
            collector.cancel()
        return RequestState.freed

    assert asyncio.run(leave_garbage_then_wait()) == 1_000
