"""The count of a request body's JSON values, made before it is parsed: a 400 naming the top-level field where
the body holds more than --max-request-json-values (frontend/body_parse.py says why the count bounds a parse).

Values are counted as the commas, `[` and `{` outside strings (an element or member after a container's first
follows a comma, and each container opens once; an empty one counts one):

    every byte of , [ {, strings included, ≤ the limit    within: one C count per 1 MiB window, no more
    otherwise, window by window from the start:
      a window whose depth stays ≥ 2                       skimmed: its strings split off and the rest
                                                           counted in a few C calls (no top-level key can
                                                           be in it, so the field is the one already open)
      a window that may come back to depth 1               walked: string by string, reading the keys
    stopped once the count passes the limit

Skimmed or walked, each C call covers one window (≤ SKIM_WINDOW bytes outside strings), short enough to hand the
GIL back to the event loop between them. A 16 MiB body of 400,000 chat messages was ~0.1 s walked string by
string on the parsing thread, about all of it inside `messages` (depth 2 and more); while that thread kept
asking for the GIL, the event loop waited a switch interval (5 ms) for each callback it ran, and with eight such
bodies arriving at once /health answered 0.15-0.2 s late. Skimmed, the body is refused after a few milliseconds.
Only a bound is decided here: a body that is not JSON is left to the parser that follows.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from frontend.errors import ApiError

SCAN_WINDOW = 1 << 20  # bytes one C call of the first, upper count covers: ~1 ms
SKIM_WINDOW = 8 * 1024  # bytes outside strings that one window of the exact count covers: ~0.1 ms
FIRST_WINDOW = 256  # windows start here and double while skimmed: the walked ones stay short
BACKSLASH = ord("\\")
SHORT_GAP = 16  # bytes between two strings whose structure is remembered
_KEY_FOLLOWS = re.compile(rb"[ \t\r\n]*:")
PAIR_PASSES = 8  # a window nested deeper than this within itself is walked
_BRACKETS = bytes.maketrans(b"[{]}", b"(())")
_NOT_BRACKETS = bytes(b for b in range(256) if b not in b"[]{}")


def check_json_values(body: bytes, limit: int) -> None:
    """A 400 where the body holds more than `limit` JSON values, naming the top-level field they are in."""
    if _upper_count_within(body, limit):
        return
    field = field_past_value_limit(body, limit)
    if field is not None:
        where = f"'{field}' holds" if field else "the request body holds"
        raise ApiError(
            400,
            f"{where} more JSON values (array elements, object members) than this server takes in one request "
            f"body ({limit}, --max-request-json-values)",
            param=field or None,
        )


def field_past_value_limit(body: bytes, limit: int) -> str | None:
    """The top-level field in which the body's JSON values pass `limit` ("" where no field is open yet); None
    when they stay within it, or where the body is not JSON as far as it was read."""
    values = _ValueCount(_without_escapes(body), limit)  # every '"' left opens or closes a string
    text = values.text
    pos = 0
    window = FIRST_WINDOW
    while pos < len(text) and not (values.past or values.malformed):
        end = min(len(text), pos + window)
        if text.count(b'"', pos, end) % 2:  # the window ends inside a string: it takes the string whole
            end = text.find(b'"', end) + 1
            if end == 0:
                return None  # a string never closed
        if values.skimmed(pos, end):
            window = min(2 * window, SKIM_WINDOW)
        else:
            values.walk(pos, end)
            window = FIRST_WINDOW
        pos = end
    return values.open_field if values.past else None


@dataclass(slots=True)
class _ValueCount:
    """The count so far of text's values, from its start to a point outside any string, and the nesting depth
    and top-level field open there."""

    text: bytes
    limit: int
    count: int = 0
    depth: int = 0
    strings: int = 0
    open_field: str = ""
    past: bool = False  # the count passed the limit, in `open_field`
    malformed: bool = False  # more strings than JSON has for its values: not JSON, left to the parser
    gaps: dict[bytes, tuple[int, int]] = field(default_factory=dict)  # a short gap's (values, depth change)

    def skimmed(self, start: int, end: int) -> bool:
        """Counts text[start:end] in a few C calls where its depth stays 2 or more (so the top-level field is the
        one open at its start); False, and nothing counted, where it may not."""
        pieces = self.text[start:end].split(b'"')  # outside strings, inside, outside, ...
        outside = b"".join(pieces[::2])
        brackets = outside.translate(_BRACKETS, _NOT_BRACKETS)  # openings "(", closings ")"
        opened = brackets.count(b"(")
        if self.depth - _deepest_fall(brackets) < 2:
            return False
        self._add(outside.count(b",") + opened, 2 * opened - len(brackets), len(pieces) // 2)
        return True

    def walk(self, pos: int, end: int) -> None:
        """Counts text[pos:end] string by string, reading the top-level keys; stops once past the limit. Each
        pass covers one gap between strings, and there are at most about 2 × limit of them (valid JSON has at
        most two strings, a key and its value, per value counted)."""
        text = self.text
        while not (self.past or self.malformed):
            start = text.find(b'"', pos, end)
            gap_end = end if start < 0 else start
            if gap_end - pos <= SHORT_GAP:  # between a key and its value, or two values: ':', ',', '}, {'...
                gap = text[pos:gap_end]
                values, nesting = self.gaps.get(gap) or self.gaps.setdefault(gap, _structure(gap, 0, len(gap)))
            else:
                values, nesting = _structure(text, pos, gap_end)
            if start < 0:
                self._add(values, nesting, 0)
                return
            string_end = text.find(b'"', start + 1)  # in the window: it ends outside strings
            self._add(values, nesting, 1)
            if self.depth == 1 and not self.past and _KEY_FOLLOWS.match(text, string_end + 1):
                self.open_field = text[start + 1 : string_end].decode("utf-8", "replace")
            pos = string_end + 1

    def _add(self, values: int, nesting: int, strings: int) -> None:
        self.count += values
        self.depth += nesting
        self.strings += strings
        self.past = self.count > self.limit
        self.malformed = not self.past and self.strings > 2 * self.count + 2


def _deepest_fall(brackets: bytes) -> int:
    """How far below its starting depth a run of "(" and ")" goes: the ")" left once every "()" pair is taken
    out, pass by pass (one pass per level of nesting within the run); past PAIR_PASSES, as far as it could."""
    for _ in range(PAIR_PASSES):
        paired = brackets.replace(b"()", b"")
        if len(paired) == len(brackets):
            return brackets.count(b")")  # ")))(((": the closings all come first
        brackets = paired
    return len(brackets)


def _upper_count_within(body: bytes, limit: int) -> bool:
    """Whether the body's `,`, `[` and `{`, those in strings included, are `limit` at most: a bound from above
    on its values, counted a window at a time, and stopped once past the limit."""
    count = 0
    for lo in range(0, len(body), SCAN_WINDOW):
        hi = lo + SCAN_WINDOW
        count += body.count(b",", lo, hi) + body.count(b"[", lo, hi) + body.count(b"{", lo, hi)
        if count > limit:
            return False
    return True


def _structure(text: bytes, start: int, end: int) -> tuple[int, int]:
    """What text[start:end], outside strings, adds to the count of values, and to the depth of nesting, counted
    a window at a time."""
    values = nesting = 0
    for lo in range(start, end, SCAN_WINDOW):
        hi = min(end, lo + SCAN_WINDOW)
        opened = text.count(b"[", lo, hi) + text.count(b"{", lo, hi)
        values += opened + text.count(b",", lo, hi)
        nesting += opened - text.count(b"]", lo, hi) - text.count(b"}", lo, hi)
    return values, nesting


def _without_escapes(body: bytes) -> bytes:
    """The body with escaped backslashes, then escaped quotes, taken out, a window at a time. Each window
    starts where an escape could (a run of backslashes pairs off from its first), so a window that ends on an
    odd run of them takes the escaped character too."""
    if b"\\" not in body:
        return body
    pieces = []
    start = 0
    while start < len(body):
        end = min(len(body), start + SCAN_WINDOW)
        if end < len(body) and body[end - 1] == BACKSLASH:
            window = body[start:end]
            end += (len(window) - len(window.rstrip(b"\\"))) % 2
        pieces.append(body[start:end].replace(b"\\\\", b"").replace(b'\\"', b""))
        start = end
    return b"".join(pieces)
