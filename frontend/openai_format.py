"""The JSON shapes of OpenAI's completion and chat completion responses, whole and streamed.

stream:  [opening chunk (chat: the role)]  content chunks ...  last chunk with finish_reason
         [usage chunk with no choices, when stream_options.include_usage]  data: [DONE]
"""

from __future__ import annotations

from dataclasses import dataclass, field

from frontend.streaming import json_string, sse_event


def _split_at_text(event: bytes, marker: str) -> tuple[bytes, bytes]:
    """An SSE event built with `marker` as its text, cut around the marker's JSON literal: the event for any
    text is then prefix + that text's JSON literal + suffix, with no encoder call per chunk."""
    prefix, _, suffix = event.partition(json_string(marker).encode())
    return prefix, suffix


_MARKER = "\x00text\x00"  # no real chunk text is this


def _from_template(fmt: CompletionFormat | ChatFormat, text: str, finish_reason: str | None, usage_null: bool) -> bytes:
    key = (finish_reason, usage_null)
    template = fmt._templates.get(key)
    if template is None:
        chunk = {**fmt.chunk(_MARKER, finish_reason), **({"usage": None} if usage_null else {})}
        template = fmt._templates[key] = _split_at_text(sse_event(chunk), _MARKER)
    return template[0] + json_string(text).encode() + template[1]


@dataclass(slots=True)
class CompletionFormat:
    id: str  # "cmpl-<rid>"
    created: int
    model: str
    _templates: dict = field(
        default_factory=dict, init=False, repr=False
    )  # (finish_reason, usage_null) -> (prefix, suffix)

    def chunk_event(self, text: str, finish_reason: str | None, usage_null: bool = False) -> bytes:
        """The SSE event of chunk(text, finish_reason) (with "usage": null added when `usage_null`), byte for
        byte as sse_event writes it, from a template: one per stream and finish reason."""
        return _from_template(self, text, finish_reason, usage_null)

    def _head(self) -> dict:
        return {"id": self.id, "object": "text_completion", "created": self.created, "model": self.model}

    def opening_chunk(self) -> dict | None:
        return None

    def chunk(self, text: str, finish_reason: str | None) -> dict:
        return {
            **self._head(),
            "choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}],
        }

    def usage_chunk(self, usage: dict) -> dict:
        return {**self._head(), "choices": [], "usage": usage}

    def whole(self, text: str, finish_reason: str | None, usage: dict) -> dict:
        return {**self.chunk(text, finish_reason), "usage": usage}


@dataclass(slots=True)
class ChatFormat:
    id: str  # "chatcmpl-<rid>"
    created: int
    model: str
    _templates: dict = field(
        default_factory=dict, init=False, repr=False
    )  # (finish_reason, usage_null) -> (prefix, suffix)

    def chunk_event(self, text: str, finish_reason: str | None, usage_null: bool = False) -> bytes:
        """As CompletionFormat.chunk_event."""
        if not text:  # a chunk without text has no content field: no template
            return sse_event({**self.chunk(text, finish_reason), **({"usage": None} if usage_null else {})})
        return _from_template(self, text, finish_reason, usage_null)

    def _head(self, object: str) -> dict:
        return {"id": self.id, "object": object, "created": self.created, "model": self.model}

    def _delta_chunk(self, delta: dict, finish_reason: str | None) -> dict:
        return {
            **self._head("chat.completion.chunk"),
            "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}],
        }

    def opening_chunk(self) -> dict | None:
        return self._delta_chunk({"role": "assistant", "content": ""}, None)

    def chunk(self, text: str, finish_reason: str | None) -> dict:
        return self._delta_chunk({"content": text} if text else {}, finish_reason)

    def usage_chunk(self, usage: dict) -> dict:
        return {**self._head("chat.completion.chunk"), "choices": [], "usage": usage}

    def whole(self, text: str, finish_reason: str | None, usage: dict) -> dict:
        message = {"role": "assistant", "content": text}
        return {
            **self._head("chat.completion"),
            "choices": [{"index": 0, "message": message, "logprobs": None, "finish_reason": finish_reason}],
            "usage": usage,
        }


ResponseFormat = CompletionFormat | ChatFormat
