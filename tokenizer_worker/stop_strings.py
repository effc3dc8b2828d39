"""Stop strings, matched on the streamed text whatever the token boundaries.

Text that could be the start of a stop string is held back until it either completes one or cannot:

    streamed so far | held (a proper prefix of some stop string) | new delta
                      └──────── searched together each step ────────┘

The held part is shorter than the longest stop string and never contains a whole one (it would have
matched already), so a step costs the length of the delta plus that of the stop strings. When several
stop strings occur, the first to be complete in the text wins (at equal ends, the longer one): what a
reader going character by character would stop at, so the result does not depend on how the text was
split into deltas.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(slots=True)
class StopStringMatcher:
    stop: list[str]  # non-empty strings (SamplingParams.validate)
    include_stop: bool = False  # keep the matched stop string at the end of the output
    matched: str | None = None  # the stop string that ended the output
    _held: str = ""

    def feed(self, delta: str, final: bool = False) -> tuple[str, bool]:
        """(text to stream now, whether a stop string matched and the output ends here)."""
        if not self.stop:
            return delta, False
        text = self._held + delta
        match = self._first_match(text)
        if match is not None:
            start, end = match
            self._held = ""
            self.matched = text[start:end]
            return text[: end if self.include_stop else start], True
        keep = 0 if final else self._longest_stop_prefix_suffix(text)
        self._held = text[len(text) - keep :]
        return text[: len(text) - keep], False

    def _first_match(self, text: str) -> tuple[int, int] | None:
        best: tuple[int, int] | None = None
        for s in self.stop:
            start = text.find(s)
            if start >= 0 and (best is None or (start + len(s), start) < (best[1], best[0])):
                best = (start, start + len(s))
        return best

    def _longest_stop_prefix_suffix(self, text: str) -> int:
        """Length of the longest end of `text` that begins some stop string (0 if none)."""
        longest = max(len(s) for s in self.stop) - 1
        for k in range(min(longest, len(text)), 0, -1):
            tail = text[-k:]
            if any(s.startswith(tail) for s in self.stop):
                return k
        return 0
