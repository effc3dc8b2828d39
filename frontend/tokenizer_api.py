"""POST /tokenize, POST /detokenize and GET /version, shaped as vLLM's.

/tokenize    {"prompt": str, "add_special_tokens": true}  or  {"messages": [...], "add_generation_prompt": true,
             "continue_final_message": false, "chat_template_kwargs": {...}, "tools": [...]} (rendered as a chat
             request would be)
             -> {"count": int, "max_model_len": int, "tokens": [int], "token_strs": null}
/detokenize  {"tokens": [int]}  -> {"prompt": str}
/version     -> {"version": str}

The frontend has no tokenizer (no model knowledge): both are a request and a reply, keyed by a request
id, through tokenizer worker rid % N, like a generation.
"""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version

from fastapi import APIRouter, Request
from pydantic import model_validator
from typing_extensions import Self

from common.messages import DetokenizeRequest, RequestRejected, TextReply, TokenizeRequest
from frontend.body_parse import parse_body
from frontend.engine_client import EngineClient
from frontend.errors import ApiError, model_not_found
from frontend.limits import HttpLimits
from frontend.protocol import (
    ChatMessage,
    ChatTemplateFields,
    Int,
    Items,
    RequestBody,
    check_prompt_chars,
    refuse_unless,
)


class TokenizeBody(ChatTemplateFields):
    model: str | None = None
    prompt: str | None = None
    messages: Items[ChatMessage] | None = None
    add_special_tokens: bool | None = None  # default: true for a prompt, false for messages (vLLM's)
    return_token_strs: bool | None = False

    @model_validator(mode="after")
    def _read_messages_as_validated(self) -> Self:
        self._read_messages(self.messages)
        return self


class DetokenizeBody(RequestBody):
    model: str | None = None
    tokens: Items[Int]


def _check_model(model: str | None, client: EngineClient) -> None:
    if model is not None and model != client.limits.served_model_name:
        raise model_not_found(model)


async def _ask(client: EngineClient, request: TokenizeRequest | DetokenizeRequest) -> TextReply:
    reply = await client.ask_tokenizer(request)
    if isinstance(reply, RequestRejected):
        raise ApiError(reply.status, reply.message, param=reply.param)
    return reply


def tokenizer_router(client: EngineClient, limits: HttpLimits) -> APIRouter:
    router = APIRouter()
    max_chars = limits.prompt_chars(client.limits.max_model_len)

    @router.post("/tokenize")
    async def tokenize(request: Request) -> dict:
        body = await parse_body(request, TokenizeBody, limits)
        _check_model(body.model, client)
        refuse_unless(body.return_token_strs, (None, False), "return_token_strs", "token strings are not returned")
        if (body.prompt is None) == (body.messages is None):
            raise ApiError(400, "give exactly one of 'prompt' and 'messages'", param="prompt")
        if body.prompt is not None:
            check_prompt_chars([body.prompt], max_chars, "prompt")
            special = True if body.add_special_tokens is None else body.add_special_tokens
            ask = TokenizeRequest(0, prompt=body.prompt, add_special_tokens=special)
        else:
            messages = body.template_messages()  # as a chat request sends them
            check_prompt_chars([body.rendered_text(messages)], max_chars, "messages")
            ask = TokenizeRequest(0, chat_messages=messages, chat_options=body.chat_options())
        reply = await _ask(client, ask)
        return {
            "count": len(reply.token_ids),
            "max_model_len": client.limits.max_model_len,
            "tokens": reply.token_ids,
            "token_strs": None,
        }

    @router.post("/detokenize")
    async def detokenize(request: Request) -> dict:
        body = await parse_body(request, DetokenizeBody, limits)
        _check_model(body.model, client)
        if any(t < 0 for t in body.tokens):
            raise ApiError(400, "token ids must be non-negative", param="tokens")
        return {"prompt": (await _ask(client, DetokenizeRequest(0, list(body.tokens)))).text}

    @router.get("/version")
    async def server_version() -> dict:
        try:
            return {"version": version("clearserve")}
        except PackageNotFoundError:
            return {"version": "unknown"}

    return router
