"""How far a process's main loop has got: what its control thread reports in every ping reply, so that the
launcher's watchdog (common/control.py: Watchdog) can tell a loop that is stuck from one that is busy.

The control thread answers pings from a thread of its own, even while the main loop is blocked (a scheduler
stuck in a long call, a GPU step that never ends), so an answer alone says "alive", not "making progress".
Each loop counts its turns here; a process whose count has not moved for --engine-iteration-timeout seconds
while it has work waiting is stuck.

    loop thread:     idle_wait(poll, timeout)   the loop's wait for input: a turn ends on entering it, and the
                                                loop has no work of its own while inside it
                     advance()                  one unit of held work done (a GPU step finished; a frontend's
                                                periodic tick)
    control thread:  report()                   {"turns": n, "work_waiting": bool}, in the ping reply

    work waiting  =  the loop is outside its idle wait (it took something to do and has not come back)
                     or it holds work it is waiting on (`holds_work`: a GPU step in flight)

A turn of a loop that only waits on work it holds (the GPU worker polling, without blocking, for a step still
running on the device) is not progress: only that work's completion is. So a device step that never ends is
stuck, however fast the loop spins around it; a long one that ends is one turn.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")

TICK_S = 1.0  # an event loop's tick (tick_event_loop): its turns, when nothing else marks them


def holds_nothing() -> bool:
    return False


class LoopProgress:
    """Written by the loop's thread, read by the control thread: plain attributes (each read and write is
    atomic under the interpreter lock), no lock on the loop's path."""

    def __init__(self, holds_work: Callable[[], bool] = holds_nothing) -> None:
        self.turns = 0
        self.holds_work = holds_work
        self._in_idle_wait = False

    def idle_wait(self, wait: Callable[[int], T], timeout_ms: int) -> T:
        """`wait(timeout_ms)`, the loop's wait for input (a poll), as the end of one turn."""
        if not self.holds_work():
            self.turns += 1
        self._in_idle_wait = True
        try:
            return wait(timeout_ms)
        finally:
            self._in_idle_wait = False

    def advance(self) -> None:
        self.turns += 1

    def report(self) -> dict:
        return {"turns": self.turns, "work_waiting": not self._in_idle_wait or self.holds_work()}


async def tick_event_loop(progress: LoopProgress, period_s: float = TICK_S) -> None:
    """An event loop's turns: a task that advances every `period_s`. It runs only when the loop gets back to
    its tasks, so a callback that blocks the loop stops it. The loop always has work waiting (this tick)."""
    while True:
        progress.advance()
        await asyncio.sleep(period_s)
