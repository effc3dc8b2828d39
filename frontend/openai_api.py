"""POST /v1/completions and /v1/chat/completions: OpenAI's protocol over the engine client.

Each endpoint: stamp arrival, check the body, submit one engine request per choice (prompts times n),
wait for the verdicts (headers are sent only after the engine accepted, so a rejection gets its own
status), then stream SSE or answer once.
"""

from __future__ import annotations

import time
from collections.abc import AsyncGenerator
from dataclasses import replace
from typing import TypeVar

from fastapi import APIRouter, Request, Response
from fastapi.responses import JSONResponse

from common.messages import DetokenizeRequest, GenerateRequest, Logprobs, RequestOutput, RequestRejected
from common.sampling_params import SamplingParams
from frontend.body_parse import parse_body
from frontend.chat_output import ChatOutputReader
from frontend.choices import Choices
from frontend.engine_client import EngineClient
from frontend.errors import ApiError, error_body
from frontend.limits import HttpLimits
from frontend.metrics import FrontendMetrics
from frontend.openai_format import ChatFormat, CompletionFormat, ResponseFormat
from frontend.protocol import ChatCompletionRequest, CompletionRequest, OpenAIFields, check_prompt_chars
from frontend.reasoning import ReasoningStream
from frontend.streaming import SSE_DONE, StreamingEvents, sse_event
from frontend.tool_calls import ToolCallStream

OpenAIBody = TypeVar("OpenAIBody", CompletionRequest, ChatCompletionRequest)


def openai_router(
    client: EngineClient,
    metrics: FrontendMetrics,
    limits: HttpLimits,
    tool_call_parser: str | None = None,
    reasoning_parser: str | None = None,
) -> APIRouter:
    """tool_call_parser: how "auto" tool choice reads calls from the text (frontend/tool_calls.py); None: off.
    reasoning_parser: how a chat answer's thinking is told apart (frontend/reasoning.py); None: it is content."""
    router = APIRouter()
    max_chars = limits.prompt_chars(client.limits.max_model_len)
    max_prompt_tokens = limits.request_prompt_tokens(client.limits.max_model_len, client.limits.max_num_seqs)

    async def checked_body(request: Request, model: type[OpenAIBody]) -> OpenAIBody:
        """Either endpoint's body, with the checks both make first, in this order (the first failing one answers)."""
        body = await parse_body(request, model, limits)
        body.check_common(client.limits)
        body.check_unsupported()
        body.check_stop_strings(limits)
        return body

    @router.post("/v1/completions")
    async def completions(request: Request) -> Response:
        arrival = time.time()
        body = await checked_body(request, CompletionRequest)
        prompts = body.engine_prompts()
        kept = body.prompt_tokens_kept(client.limits)
        check_prompt_chars([text for text, _ in prompts if text is not None], max_chars, "prompt")
        sampling = body.sampling_params(body.max_tokens, "max_tokens", client.limits, limits.max_logprobs)
        prompt_fields = [
            {"prompt": text, "prompt_token_ids": ids, "add_special_tokens": body.add_special_tokens}
            for text, ids in prompts
        ]
        requests = choice_requests(body, sampling, arrival, kept, prompt_fields)
        echoes = None
        if body.echo:
            texts = [text if text is not None else await _detokenize(client, ids) for text, ids in prompts]
            echoes = [text for text in texts for _ in range(body.num_choices)]
        return await _respond(request, body, requests, "prompt", "cmpl", CompletionFormat, echoes, None)

    @router.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        arrival = time.time()
        body = await checked_body(request, ChatCompletionRequest)
        messages = body.engine_messages()
        chat_options = body.chat_options()
        tool_plan = body.tool_plan(tool_call_parser)
        kept = body.prompt_tokens_kept(client.limits)
        check_prompt_chars([body.rendered_text(messages)], max_chars, "messages")
        sampling = body.tool_sampling_params(client.limits, tool_plan, limits.max_logprobs)
        prompt_fields = [{"chat_messages": messages, "chat_options": chat_options}]
        requests = choice_requests(body, sampling, arrival, kept, prompt_fields)
        readers = None
        if tool_plan is not None or reasoning_parser is not None:
            readers = [
                ChatOutputReader(
                    None if reasoning_parser is None else ReasoningStream(),
                    None if tool_plan is None else ToolCallStream(tool_plan),
                )
                for _ in requests
            ]
        return await _respond(request, body, requests, "messages", "chatcmpl", ChatFormat, None, readers)

    async def _respond(
        request: Request,
        body: OpenAIFields,
        requests: list[GenerateRequest],
        prompt_field: str,
        id_prefix: str,
        format_type: type[ResponseFormat],
        echoes: list[str] | None,
        readers: list[ChatOutputReader] | None,
    ) -> Response:
        """prompt_field: the body's field of the prompts; readers: each chat choice's reader of reasoning and tool
        calls, where the server or the request asks."""
        n = body.num_choices
        choices = await Choices.start(client, requests, n, metrics, request.receive, max_prompt_tokens, prompt_field)
        fmt = format_type(f"{id_prefix}-{choices.rid}", int(requests[0].arrival_time), client.limits.served_model_name)
        with_logprobs = requests[0].sampling.logprobs is not None
        if body.stream:
            chunks = _sse_chunks(
                choices, fmt, body.include_usage, with_logprobs, echoes, body.continuous_usage, readers
            )
            return StreamingEvents(chunks, "text/event-stream", choices.close)
        outputs = await choices.collect(request.receive)
        whole = [
            _whole_choice(fmt, i, outs, with_logprobs, None if echoes is None else echoes[i])
            if readers is None
            else _whole_read_choice(fmt, i, outs, with_logprobs, readers[i])
            for i, outs in enumerate(outputs)
        ]
        return JSONResponse(fmt.whole(whole, choices.usage()))

    return router


