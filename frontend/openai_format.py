"""The JSON shapes of OpenAI's completion and chat completion responses, whole and streamed.

stream:  [opening chunk per choice (chat: the role)]  content chunks ...  a chunk with each choice's
         finish_reason  [usage chunk with no choices, when stream_options.include_usage]  data: [DONE]

Logprobs, per token (texts are each token decoded alone):
  completions  {"tokens": [str], "token_logprobs": [float], "top_logprobs": [{str: float}],
                "text_offset": [int]}   (echo: the prompt's tokens first, the very first one null)
  chat         {"content": [{"token", "logprob", "bytes", "top_logprobs": [{"token", "logprob", "bytes"}]}]}
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import ClassVar

from common.messages import Logprobs
from frontend.streaming import json_string, sse_event

_MARKER = "\x00text\x00"  # no real chunk text is this


def _split_at_text(event: bytes, marker: str) -> tuple[bytes, bytes]:
    """An SSE event built with `marker` as its text, cut around the marker's JSON literal: the event for any
    text is then prefix + that text's JSON literal + suffix, with no encoder call per chunk."""
    prefix, _, suffix = event.partition(json_string(marker).encode())
    return prefix, suffix


# vLLM's floor: a logprob of -inf (a token ruled out by a grammar's mask or a logit bias) as JSON can carry it.
LOGPROB_FLOOR = -9999.0


def _json_logprob(value: float) -> float | None:
    """JSON has neither NaN nor infinities: NaN, the first prompt token's logprob (it has none), is null, as
    OpenAI answers; -inf is LOGPROB_FLOOR, as vLLM answers."""
    return None if math.isnan(value) else max(value, LOGPROB_FLOOR)


def _choice(
    index: int, body: dict, logprobs: dict | None, finish_reason: str | None, stop_reason: int | str | None
) -> dict:
    """A choice of either API, whole or streamed: its index, its body (text, message or delta), then what every
    choice says after it (vLLM's stop_reason: the stop string or stop token id that ended it)."""
    return {"index": index, **body, "logprobs": logprobs, "finish_reason": finish_reason, "stop_reason": stop_reason}


@dataclass(slots=True)
class ResponseFormat:
    """What both APIs' responses share: the head of every chunk and of the whole answer, a choice's fields
    around its body, the usage chunk, and the SSE event of a plain text chunk from a template. A subclass says
    what a choice's body is (text, message, delta) and how its logprobs read."""

    id: str  # "cmpl-<rid>" / "chatcmpl-<rid>"
    created: int
    model: str
    _templates: dict = field(
        default_factory=dict, init=False, repr=False
    )  # (index, finish_reason, usage_null) -> (prefix, suffix)

    chunk_object: ClassVar[str]  # the "object" of a streamed chunk
    whole_object: ClassVar[str]  # the "object" of the whole answer

    def _whole_body(self, text: str) -> dict:
        raise NotImplementedError

    def _chunk_body(self, text: str) -> dict:
        raise NotImplementedError

    @staticmethod
    def logprobs(parts: list[Logprobs], text_offset: int) -> dict:
        """The API's logprobs of consecutive token runs (the module's docstring)."""
        raise NotImplementedError

    def opening_chunk(self, index: int) -> dict | None:
        """The chunk each choice's stream opens with, if any."""
        return None

    def choice(
        self,
        index: int,
        text: str,
        finish_reason: str | None,
        logprobs: dict | None = None,
        stop_reason: int | str | None = None,
    ) -> dict:
        """A whole answer's choice of `text`."""
        return _choice(index, self._whole_body(text), logprobs, finish_reason, stop_reason)

    def chunk(
        self,
        index: int,
        text: str,
        finish_reason: str | None,
        logprobs: dict | None = None,
        stop_reason: int | str | None = None,
    ) -> dict:
        """A streamed chunk of `text` for one choice."""
        return self._chunk_of(_choice(index, self._chunk_body(text), logprobs, finish_reason, stop_reason))

    def chunk_event(self, index: int, text: str, finish_reason: str | None, usage_null: bool = False) -> bytes:
        """The SSE event of chunk(index, text, finish_reason) without logprobs (with "usage": null added when
        `usage_null`), byte for byte as sse_event writes it, from a template: one per choice and finish reason.
        A chunk without text is written whole (a chat chunk's has no content field to cut the template at)."""
        extra = {"usage": None} if usage_null else {}
        if not text:
            return sse_event({**self.chunk(index, text, finish_reason), **extra})
        key = (index, finish_reason, usage_null)
        template = self._templates.get(key)
        if template is None:
            chunk = {**self.chunk(index, _MARKER, finish_reason), **extra}
            template = self._templates[key] = _split_at_text(sse_event(chunk), _MARKER)
        return template[0] + json_string(text).encode() + template[1]

    def usage_chunk(self, usage: dict) -> dict:
        return {**self._head(self.chunk_object), "choices": [], "usage": usage}

    def whole(self, choices: list[dict], usage: dict) -> dict:
        return {**self._head(self.whole_object), "choices": choices, "usage": usage}

    def _chunk_of(self, choice: dict) -> dict:
        return {**self._head(self.chunk_object), "choices": [choice]}

    def _head(self, object: str) -> dict:
        return {"id": self.id, "object": object, "created": self.created, "model": self.model}


