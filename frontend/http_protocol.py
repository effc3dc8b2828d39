"""The HTTP/1.1 protocol a frontend serves with: one of uvicorn's two parsers, plus deadlines for reading a
request and a bound on its header bytes, so that no client can hold a socket or memory by sending slowly or
sending too much.

    httptools   llhttp, in C (uvicorn's default where installed): a request's parse, and each streamed
                chunk's framing, cost a fraction of h11's (a frontend's CPU per request ~30 % lower with
                the null engine: docs/benchmarks.md, "HTTP parser")
    h11         pure Python; the fallback, and --http-parser h11

Deadlines, both parsers alike:

    connection opened, or the previous response ended ── timeout_headers_s ──▶ the request's headers
    the request's headers ───────────────────────────── timeout_body_s ────▶ the end of its body

A deadline missed closes the connection (an app waiting on the body sees the client leave). Idle keep-alive
connections are uvicorn's own timeout_keep_alive. Headers (request line included) over MAX_HEADER_BYTES: 400
and the connection closed. Connections past --max-connections: ConnectionCap's 503.

A client that closes its side once its request is sent (a half-close, which HTTP/1.1 allows: `nc -N`,
`shutdown(SHUT_WR)`) gets its whole response, streamed or not, and the connection is closed after it; uvicorn
would read the end of its input as the client leaving. A client that closed its socket whole looks the same
(a FIN) until something is written to it, which it answers with a reset: until the response starts, an
interim "100 Continue" every PEER_PROBE_S is that write, so a client that left is still noticed (the
request aborted) within about two of them.
"""

from __future__ import annotations

import asyncio
from typing import Any

from starlette.types import ASGIApp, Receive, Scope, Send
from uvicorn.protocols.http.h11_impl import H11Protocol

from frontend.errors import ApiError, error_response

MAX_HEADER_BYTES = 64 * 1024
PEER_PROBE_S = 1.0
# HTTP/1.1 clients must read any number of 1xx responses before the final one (RFC 9110, 15.2).
INTERIM_RESPONSE = b"HTTP/1.1 100 Continue\r\n\r\n"


class HeaderTooLarge(ValueError):
    pass


class ReadDeadlines:
    """Mixed into a uvicorn protocol (both keep the request being served in `self.cycle`)."""

    parser_name = ""  # "httptools" or "h11": which one the protocol parses with (the frontend's /stats say it)

    # The protocol's own, read here.
    cycle: Any
    connections: set
    loop: asyncio.AbstractEventLoop
    transport: asyncio.Transport

    timeout_headers_s = 10.0
    timeout_body_s = 30.0
    # The server's open connections: uvicorn's own set (what its limit_concurrency counted), shared by every
    # connection's protocol; ConnectionCap reads its size.
    open_connections: set = set()
    _read_deadline: asyncio.TimerHandle | None = None
    _body_clock_of: object = None  # the request cycle whose body the deadline is timing
    _peer_probe: asyncio.TimerHandle | None = None

    def connection_made(self, transport) -> None:
        super().connection_made(transport)  # type: ignore[misc]
        ReadDeadlines.open_connections = self.connections  # uvicorn's own set of this server's connections
        self._arm_read_deadline(self.timeout_headers_s)

    def data_received(self, data: bytes) -> None:
        if self._read_deadline is None and self._waiting_for_headers():
            self._arm_read_deadline(self.timeout_headers_s)  # a keep-alive connection's next request: its own clock
        super().data_received(data)  # type: ignore[misc]
        if self._reading_body():
            if self._body_clock_of is not self.cycle:  # a request whose headers are in: its body's clock starts
                self._body_clock_of = self.cycle
                self._arm_read_deadline(self.timeout_body_s)
        elif not self._waiting_for_headers():
            self._disarm_read_deadline()  # the request is read whole

    def on_response_complete(self) -> None:
        self._disarm_read_deadline()
        super().on_response_complete()  # type: ignore[misc]

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm_read_deadline()
        if self._peer_probe is not None:
            self._peer_probe.cancel()
        super().connection_lost(exc)  # type: ignore[misc]

    def eof_received(self) -> bool | None:
        """True keeps the connection open for writing: a request read whole is answered, then the connection
        closes. Anything else (a request cut short, an idle connection) ends it, as before."""
        cycle = self.cycle
        if cycle is None or cycle.response_complete or cycle.more_body:
            return None
        cycle.keep_alive = False
        if self._peer_probe is None and cycle.scope["http_version"] == "1.1":  # not a 1xx to an HTTP/1.0 client
            self._peer_probe = self.loop.call_later(PEER_PROBE_S, self._probe_peer)
        return True

    def _probe_peer(self) -> None:
        cycle = self.cycle
        if cycle is None or cycle.response_started or self.transport.is_closing():
            self._peer_probe = None
            return
        self.transport.write(INTERIM_RESPONSE)  # a reset answers it where the client is gone; the next write fails
        self._peer_probe = self.loop.call_later(PEER_PROBE_S, self._probe_peer)

    def _waiting_for_headers(self) -> bool:
        return self.cycle is None or self.cycle.response_complete

    def _reading_body(self) -> bool:
        cycle = self.cycle
        return cycle is not None and cycle.more_body and not cycle.response_complete

    def _arm_read_deadline(self, seconds: float) -> None:
        self._disarm_read_deadline()
        self._read_deadline = self.loop.call_later(seconds, self._read_late)

    def _disarm_read_deadline(self) -> None:
        if self._read_deadline is not None:
            self._read_deadline.cancel()
            self._read_deadline = None

    def _read_late(self) -> None:
        self._read_deadline = None
        transport = self.transport
        if (self._waiting_for_headers() or self._reading_body()) and not transport.is_closing():
            transport.close()


