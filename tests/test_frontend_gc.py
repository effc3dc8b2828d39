"""The frontend freezes what start-up left alive (frontend/process.py `freeze_startup_objects`), so that the
garbage requests leave in reference cycles is collected at the collector's own pace, however much start-up
left: without it, CPython's oldest generation waits for a quarter of the start-up objects' count in garbage
before collecting it (the soak's creeping RSS, docs/benchmarks.md)."""

from __future__ import annotations

import collections
import gc

from frontend.process import freeze_startup_objects

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
    freeze_startup_objects()
    try:
        peak = peak_uncollected_garbage()
    finally:
        gc.unfreeze()
        del startup
    assert peak < STARTUP_OBJECTS / 10  # ~28,000 frozen (the collector's own pace), ~98,000 unfrozen