@dataclass(slots=True)
class CompletionFormat(ResponseFormat):
    chunk_object: ClassVar[str] = "text_completion"
    whole_object: ClassVar[str] = "text_completion"

    def _whole_body(self, text: str) -> dict:
        return {"text": text}

    def _chunk_body(self, text: str) -> dict:
        return {"text": text}

    @staticmethod
    def logprobs(parts: list[Logprobs], text_offset: int) -> dict:
        """The legacy completions shape for consecutive token runs; offsets count from `text_offset`."""
        tokens, token_logprobs, top_logprobs, offsets = [], [], [], []
        for part in parts:
            for text, value, top_texts, top_values in zip(
                part.token_texts, part.logprobs, part.top_texts, part.top_logprobs
            ):
                tokens.append(text)
                token_logprobs.append(_json_logprob(value))
                first = math.isnan(value) and not top_texts
                top = {t: _json_logprob(v) for t, v in zip(top_texts, top_values)}
                top_logprobs.append(None if first else top)
                offsets.append(text_offset)
                text_offset += len(text)
        return {
            "tokens": tokens,
            "token_logprobs": token_logprobs,
            "top_logprobs": top_logprobs,
            "text_offset": offsets,
        }


@dataclass(slots=True)
class ChatFormat(ResponseFormat):
    chunk_object: ClassVar[str] = "chat.completion.chunk"
    whole_object: ClassVar[str] = "chat.completion"

    def _whole_body(self, text: str) -> dict:
        return {"message": {"role": "assistant", "content": text}}

    def _chunk_body(self, text: str) -> dict:
        return {"delta": {"content": text} if text else {}}

    def opening_chunk(self, index: int) -> dict | None:
        return self.delta_chunk(index, {"role": "assistant", "content": ""}, None, None)

    def delta_chunk(
        self,
        index: int,
        delta: dict,
        finish_reason: str | None,
        logprobs: dict | None = None,
        stop_reason: int | str | None = None,
    ) -> dict:
        """A chunk of any delta: the role, content, reasoning or tool calls (chat_output.py)."""
        return self._chunk_of(_choice(index, {"delta": delta}, logprobs, finish_reason, stop_reason))

    def message_choice(
        self,
        index: int,
        message: dict,
        finish_reason: str | None,
        logprobs: dict | None,
        stop_reason: int | str | None = None,
    ) -> dict:
        """A whole choice; its message may be more than content (chat_output.py: reasoning, tool calls)."""
        return _choice(index, {"message": message}, logprobs, finish_reason, stop_reason)

    @staticmethod
    def logprobs(parts: list[Logprobs], text_offset: int = 0) -> dict:
        content = []
        for part in parts:
            for text, value, top_texts, top_values in zip(
                part.token_texts, part.logprobs, part.top_texts, part.top_logprobs
            ):
                content.append(
                    {
                        "token": text,
                        "logprob": _json_logprob(value),
                        "bytes": list(text.encode()),
                        "top_logprobs": [
                            {"token": t, "logprob": _json_logprob(v), "bytes": list(t.encode())}
                            for t, v in zip(top_texts, top_values)
                        ],
                    }
                )
        return {"content": content, "refusal": None}
