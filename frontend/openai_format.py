"""The JSON shapes of OpenAI's completion and chat completion responses, whole and streamed.

stream:  [opening chunk (chat: the role)]  content chunks ...  last chunk with finish_reason
         [usage chunk with no choices, when stream_options.include_usage]  data: [DONE]
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(slots=True)
class CompletionFormat:
    id: str  # "cmpl-<rid>"
    created: int
    model: str

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
