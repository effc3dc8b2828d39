"""POST /generate: the engine's own interface, for benchmarks that want every stage time.

stream:      one JSON line per output  {"token_ids", "text", "sampled_time", "detokenized_time",
                                        "streamed_time", "finish_reason"}
             then a summary line       {"rid", "prompt_tokens", "num_cached_tokens", "completion_tokens",
                                        "finish_reason", "times": {arrival, tokenized, queued, first_scheduled}}
no stream:   the summary, plus "text", "token_ids" and per-token "sampled_times" and "streamed_times"
"""

from __future__ import annotations

import time
from collections.abc import AsyncGenerator

from fastapi import APIRouter, Request, Response
from fastapi.responses import JSONResponse

from common.messages import GenerateRequest, RequestOutput
from frontend.body_parse import parse_body
from frontend.engine_client import EngineClient
from frontend.errors import ApiError, error_body
from frontend.generation import Generation
from frontend.limits import HttpLimits
from frontend.metrics import FrontendMetrics
from frontend.protocol import GenerateBody, check_prompt_chars
from frontend.streaming import StreamingEvents, json_string, ndjson_line


def native_router(client: EngineClient, metrics: FrontendMetrics, limits: HttpLimits) -> APIRouter:
    router = APIRouter()
    max_chars = limits.prompt_chars(client.limits.max_model_len)

    @router.post("/generate")
    async def generate(request: Request) -> Response:
        arrival = time.time()
        body = await parse_body(request, GenerateBody, limits)
        prompt, prompt_ids = body.engine_prompt()
        check_prompt_chars([prompt] if prompt is not None else [], max_chars, "prompt")
        fields = body.sampling_params
        fields.check_stop_strings(limits)
        sampling = fields.sampling_params(fields.max_tokens, "max_tokens", client.limits, limits.max_logprobs)
        engine_request = GenerateRequest(0, sampling, arrival, prompt=prompt, prompt_token_ids=prompt_ids)
        generation = await Generation.start(client, engine_request, metrics, request.receive)
        if body.stream:
            return StreamingEvents(_ndjson_lines(generation), "application/x-ndjson", generation.close)
        outputs = await generation.collect(request.receive)
        return JSONResponse({**_summary(generation), **_whole(outputs)})

    return router


async def _ndjson_lines(generation: Generation) -> AsyncGenerator[bytes, None]:
    # Still one line per output (its times are what this endpoint is for), but the outputs that are ready
    # together go out in one write, as SSE chunks do. A stream that ends in an error (the server stopping,
    # a timeout) ends with an error line, {"error": {...}}, instead of the summary.
    try:
        async for batch in generation.output_batches():
            yield "".join(map(output_line, batch)).encode()
    except ApiError as exc:
        yield ndjson_line(error_body(exc))
        return
    yield ndjson_line(_summary(generation))


def output_line(o: RequestOutput) -> str:
    """One output's NDJSON line, the same text json.dumps would write (compact), built without an encoder:
    this runs once per output of every stream. Times are finite floats, whose repr is their JSON."""
    finish = "null" if o.finish_reason is None else json_string(o.finish_reason)
    return (
        f'{{"token_ids":[{",".join(map(str, o.token_ids))}],"text":{json_string(o.text)},'
        f'"sampled_time":{step_time_text(o.sampled_time)},"detokenized_time":{step_time_text(o.detokenized_time)},'
        f'"streamed_time":{o.streamed_time!r},"finish_reason":{finish}}}\n'
    )


# A float's repr (its JSON) costs about a microsecond, as much as the rest of a line. Every output of one step
# has the same sampled and detokenized times (OutputBatch), so each is written once for all of the step's
# streams; a streamed time is its own write's, and is not kept.
_STEP_TIME_TEXTS: dict[float, str] = {}
MAX_STEP_TIME_TEXTS = 1024  # steps' worth of times kept: the outputs still in streams' queues are a few steps


def step_time_text(t: float) -> str:
    text = _STEP_TIME_TEXTS.get(t)
    if text is None:
        if len(_STEP_TIME_TEXTS) >= MAX_STEP_TIME_TEXTS:
            _STEP_TIME_TEXTS.clear()
        text = _STEP_TIME_TEXTS[t] = repr(t)
    return text


def _summary(generation: Generation) -> dict:
    return {
        "rid": generation.rid,
        "prompt_tokens": generation.accepted.prompt_tokens,
        "num_cached_tokens": generation.num_cached_tokens,
        "completion_tokens": generation.completion_tokens,
        "finish_reason": generation.finish_reason,
        "times": generation.stage_times(),
    }


def _whole(outputs: list[RequestOutput]) -> dict:
    # Tokens that arrived in one output share its times.
    return {
        "text": "".join(o.text for o in outputs),
        "token_ids": [t for o in outputs for t in o.token_ids],
        "sampled_times": [o.sampled_time for o in outputs for _ in o.token_ids],
        "streamed_times": [o.streamed_time for o in outputs for _ in o.token_ids],
    }