class H11WithDeadlines(ReadDeadlines, H11Protocol):
    """h11 bounds the header bytes itself (uvicorn's h11_max_incomplete_event_size, set by the frontend)."""

    parser_name = "h11"


def protocol_class(choice: str) -> type[ReadDeadlines]:
    """ "httptools" | "h11" | "auto" (httptools where installed)."""
    if choice == "h11":
        return H11WithDeadlines
    try:
        return _httptools_protocol()
    except ImportError:
        if choice == "httptools":
            raise
        return H11WithDeadlines


def _httptools_protocol() -> type[ReadDeadlines]:
    from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

    class HttpToolsWithDeadlines(ReadDeadlines, HttpToolsProtocol):
        """llhttp keeps any length of request line and headers: they are counted here, two ways. Complete ones
        as the parser hands them over (an error raised in a parser callback is uvicorn's 400 and close); one
        still arriving, as the bytes of every chunk that left the headers unfinished (a chunk that also ends
        the previous request's body counts that too: only pipelined requests can be over-counted)."""

        parser_name = "httptools"
        _in_headers = False  # between a request's first byte and the end of its headers
        _header_bytes = 0  # its request line and complete headers
        _unfinished_bytes = 0  # the chunks that left its headers unfinished

        def on_message_begin(self) -> None:
            super().on_message_begin()
            self._in_headers = True
            self._header_bytes = self._unfinished_bytes = 0

        def on_url(self, url: bytes) -> None:
            self._count_header_bytes(len(url))
            super().on_url(url)

        def on_header(self, name: bytes, value: bytes) -> None:
            self._count_header_bytes(len(name) + len(value) + 4)  # ": " and CRLF
            super().on_header(name, value)

        def on_headers_complete(self) -> None:
            self._in_headers = False
            super().on_headers_complete()

        def data_received(self, data: bytes) -> None:
            super().data_received(data)
            if self._in_headers:
                self._unfinished_bytes += len(data)
                if self._unfinished_bytes > MAX_HEADER_BYTES and not self.transport.is_closing():
                    self.send_400_response("Invalid HTTP request received.")

        def _count_header_bytes(self, n: int) -> None:
            self._header_bytes += n
            if self._header_bytes > MAX_HEADER_BYTES:
                raise HeaderTooLarge(f"request line and headers over {MAX_HEADER_BYTES} bytes")

    return HttpToolsWithDeadlines


class ConnectionCap:
    """--max-connections, in front of the app: while more connections are open than that, a request gets a 503
    in the OpenAI error shape (with Retry-After, as the server's other 503s) and its connection is closed.
    uvicorn's own cap (limit_concurrency) would answer in plain text."""

    def __init__(self, app: ASGIApp, max_connections: int):
        self.app = app
        self.max_connections = max_connections

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and len(ReadDeadlines.open_connections) > self.max_connections:
            message = f"this server has more connections open than it takes ({self.max_connections}, --max-connections)"
            response = error_response(ApiError(503, message, code="too_many_connections"))
            response.headers["Connection"] = "close"
            await response(scope, receive, send)
            return
        await self.app(scope, receive, send)
