"""API key check: `Authorization: Bearer <key>` on every endpoint but /health and /metrics."""

from __future__ import annotations

import secrets
from collections.abc import Awaitable, Callable

from fastapi import Request

from frontend.errors import ApiError


def api_key_check(api_key: str) -> Callable[[Request], Awaitable[None]]:
    async def check(request: Request) -> None:
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        # compare_digest: the time taken must not tell how much of a guessed key was right.
        if scheme.lower() != "bearer" or not secrets.compare_digest(token.strip().encode(), api_key.encode()):
            raise ApiError(
                401, "missing or invalid API key (send 'Authorization: Bearer <key>')", code="invalid_api_key"
            )

    return check
