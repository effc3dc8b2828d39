"""The HTTP application: OpenAI endpoints, the native /generate, /tokenize and /detokenize, health, metrics
and control stubs.

    build_app(client, api_key) -> the ASGI app: the FastAPI app, its generation endpoints served around it
                                  (frontend/hot_routes.py)

It knows the engine only through EngineClient, so tests drive it with a fake client and the server
wires in the ZeroMQ one.
"""

from __future__ import annotations

import asyncio
import os
import time

from fastapi import Depends, FastAPI, Request, Response
from fastapi.openapi.docs import get_redoc_html, get_swagger_ui_html
from fastapi.openapi.utils import get_openapi
from fastapi.responses import JSONResponse
from prometheus_client import CONTENT_TYPE_LATEST
from pydantic import BaseModel
from starlette.requests import ClientDisconnect

from common.engine_replica import is_scheduler_role
from common.messages import ControlReply
from common.profiling import NOT_ENABLED, ProcessProfiler, merged_trace_path
from frontend.auth import api_key_check
from frontend.body_guard import RequestBodyGuard
from frontend.body_parse import JsonObject, parse_body
from frontend.engine_client import EngineClient
from frontend.errors import ApiError, install_error_handlers, model_not_found
from frontend.hot_routes import HotRoutes, hot_endpoints
from frontend.limits import HttpLimits
from frontend.metrics import REQUEST_METRICS, FrontendMetrics
from frontend.native_api import native_router
from frontend.openai_api import openai_router
from frontend.streaming import ClientDisconnected
from frontend.tokenizer_api import tokenizer_router
from frontend.trace_merge import merge_traces

HEALTH_TIMEOUT_S = 2.0
STATS_TIMEOUT_S = 2.0
PROFILE_TIMEOUT_S = 30.0  # stopping a profiler writes its trace first


def build_app(
    client: EngineClient,
    api_key: str | None = None,
    profiler: ProcessProfiler | None = None,
    limits: HttpLimits | None = None,
    tool_call_parser: str | None = None,
    reasoning_parser: str | None = None,
) -> HotRoutes:
    """`profiler`: this process's own, given when the server runs with --profile-dir; `tool_call_parser`: how
    chat requests' "auto" tool choice reads the model's calls (frontend/tool_calls.py), None where it is off;
    `reasoning_parser`: how a chat answer's thinking is told apart (frontend/reasoning.py), None: it is content."""
    limits = limits or HttpLimits()
    client.request_timeout_s = limits.request_timeout_s
    # With a key, the schema and its pages are behind it too (they are served by the routes below).
    app = FastAPI(title="clearserve", docs_url=None, redoc_url=None, openapi_url=None)
    install_error_handlers(app)
    app.add_exception_handler(ClientDisconnected, _client_gone)  # type: ignore[arg-type]
    app.add_exception_handler(ClientDisconnect, _client_gone)  # gone while sending its body (or cut: --timeout-body)
    # The generation endpoints are served around FastAPI (HotRoutes, below), the guard included.
    app.add_middleware(RequestBodyGuard, max_body_bytes=limits.max_request_body_bytes)  # type: ignore[arg-type]
    metrics = FrontendMetrics(client.limits.served_model_name)
    client.stats_sources[REQUEST_METRICS] = metrics.counts.to_payload  # in this frontend's /stats, for /metrics
    created = int(time.time())
    # Without a key, no dependency at all: FastAPI would still solve it on every request.
    check_key = api_key_check(api_key) if api_key is not None else None
    keyed = [Depends(check_key)] if check_key is not None else []
    generation = [
        openai_router(client, metrics, limits, tool_call_parser, reasoning_parser),
        native_router(client, metrics, limits),
    ]
    for router in [*generation, tokenizer_router(client, limits)]:
        app.include_router(router, dependencies=keyed)

    app.openapi = lambda: _openapi_with_request_bodies(app)  # type: ignore[method-assign]

    @app.get("/openapi.json", dependencies=keyed, include_in_schema=False)
    async def openapi_schema() -> JSONResponse:
        return JSONResponse(app.openapi())

    @app.get("/docs", dependencies=keyed, include_in_schema=False)
    async def swagger_ui() -> Response:
        return get_swagger_ui_html(openapi_url="/openapi.json", title="clearserve")

    @app.get("/redoc", dependencies=keyed, include_in_schema=False)
    async def redoc() -> Response:
        return get_redoc_html(openapi_url="/openapi.json", title="clearserve")

    @app.get("/v1/models", dependencies=keyed)
    async def list_models() -> dict:
        return {"object": "list", "data": [_model_card(client, created)]}

    @app.get("/v1/models/{model:path}", dependencies=keyed)
    async def get_model(model: str) -> dict:
        if model != client.limits.served_model_name:
            raise model_not_found(model)
        return _model_card(client, created)

    @app.get("/health")
    async def health() -> JSONResponse:
        # Alive means every process answers its control thread, even in the middle of a long step; a failed
        # engine replica's processes are no longer asked (the others serve: "degraded", still 200).
        replies = await client.control("ping", timeout=HEALTH_TIMEOUT_S)
        silent = [role for role in client.roles if role not in replies]
        if silent:
            return JSONResponse({"status": "unhealthy", "silent": silent}, status_code=503)
        health = client.replicas.health()
        return JSONResponse(health, status_code=200 if client.replicas.alive else 503)

    @app.get("/metrics")
    async def prometheus_metrics() -> Response:
        replies = await client.control("stats", timeout=STATS_TIMEOUT_S)
        schedulers = [role for role in client.roles if is_scheduler_role(role)]  # one per engine replica
        answered = all(role in replies for role in schedulers)
        # The other frontends' request counts (this one's are its own): every request, whichever frontend.
        frontends = [r.payload[REQUEST_METRICS] for r in replies.values() if REQUEST_METRICS in r.payload]
        body = metrics.render(
            [replies[role].payload for role in schedulers] if answered else None, frontends, client.replicas
        )
        return Response(body, media_type=CONTENT_TYPE_LATEST)

    # Profiling: the frontend starts first and stops last, so its own trace covers the whole exchange. Its own
    # state answers for the server's (every process is told the same commands): 409 when already / not profiling.
    @app.post("/start_profile", dependencies=keyed)
    async def start_profile(request: Request) -> dict:
        args = await _json_args(request, limits)
        own = _profile_answer(_enabled(profiler).start())
        body = _by_role(client, await client.control("start_profile", args, PROFILE_TIMEOUT_S))
        return _refused_by_any(_with_own(client, body, own))

    @app.post("/stop_profile", dependencies=keyed)
    async def stop_profile(request: Request) -> dict:
        args = await _json_args(request, limits)
        own = _enabled(profiler)
        if not own.profiler.active:
            raise ApiError(409, f"{own.role} is not profiling")
        body = _by_role(client, await client.control("stop_profile", args, PROFILE_TIMEOUT_S))
        body = _refused_by_any(_with_own(client, body, own.stop()))
        traces = {role: (r["pid"], r["payload"]["trace"]) for role, r in body["replies"].items()}
        # Read and written off the event loop: the traces can be tens of MB.
        merged = merged_trace_path(own.config.dir or "", own.profiler.runs)
        body["merged_trace"] = await asyncio.to_thread(merge_traces, traces, merged)
        return body

    @app.get("/stats", dependencies=keyed)
    async def stats() -> dict:
        body = _by_role(client, await client.control("stats", timeout=STATS_TIMEOUT_S))
        body["engine_replicas"] = client.replicas.to_payload()
        own = client.stats()
        return body if own is None else _with_own(client, body, own)

    return HotRoutes(app, hot_endpoints(*generation), limits.max_request_body_bytes, check_key)


