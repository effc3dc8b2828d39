"""What a frontend answers while it stops.

    SIGTERM ──▶ every open stream ends with an error event (EngineClient.fail_open_streams)
            ──▶ every request, new or on an open connection, gets a 503 with Retry-After ─┐ STOPPING_ANSWERED_S
            ──▶ uvicorn's shutdown: the listening socket closed, idle connections closed ◀─┘

The launcher signals the frontends first when the server stops (a child died, Ctrl-C, SIGTERM) and closes
its own copy of the listening socket, so the socket closes with the last frontend's: until then a client
gets the 503 the README promises, not a connection reset (what a connection left in the listen backlog of a
socket nobody accepts on gets when it closes); after it, its connection is refused.
"""

from __future__ import annotations

from starlette.types import ASGIApp, Receive, Scope, Send

from frontend.errors import ApiError, error_response

STOPPING = "the server is stopping"
STOPPING_ANSWERED_S = 0.5  # long enough for requests already on their way; the launcher kills at 5 s


class StoppingGate:
    """In front of the app: once `stopping`, each request's body is read (a server that closes with unread
    bytes resets the connection, and the answer with it) and answered with the 503, the connection closed."""

    def __init__(self, app: ASGIApp):
        self.app = app
        self.stopping = False

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not self.stopping:
            await self.app(scope, receive, send)
            return
        while (message := await receive())["type"] == "http.request" and message.get("more_body", False):
            pass
        response = error_response(ApiError(503, STOPPING, code="server_stopping"))
        response.headers["Connection"] = "close"
        await response(scope, receive, send)
