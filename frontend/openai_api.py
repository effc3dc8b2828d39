"""POST /v1/completions and /v1/chat/completions: OpenAI's protocol over the engine client.

Each endpoint: stamp arrival, check the body, submit, wait for the verdict (headers are sent only
after the engine accepted, so a rejection gets its own status), then stream SSE or answer once.
"""

from __future__ import annotations

import time
from collections.abc import AsyncGenerator

from fastapi import APIRouter, Request, Response
from fastapi.responses import JSONResponse

from common.messages import GenerateRequest
from frontend.engine_client import EngineClient
from frontend.generation import Generation
from frontend.metrics import FrontendMetrics
from frontend.openai_format import ChatFormat, CompletionFormat, ResponseFormat
from frontend.protocol import ChatCompletionRequest, CompletionRequest, OpenAIFields, parse_body
from frontend.streaming import SSE_DONE, StreamingEvents, sse_event


def openai_router(client: EngineClient, metrics: FrontendMetrics) -> APIRouter:
    router = APIRouter()

    @router.post("/v1/completions")
    async def completions(request: Request) -> Response:
        arrival = time.time()
        body = await parse_body(request, CompletionRequest)
        body.check_common(client.limits)
        body.check_unsupported()
        prompt, prompt_ids = body.engine_prompt()
        sampling = body.sampling_params(body.max_tokens, "max_tokens", client.limits)
        engine_request = GenerateRequest(0, sampling, arrival, prompt=prompt, prompt_token_ids=prompt_ids)
        return await _respond(request, body, engine_request, "cmpl", CompletionFormat)

    @router.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        arrival = time.time()
        body = await parse_body(request, ChatCompletionRequest)
        body.check_common(client.limits)
        body.check_unsupported()
        messages = body.engine_messages()
        sampling = body.sampling_params(body.requested_max_tokens(), body.max_tokens_field(), client.limits)
        engine_request = GenerateRequest(0, sampling, arrival, chat_messages=messages)
        return await _respond(request, body, engine_request, "chatcmpl", ChatFormat)

    async def _respond(
        request: Request,
        body: OpenAIFields,
        engine_request: GenerateRequest,
        id_prefix: str,
        format_type: type[ResponseFormat],
    ) -> Response:
        generation = await Generation.start(client, engine_request, metrics, request.receive)
        fmt = format_type(
            f"{id_prefix}-{generation.rid}", int(engine_request.arrival_time), client.limits.served_model_name
        )
        if body.stream:
            chunks = _sse_chunks(generation, fmt, body.include_usage)
            return StreamingEvents(chunks, "text/event-stream", generation.close)
        outputs = await generation.collect(request.receive)
        text = "".join(output.text for output in outputs)
        return JSONResponse(fmt.whole(text, generation.finish_reason, generation.usage()))

    return router


async def _sse_chunks(generation: Generation, fmt: ResponseFormat, include_usage: bool) -> AsyncGenerator[bytes, None]:
    # With include_usage, OpenAI sends "usage": null on every chunk but the last one.
    extra = {"usage": None} if include_usage else {}
    opening = fmt.opening_chunk()
    if opening is not None:
        yield sse_event({**opening, **extra})
    async for batch in generation.output_batches():
        text = "".join(output.text for output in batch)
        finish_reason = batch[-1].finish_reason
        if text or finish_reason:  # tokens still held back by the detokenizer make no chunk
            yield fmt.chunk_event(text, finish_reason, usage_null=include_usage)
    if include_usage:
        yield sse_event(fmt.usage_chunk(generation.usage()))
    yield SSE_DONE
