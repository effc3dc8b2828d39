"""Waiting on the engine while watching the client: a client that goes away must stop its request.

    unless_disconnected(receive, work)   work's result, or ClientDisconnected as soon as the client leaves
    StreamingEvents(chunks, on_close)    a streamed response that always ends with `on_close()`, after
                                         the last chunk or when the client leaves mid-stream

The ASGI `receive` channel reports `http.disconnect` once the request body has been read and the
client closes its connection; watching it beats polling and needs no framework support.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncGenerator, Awaitable, Callable
from json.encoder import encode_basestring_ascii  # type: ignore[attr-defined]
from typing import Any, TypeVar

from starlette.responses import Response
from starlette.types import Receive, Scope, Send

T = TypeVar("T")

SSE_DONE = b"data: [DONE]\n\n"


class ClientDisconnected(Exception):
    pass


def sse_event(payload: dict) -> bytes:
    return b"data: " + json.dumps(payload, separators=(",", ":")).encode() + b"\n\n"


def ndjson_line(payload: dict) -> bytes:
    return json.dumps(payload, separators=(",", ":")).encode() + b"\n"


def json_string(text: str) -> str:
    """`text` as a JSON string literal, exactly as json.dumps writes it (its C fast path, no encoder object)."""
    return encode_basestring_ascii(text)


def partial_tag_suffix(text: str, tag: str) -> int:
    """The length of text's longest ending that begins `tag` (0: none): streamed text held back until it is known
    whether a tag (a tool call's, a reasoning block's) starts there."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0


async def _disconnected(receive: Receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


async def unless_disconnected(receive: Receive, work: Awaitable[T]) -> T:
    work_task = asyncio.ensure_future(work)
    watch_task = asyncio.ensure_future(_disconnected(receive))
    try:
        await asyncio.wait({work_task, watch_task}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        work_task.cancel()
        watch_task.cancel()
    if work_task.done() and not work_task.cancelled():
        return work_task.result()
    raise ClientDisconnected


class StreamingEvents(Response):
    """Streams `chunks` (SSE or NDJSON); `on_close` runs exactly once at the end whatever the cause, so
    the owner can abort a request the client abandoned (aborting a finished request is a no-op)."""

    def __init__(self, chunks: AsyncGenerator[bytes, None], media_type: str, on_close: Callable[[], Awaitable[Any]]):
        self.chunks = chunks
        self.on_close = on_close
        self.status_code = 200
        self.media_type = media_type
        self.background = None
        self.init_headers({"Cache-Control": "no-cache"})

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
            await unless_disconnected(receive, self._send_chunks(send))
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        except (ClientDisconnected, OSError):
            pass  # the client left: nobody to answer
        finally:
            # Shielded: when the server cancels this task, the abort must still reach the engine.
            await asyncio.shield(self.on_close())

    async def _send_chunks(self, send: Send) -> None:
        async with contextlib.aclosing(self.chunks) as chunks:
            async for chunk in chunks:
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
