"""OpenAI-style errors: every failure a client sees has the body

    {"error": {"message": str, "type": str, "param": str | null, "code": str | null}}

so OpenAI clients surface the message and the field at fault instead of a bare status.
"""

from __future__ import annotations

import logging

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

log = logging.getLogger(__name__)


class ApiError(Exception):
    """A request the server will not serve, with the HTTP status and the field to blame."""

    def __init__(
        self, status: int, message: str, param: str | None = None, code: str | None = None, type: str | None = None
    ):
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.type = type or error_type(status)


def error_type(status: int) -> str:
    if status == 401:
        return "authentication_error"
    if status == 503:
        return "service_unavailable"
    if 400 <= status < 500:
        return "invalid_request_error"
    return "server_error"


def model_not_found(model: str) -> ApiError:
    """A request for a model this server does not serve: vLLM's 404 (its message, type and param), with OpenAI's
    code (this body's codes are strings)."""
    return ApiError(
        404, f"The model `{model}` does not exist.", param="model", code="model_not_found", type="NotFoundError"
    )


# A 503 (the waiting queue is full, the server is stopping) says when to come back: clients and proxies back
# off instead of retrying at once.
RETRY_AFTER_S = 1


def error_body(error: ApiError) -> dict:
    """The OpenAI error object; also what a stream's last event carries when it ends in an error."""
    return {"error": {"message": error.message, "type": error.type, "param": error.param, "code": error.code}}


def error_response(error: ApiError) -> JSONResponse:
    headers = {"Retry-After": str(RETRY_AFTER_S)} if error.status == 503 else None
    return JSONResponse(error_body(error), status_code=error.status, headers=headers)


def install_error_handlers(app: FastAPI) -> None:
    """Answer every error, ours or the framework's (404 route, 405 method, a bug), in the OpenAI shape."""

    async def on_api_error(_: Request, exc: ApiError) -> JSONResponse:
        return error_response(exc)

    async def on_http_error(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        return error_response(ApiError(exc.status_code, str(exc.detail)))

    async def on_unexpected(_: Request, exc: Exception) -> JSONResponse:
        log.exception("unhandled error in a request", exc_info=exc)
        return error_response(ApiError(500, f"internal error: {type(exc).__name__}"))

    app.add_exception_handler(ApiError, on_api_error)  # type: ignore[arg-type]
    app.add_exception_handler(StarletteHTTPException, on_http_error)  # type: ignore[arg-type]
    app.add_exception_handler(Exception, on_unexpected)
