"""Start-up phases as the user sees them: one log line per phase, with its elapsed time.

launcher:   model ...              resolve (a GGUF is converted once, and says so first)
gpu_worker: weights loaded ...     load
            KV store ...           size and allocate
            warmed up ...          warm up
launcher:   clearserve ready ...   every process answered
"""

from __future__ import annotations

import logging
import time


class PhaseClock:
    """Phases run one after another: each line's time is since the previous line (or the clock's start)."""

    def __init__(self, log: logging.Logger):
        self.log = log
        self.started = time.perf_counter()
        self._last = self.started

    def done(self, what: str) -> None:
        now = time.perf_counter()
        self.log.info("%s (%.1f s)", what, now - self._last)
        self._last = now

    def total_s(self) -> float:
        return time.perf_counter() - self.started