def choice_requests(
    body: OpenAIFields, sampling: SamplingParams, arrival: float, kept: int | None, prompt_fields: list[dict]
) -> list[GenerateRequest]:
    """One engine request per choice: each prompt (its GenerateRequest fields) `n` times, prompt by prompt."""
    return [
        GenerateRequest(
            0,
            sample_params(sampling, j),
            arrival,
            truncate_prompt_tokens=kept,
            priority=body.priority,
            cache_salt=body.cache_salt,
            **fields,
        )
        for fields in prompt_fields
        for j in range(body.num_choices)
    ]


def sample_params(sampling: SamplingParams, index: int) -> SamplingParams:
    """The parameters of a prompt's `index`-th sample: a seeded request's samples differ by their seeds."""
    if index == 0 or sampling.seed is None:
        return replace(sampling)
    return replace(sampling, seed=(sampling.seed + index) % 2**63)


async def _detokenize(client: EngineClient, ids: list[int]) -> str:
    reply = await client.ask_tokenizer(DetokenizeRequest(0, ids))
    if isinstance(reply, RequestRejected):
        raise ApiError(reply.status, reply.message, param="prompt")
    return reply.text


def _logprob_parts(outputs: list[RequestOutput], echo: bool) -> list[Logprobs]:
    parts = [outputs[0].prompt_logprobs] if echo and outputs and outputs[0].prompt_logprobs is not None else []
    return parts + [o.logprobs for o in outputs if o.logprobs is not None]


def _whole_choice(
    fmt: ResponseFormat, index: int, outputs: list[RequestOutput], with_logprobs: bool, echo: str | None
) -> dict:
    text = (echo or "") + "".join(o.text for o in outputs)
    logprobs = fmt.logprobs(_logprob_parts(outputs, echo is not None), 0) if with_logprobs else None
    finish_reason = outputs[-1].finish_reason if outputs else None
    return fmt.choice(index, text, finish_reason, logprobs, outputs[-1].stop_reason if outputs else None)


