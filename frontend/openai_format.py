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

from common.messages import Logprobs
from frontend.streaming import json_string, sse_event

_MARKER = "\x00text\x00"  # no real chunk text is this


def _split_at_text(event: bytes, marker: str) -> tuple[bytes, bytes]:
    """An SSE event built with `marker` as its text, cut around the marker's JSON literal: the event for any
    text is then prefix + that text's JSON literal + suffix, with no encoder call per chunk."""
    prefix, _, suffix = event.partition(json_string(marker).encode())
    return prefix, suffix


def _from_template(
    fmt: CompletionFormat | ChatFormat, index: int, text: str, finish_reason: str | None, usage_null: bool
) -> bytes:
    key = (index, finish_reason, usage_null)
    template = fmt._templates.get(key)
    if template is None:
        chunk = {**fmt.chunk(index, _MARKER, finish_reason), **({"usage": None} if usage_null else {})}
        template = fmt._templates[key] = _split_at_text(sse_event(chunk), _MARKER)
    return template[0] + json_string(text).encode() + template[1]


def _finite(value: float) -> float | None:
    """JSON has no NaN: the first prompt token's logprob (it has none) is null, as OpenAI answers."""
    return value if math.isfinite(value) else None


def _choice(
    index: int, body: dict, logprobs: dict | None, finish_reason: str | None, stop_reason: int | str | None
) -> dict:
    """A choice of either API, whole or streamed: its index, its body (text, message or delta), then what every
    choice says after it (vLLM's stop_reason: the stop string or stop token id that ended it)."""
    return {"index": index, **body, "logprobs": logprobs, "finish_reason": finish_reason, "stop_reason": stop_reason}


@dataclass(slots=True)
class CompletionFormat:
    id: str  # "cmpl-<rid>"
    created: int
    model: str
    _templates: dict = field(
        default_factory=dict, init=False, repr=False
    )  # (finish_reason, usage_null) -> (prefix, suffix)

    def chunk_event(self, index: int, text: str, finish_reason: str | None, usage_null: bool = False) -> bytes:
        """The SSE event of chunk(index, text, finish_reason) without logprobs (with "usage": null added when
        `usage_null`), byte for byte as sse_event writes it, from a template: one per choice and finish reason."""
        return _from_template(self, index, text, finish_reason, usage_null)

    def _head(self) -> dict:
        return {"id": self.id, "object": "text_completion", "created": self.created, "model": self.model}

    def opening_chunk(self, index: int) -> dict | None:
        return None

    def choice(
        self,
        index: int,
        text: str,
        finish_reason: str | None,
        logprobs: dict | None = None,
        stop_reason: int | str | None = None,
    ) -> dict:
        return _choice(index, {"text": text}, logprobs, finish_reason, stop_reason)

    def chunk(
        self,
        index: int,
        text: str,
        finish_reason: str | None,
        logprobs: dict | None = None,
        stop_reason: int | str | None = None,
    ) -> dict:
        return {**self._head(), "choices": [self.choice(index, text, finish_reason, logprobs, stop_reason)]}

    def usage_chunk(self, usage: dict) -> dict:
        return {**self._head(), "choices": [], "usage": usage}

    def whole(self, choices: list[dict], usage: dict) -> dict:
        return {**self._head(), "choices": choices, "usage": usage}

    @staticmethod
    def logprobs(parts: list[Logprobs], text_offset: int) -> dict:
        """The legacy completions shape for consecutive token runs; offsets count from `text_offset`."""
        tokens, token_logprobs, top_logprobs, offsets = [], [], [], []
        for part in parts:
            for text, value, top_texts, top_values in zip(
                part.token_texts, part.logprobs, part.top_texts, part.top_logprobs
            ):
                tokens.append(text)
                token_logprobs.append(_finite(value))
                first = _finite(value) is None and not top_texts
                top_logprobs.append(None if first else dict(zip(top_texts, top_values)))
                offsets.append(text_offset)
                text_offset += len(text)
        return {
            "tokens": tokens,
            "token_logprobs": token_logprobs,
            "top_logprobs": top_logprobs,
            "text_offset": offsets,
        }


@dataclass(slots=True)
class ChatFormat:
    id: str  # "chatcmpl-<rid>"
    created: int
    model: str
    _templates: dict = field(
        default_factory=dict, init=False, repr=False
    )  # (finish_reason, usage_null) -> (prefix, suffix)

    def chunk_event(self, index: int, text: str, finish_reason: str | None, usage_null: bool = False) -> bytes:
        """As CompletionFormat.chunk_event."""
        if not text:  # a chunk without text has no content field: no template
            return sse_event({**self.chunk(index, text, finish_reason), **({"usage": None} if usage_null else {})})
        return _from_template(self, index, text, finish_reason, usage_null)

    def _head(self, object: str) -> dict:
        return {"id": self.id, "object": object, "created": self.created, "model": self.model}

    def opening_chunk(self, index: int) -> dict | None:
        return self.delta_chunk(index, {"role": "assistant", "content": ""}, None, None)

    def chunk(
        self,
        index: int,
        text: str,
        finish_reason: str | None,
        logprobs: dict | None = None,
        stop_reason: int | str | None = None,
    ) -> dict:
        return self.delta_chunk(index, {"content": text} if text else {}, finish_reason, logprobs, stop_reason)

    def delta_chunk(
        self,
        index: int,
        delta: dict,
        finish_reason: str | None,
        logprobs: dict | None = None,
        stop_reason: int | str | None = None,
    ) -> dict:
        """A chunk of any delta: the role, content, reasoning or tool calls (chat_output.py)."""
        choice = _choice(index, {"delta": delta}, logprobs, finish_reason, stop_reason)
        return {**self._head("chat.completion.chunk"), "choices": [choice]}

    def choice(
        self,
        index: int,
        text: str,
        finish_reason: str | None,
        logprobs: dict | None = None,
        stop_reason: int | str | None = None,
    ) -> dict:
        return self.message_choice(index, {"role": "assistant", "content": text}, finish_reason, logprobs, stop_reason)

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

    def usage_chunk(self, usage: dict) -> dict:
        return {**self._head("chat.completion.chunk"), "choices": [], "usage": usage}

    def whole(self, choices: list[dict], usage: dict) -> dict:
        return {**self._head("chat.completion"), "choices": choices, "usage": usage}

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
                        "logprob": value,
                        "bytes": list(text.encode()),
                        "top_logprobs": [
                            {"token": t, "logprob": v, "bytes": list(t.encode())} for t, v in zip(top_texts, top_values)
                        ],
                    }
                )
        return {"content": content, "refusal": None}


ResponseFormat = CompletionFormat | ChatFormat