def _request_bodies() -> dict[str, type[BaseModel]]:
    from frontend.protocol import ChatCompletionRequest, CompletionRequest, GenerateBody
    from frontend.tokenizer_api import DetokenizeBody, TokenizeBody

    return {
        "/v1/completions": CompletionRequest,
        "/v1/chat/completions": ChatCompletionRequest,
        "/generate": GenerateBody,
        "/tokenize": TokenizeBody,
        "/detokenize": DetokenizeBody,
    }


def _openapi_with_request_bodies(app: FastAPI) -> dict:
    """FastAPI's schema, plus each endpoint's request body: the endpoints parse their bodies themselves
    (to answer errors in OpenAI's shape), so FastAPI cannot see them. Clients' generators and the API fuzzing
    test (tests/test_api_fuzz.py) read the bodies from here."""
    if app.openapi_schema is None:
        schema = get_openapi(title=app.title, version=app.version, routes=app.routes)
        components = schema.setdefault("components", {}).setdefault("schemas", {})
        for path, model in _request_bodies().items():
            body = model.model_json_schema(ref_template="#/components/schemas/{model}")
            components.update(body.pop("$defs", {}))
            components[model.__name__] = body
            schema["paths"][path]["post"]["requestBody"] = {
                "required": True,
                "content": {"application/json": {"schema": {"$ref": f"#/components/schemas/{model.__name__}"}}},
            }
        app.openapi_schema = schema
    return app.openapi_schema


def _model_card(client: EngineClient, created: int) -> dict:
    limits = client.limits
    return {
        "id": limits.served_model_name,
        "object": "model",
        "created": created,
        "owned_by": "clearserve",
        "root": limits.model_root,
        "parent": None,
        "max_model_len": limits.max_model_len,
    }


def _by_role(client: EngineClient, replies: dict[str, ControlReply]) -> dict:
    return {
        "replies": {role: {"pid": r.pid, "payload": r.payload} for role, r in replies.items()},
        "silent": [role for role in client.roles if role not in replies],
    }


def _with_own(client: EngineClient, body: dict, payload: dict) -> dict:
    """Add this process's own answer, under its role, to the other processes' replies."""
    body["replies"][client.role] = {"pid": os.getpid(), "payload": payload}
    return body


def _enabled(profiler: ProcessProfiler | None) -> ProcessProfiler:
    if profiler is None:
        raise ApiError(400, NOT_ENABLED)
    return profiler


def _profile_answer(payload: dict) -> dict:
    if "error" in payload:
        raise ApiError(payload["status"], payload["error"])
    return payload


def _refused_by_any(body: dict) -> dict:
    """The body, unless a process refused the command: then the refusal, naming each process that did."""
    refusals = {role: r["payload"] for role, r in body["replies"].items() if "error" in r["payload"]}
    if refusals:
        status = max(payload["status"] for payload in refusals.values())
        raise ApiError(status, "; ".join(f"{role}: {payload['error']}" for role, payload in sorted(refusals.items())))
    return body


async def _json_args(request: Request, limits: HttpLimits) -> dict:
    if not await request.body():
        return {}
    return (await parse_body(request, JsonObject, limits)).root  # bounded, and off the loop when large


async def _client_gone(_: Request, __: ClientDisconnected | ClientDisconnect) -> Response:
    # Nobody is left to read this; 499 (nginx's "client closed request") keeps access logs honest.
    return Response(status_code=499)