def _whole_read_choice(
    fmt: ResponseFormat, index: int, outputs: list[RequestOutput], with_logprobs: bool, reader: ChatOutputReader
) -> dict:
    assert isinstance(fmt, ChatFormat)
    message = reader.message("".join(o.text for o in outputs))
    logprobs = fmt.logprobs(_logprob_parts(outputs, False), 0) if with_logprobs else None
    finish_reason = outputs[-1].finish_reason if outputs else None
    reason = reader.finish_reason(finish_reason) if finish_reason is not None else None
    return fmt.message_choice(index, message, reason, logprobs, outputs[-1].stop_reason if outputs else None)


async def _sse_chunks(
    choices: Choices,
    fmt: ResponseFormat,
    include_usage: bool,
    with_logprobs: bool,
    echoes: list[str] | None,
    continuous_usage: bool = False,
    readers: list[ChatOutputReader] | None = None,
) -> AsyncGenerator[bytes, None]:
    """The stream's events; one that ends in an error (the server stopping, a timeout) ends with an error
    event and [DONE], as vLLM's do, so a client never waits on a silent connection. readers: each chat choice's
    reader of reasoning and tool calls, where asked."""
    try:
        async for chunk in _sse_events(choices, fmt, include_usage, with_logprobs, echoes, continuous_usage, readers):
            yield chunk
    except ApiError as exc:
        yield sse_event(error_body(exc))
        yield SSE_DONE


async def _sse_events(
    choices: Choices,
    fmt: ResponseFormat,
    include_usage: bool,
    with_logprobs: bool,
    echoes: list[str] | None,
    continuous_usage: bool,
    readers: list[ChatOutputReader] | None,
) -> AsyncGenerator[bytes, None]:
    def extra() -> dict:
        # With include_usage, OpenAI sends "usage": null on every chunk but the last one; with vLLM's
        # continuous_usage_stats too, every chunk has the usage so far.
        if continuous_usage:
            return {"usage": choices.usage()}
        return {"usage": None} if include_usage else {}

    for index in range(len(choices.generations)):
        opening = fmt.opening_chunk(index)
        if opening is not None:
            yield sse_event({**opening, **extra()})
    offsets = [0] * len(choices.generations)  # completions' text_offset: characters of tokens sent so far
    echoed = [echoes is None] * len(choices.generations)
    async for index, batch in choices.batches():
        text = "".join(output.text for output in batch)
        parts = _logprob_parts(batch, not echoed[index])
        if not echoed[index]:
            text = echoes[index] + text
            echoed[index] = True
        logprobs = None
        if with_logprobs and parts:
            logprobs = fmt.logprobs(parts, offsets[index])
            offsets[index] += sum(len(t) for part in parts for t in part.token_texts)
        finish_reason, stop_reason = batch[-1].finish_reason, batch[-1].stop_reason
        if readers is not None:  # a chat whose text is read: reasoning, content and tool-call deltas
            assert isinstance(fmt, ChatFormat)
            deltas = readers[index].feed(text, final=finish_reason is not None)
            reason = None if finish_reason is None else readers[index].finish_reason(finish_reason)
            if not deltas and (reason is not None or logprobs is not None):
                deltas = [{}]
            for k, delta in enumerate(deltas):
                last = k == len(deltas) - 1
                chunk = fmt.delta_chunk(
                    index, delta, reason if last else None, logprobs if k == 0 else None, stop_reason if last else None
                )
                yield sse_event({**chunk, **extra()})
        elif logprobs is not None or stop_reason is not None or (continuous_usage and (text or finish_reason)):
            yield sse_event({**fmt.chunk(index, text, finish_reason, logprobs, stop_reason), **extra()})
        elif text or finish_reason:  # tokens still held back by the detokenizer make no chunk
            yield fmt.chunk_event(index, text, finish_reason, usage_null=include_usage)
    if include_usage:
        yield sse_event(fmt.usage_chunk(choices.usage()))
    yield SSE_DONE
