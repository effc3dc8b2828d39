"""A request body read into its model at a bounded cost, without holding up the event loop.

    body bytes ≤ INLINE_PARSE_BYTES   validated on the loop: milliseconds at most (32 KiB)
    larger                            on the frontend's body-parsing thread: its JSON values counted
                                      first (a 400 naming the field past --max-request-json-values),
                                      then validated

Parsing and validation (pydantic, in Rust) hold the GIL for the whole call, whether they run on the loop's
thread or another, except where the call comes back into Python: a thread alone frees the loop only where
the work between two such points is short. The cost of that call is about a microsecond per JSON value (an
array element, an object member), not per byte (a 15 MB string parses in milliseconds), so the values are
counted before it, by a scan whose C calls each cover one gap between strings, and which stops as soon as
the bound is passed. A 16 MiB body of 500,000 content parts held the loop 4 s; counted first, it is a 400
after ~0.1 s on the thread.

Within the bound, the request models (frontend/protocol.py) keep each hold short: every model calls back into
Python once built (RequestBody._checked), where the interpreter hands the GIL to the loop when it has
asked; a list stops at its first bad element and a model's unknown fields are one refusal (30,000 errors were
0.1-0.4 s to turn into Python in one call); a prompt is validated as the one shape its first element names.
What runs longest without a switch is the JSON parse and a run of values outside any model (a list of token
ids, a logit_bias object, unknown members), a fraction of a microsecond each. Work proportional to a chat
body's messages (their template form) is done in the same pass, on the thread, not on the loop.
"""

from __future__ import annotations

import asyncio
import re
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

from fastapi import Request
from pydantic import BaseModel, RootModel, ValidationError

from frontend.errors import ApiError
from frontend.limits import HttpLimits

Body = TypeVar("Body", bound=BaseModel)


class JsonObject(RootModel[dict[str, Any]]):
    """Any JSON object: the free-form arguments of the profiling endpoints."""


# The costliest 32 KiB of JSON for these models (960 one-character chat messages, each a model and its template
# form) validates in ~9 ms on a loaded 2-core machine; usual bodies never leave the loop.
INLINE_PARSE_BYTES = 32 * 1024
SCAN_WINDOW = 1 << 20  # bytes one C call of the value count covers: ~1 ms
BACKSLASH = ord("\\")
SHORT_GAP = 16  # bytes between two strings whose structure is remembered
OBJECT_ERRORS = ("model_type", "model_attributes_type", "dict_type", "dataclass_type")
_JSON_NAME = re.compile(r"(?!(?:str|int|float|bool|none)$)[a-z_][a-z0-9_]*")  # a field, not a union member
_KEY_FOLLOWS = re.compile(rb"[ \t\r\n]*:")

# One thread: large bodies wait for each other rather than share the GIL with the loop several at once.
_large_bodies = ThreadPoolExecutor(max_workers=1, thread_name_prefix="body-parse")


async def parse_body(request: Request, model: type[Body], limits: HttpLimits) -> Body:
    body = await request.body()
    if len(body) <= INLINE_PARSE_BYTES:
        return validated(body, model, limits.max_request_json_values)
    loop = asyncio.get_running_loop()
    return await loop.run_in_executor(_large_bodies, validated, body, model, limits.max_request_json_values)


def validated(body: bytes, model: type[Body], max_values: int) -> Body:
    if len(body) > max_values:  # every value counted takes a byte at least: a shorter body is within the bound
        check_json_values(body, max_values)
    try:
        return model.model_validate_json(body)
    except ValidationError as exc:
        raise invalid_body(exc) from None


def check_json_values(body: bytes, limit: int) -> None:
    """A 400 where the body holds more than `limit` JSON values, naming the top-level field they are in."""
    # Cheap first: commas and openings, strings' own included, bound the count from above.
    if _structure(body, 0, len(body))[0] <= limit:
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
    when they stay within it.

    Values are counted as the commas, `[` and `{` outside strings (an element or member after a container's
    first follows a comma, and each container opens once; an empty one counts one). The loop below runs
    once per string, and stops once the count is past the limit (valid JSON has at most two strings, a key
    and its value, per value counted): about `limit` passes at most, whatever the body; its C calls each
    cover at most a window of it, short enough to hand the GIL back to the event loop between them. Only a
    bound is decided here: a body that is not JSON is left to the parser that follows.
    """
    text = _without_escapes(body)  # every '"' left opens or closes a string
    count = depth = pos = strings = 0
    field = ""
    structure: dict[bytes, tuple[int, int]] = {}  # a short gap's (values, depth change), as it recurs
    while True:
        start = text.find(b'"', pos)
        gap_end = len(text) if start < 0 else start
        if gap_end - pos <= SHORT_GAP:  # between a key and its value, or two values: ':', ',', '}, {'...
            gap = text[pos:gap_end]
            values, nesting = structure.get(gap) or structure.setdefault(gap, _structure(gap, 0, len(gap)))
        else:
            values, nesting = _structure(text, pos, gap_end)
        count += values
        if count > limit:
            return field
        end = text.find(b'"', start + 1) if start >= 0 else -1
        strings += 1
        if end < 0 or strings > 2 * count + 2:  # the end, or not JSON
            return None
        depth += nesting
        if depth == 1 and _KEY_FOLLOWS.match(text, end + 1):
            field = text[start + 1 : end].decode("utf-8", "replace")
        pos = end + 1


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


def invalid_body(exc: ValidationError) -> ApiError:
    errors = exc.errors(include_url=False)
    for error in errors:  # an unknown field, refused by the model it is in (RequestBody._checked): its location
        if error["type"] == "extra_forbidden" and "field" in error.get("ctx", {}):
            error["loc"] = (*error["loc"], error["ctx"]["field"])
    first = errors[0]
    if first["type"] == "json_invalid":
        return ApiError(400, f"the request body is not valid JSON ({first.get('ctx', {}).get('error', '')})")
    if not first["loc"]:
        return ApiError(400, f"the request body must be a JSON object: {first['msg']}")
    param = str(first["loc"][0])
    if first["type"] == "extra_forbidden" and len(first["loc"]) == 1:
        return ApiError(400, f"unrecognized request argument supplied: '{param}'", param=param)
    # A union reports one error per member it tried: the deepest in the field is the member that got furthest
    # ("content": [5] is a list whose part is not an object, more than it is not a string).
    error = max((e for e in errors if e["loc"][:1] == first["loc"][:1]), key=lambda e: len(e["loc"]))
    # Locations carry pydantic's names for union members ("prompt.list[int].0"): the client's JSON has none.
    path = [str(part) for part in error["loc"] if isinstance(part, int) or _JSON_NAME.fullmatch(part)]
    where = f" (at {'.'.join(path)})" if len(path) > 1 else ""
    # pydantic names the model class it wanted ("a valid dictionary or instance of TextPart"): not the client's word.
    message = "Input should be a JSON object" if error["type"] in OBJECT_ERRORS else error["msg"]
    return ApiError(400, f"invalid '{param}'{where}: {message}", param=param)
