"""Request bodies the server will read: JSON, and no more than --max-request-body-bytes.

    Content-Length over the limit            413 before a byte of the body is read
    bytes read so far over the limit         413 (a chunked body, or a Content-Length that lied)
    a form or text/plain body                415: those are the content types a web page may POST
                                             cross-origin without asking (no CORS preflight), so
                                             refusing them keeps a browser from driving a server on
                                             localhost (CSRF); API clients send application/json

Errors have the OpenAI shape (frontend/errors.py), like every other refusal.
"""

from __future__ import annotations

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from frontend.errors import ApiError, error_response

CROSS_ORIGIN_SIMPLE_TYPES = ("text/plain", "application/x-www-form-urlencoded", "multipart/form-data")


class RequestBodyGuard:
    def __init__(self, app: ASGIApp, max_body_bytes: int):
        self.app = app
        self.max_body_bytes = max_body_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = dict(scope["headers"])
        refusal = self._refusal(headers)
        if refusal is not None:
            await error_response(refusal)(scope, receive, send)
            return
        read = 0
        limit = self.max_body_bytes

        async def counted_receive() -> Message:
            nonlocal read
            message = await receive()
            if message["type"] == "http.request":
                read += len(message.get("body", b""))
                if read > limit:
                    raise too_large(limit)
            return message

        await self.app(scope, counted_receive, send)

    def _refusal(self, headers: dict[bytes, bytes]) -> ApiError | None:
        length = headers.get(b"content-length")
        try:
            too_long = length is not None and int(length) > self.max_body_bytes
        except ValueError:
            return ApiError(400, "Content-Length is not a number")
        if too_long:
            return too_large(self.max_body_bytes)
        content_type = headers.get(b"content-type", b"").decode("latin-1").split(";")[0].strip().lower()
        if content_type in CROSS_ORIGIN_SIMPLE_TYPES and length != b"0":  # a body, or one of unknown length
            return ApiError(
                415, f"request bodies must be JSON: send 'Content-Type: application/json', not {content_type!r}"
            )
        return None


def too_large(limit: int) -> ApiError:
    return ApiError(
        413,
        f"the request body is larger than this server takes ({limit} bytes, --max-request-body-bytes)",
        code="request_too_large",
    )
