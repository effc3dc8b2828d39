"""A request body read into its model at a bounded cost, without holding up the event loop.

    body bytes ≤ INLINE_PARSE_BYTES   validated on the loop: milliseconds at most (32 KiB)
    larger                            on the frontend's body-parsing thread: its JSON values counted
                                      first (a 400 naming the field past --max-request-json-values),
                                      then validated

Parsing and validation (pydantic, in Rust) hold the GIL for the whole call, whether they run on the loop's
thread or another, except where the call comes back into Python: a thread alone frees the loop only where
the work between two such points is short. The cost of that call is about a microsecond per JSON value (an
array element, an object member), not per byte (a 15 MB string parses in milliseconds), so the values are
counted before it (frontend/json_values.py), in C calls of a window of the body each, stopping as soon as the
bound is passed. A 16 MiB body of 500,000 content parts held the loop 4 s; counted first, it is a 400 after
~10 ms on the thread.

Within the bound, the request models (frontend/protocol.py) keep each hold short: every model calls back into
Python once built (RequestBody._checked), where the interpreter hands the GIL to the loop when it has
asked; a list stops at its first bad element and a model's unknown fields are one refusal (30,000 errors were
0.1-0.4 s to turn into Python in one call); a prompt is validated as the one shape its first element names.
What runs longest without a switch is the JSON parse and a run of values outside any model (a list of token
ids, a logit_bias object, unknown members), a fraction of a microsecond each. Work proportional to a chat
body's messages (their template form) is done in the same pass, on the thread, not on the loop.

Short holds are not enough where the thread keeps asking for the GIL: each time the loop lets it go (uvloop
does around every wait for I/O), the thread takes it, and the loop's next callback waits until the thread is
made to drop it, a switch interval later (CPython's default: 5 ms). A /health answer takes several callbacks
(its request, the task's steps, the replies of the processes it pings), and the bodies the thread had finished
waited too, alive, for the loop to take them on. Eight bodies of 10,920 chat
messages, parsed back to back (~60 ms each), held /health 80-258 ms on a lightly loaded 2-core machine; with
the frontend's switch interval at GIL_SWITCH_INTERVAL_S, 30-61 ms (0a0da3f against 1111b31:
docs/notes/benchmark-history.md, "Large request bodies").
"""

from __future__ import annotations

import asyncio
import re
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

from fastapi import Request
from pydantic import BaseModel, RootModel, ValidationError

from frontend.errors import ApiError
from frontend.json_values import check_json_values
from frontend.limits import HttpLimits

Body = TypeVar("Body", bound=BaseModel)


class JsonObject(RootModel[dict[str, Any]]):
    """Any JSON object: the free-form arguments of the profiling endpoints."""


# The costliest 32 KiB of JSON for these models (960 one-character chat messages, each a model and its template
# form) validates in ~9 ms on a loaded 2-core machine; usual bodies never leave the loop.
INLINE_PARSE_BYTES = 32 * 1024
OBJECT_ERRORS = ("model_type", "model_attributes_type", "dict_type", "dataclass_type")
_JSON_NAME = re.compile(r"(?!(?:str|int|float|bool|none)$)[a-z_][a-z0-9_]*")  # a field, not a union member

# How long a thread keeps the GIL once another asks for it, in a frontend (sys.setswitchinterval): the loop
# waits that long for each callback it runs while a body is parsed. 0.5 ms did no better here; 2 ms, worse.
GIL_SWITCH_INTERVAL_S = 0.001
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
