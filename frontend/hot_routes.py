"""The generation endpoints, served without FastAPI's per-request machinery.

    uvicorn ─▶ HotRoutes ─┬─ POST /v1/completions, /v1/chat/completions, /generate ─▶ the body guard ─▶ endpoint
                          └─ anything else ─▶ the FastAPI app (every route, the schema, 404 and 405)

A request that FastAPI routes passes through its middleware stack (error wrapping, its body limit, an exit
stack per request), the router's matching and dependency solving before it reaches the endpoint, which
reads its body and validates it itself (frontend/body_parse.py: parse_body). Those layers were about a third of
a frontend's CPU per request (a py-spy profile, null engine). The endpoint functions here are FastAPI's own
(taken from their routes, so the OpenAPI schema and the app's tests see the same ones), and what FastAPI did
for them is done here the same way: the API key check, the request body guard (frontend/body_guard.py), and
an exception mapped to the response the app's own handler for it gives (frontend/errors.py).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable

from fastapi import FastAPI, Request, Response
from fastapi.routing import APIRoute, APIRouter
from starlette.types import Message, Receive, Scope, Send

from frontend.body_guard import RequestBodyGuard

HOT_PATHS = ("/v1/completions", "/v1/chat/completions", "/generate")

Endpoint = Callable[[Request], Awaitable[Response]]


def hot_endpoints(*routers: APIRouter) -> dict[str, Endpoint]:
    return {
        route.path: route.endpoint
        for router in routers
        for route in router.routes
        if isinstance(route, APIRoute) and route.path in HOT_PATHS and "POST" in route.methods
    }


class HotRoutes:
    def __init__(
        self,
        app: FastAPI,
        endpoints: dict[str, Endpoint],
        max_body_bytes: int,
        check_key: Callable[[Request], Awaitable[None]] | None = None,
    ):
        self.app = app
        self.endpoints = endpoints
        self.check_key = check_key
        self.guarded = RequestBodyGuard(self._serve, max_body_bytes)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["method"] == "POST" and scope["path"] in self.endpoints:
            await self.guarded(scope, receive, send)
        else:
            await self.app(scope, receive, send)

    async def _serve(self, scope: Scope, receive: Receive, send: Send) -> None:
        request = Request(scope, receive)
        tracked = TrackedSend(send)
        try:
            if self.check_key is not None:
                await self.check_key(request)
            response = await self.endpoints[scope["path"]](request)
            await response(scope, receive, tracked)
        except Exception as exc:
            if tracked.started:
                raise  # the response is under way: as FastAPI, the server closes the connection
            await (await self._handled(request, exc))(scope, receive, send)

    async def _handled(self, request: Request, exc: Exception) -> Response:
        """The response the app's handler for this exception gives (the most specific one, as Starlette picks)."""
        for cls in type(exc).__mro__:
            handler = self.app.exception_handlers.get(cls)
            if handler is not None:
                return await handler(request, exc)  # type: ignore[misc]
        raise exc


class TrackedSend:
    """The server's `send`, noting whether the response has started. It hands back the server's own awaitable
    rather than awaiting it in a coroutine of its own: a streamed chunk passes here once per write."""

    __slots__ = ("_send", "started")

    def __init__(self, send: Send):
        self._send = send
        self.started = False

    def __call__(self, message: Message) -> Awaitable[None]:
        self.started = True
        return self._send(message)
