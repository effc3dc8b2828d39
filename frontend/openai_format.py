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
from dataclasses import dataclass

from common.messages import Logprobs


def _finite(value: float) -> float | None:
    """JSON has no NaN: the first prompt token's logprob (it has none) is null, as OpenAI answers."""
    return value if math.isfinite(value) else None


@dataclass(slots=True)
class CompletionFormat:
    id: str  # "cmpl-<rid>"
    created: int
    model: str

    def _head(self) -> dict:
        return {"id": self.id, "object": "text_completion", "created": self.created, "model": self.model}

    def opening_chunk(self, index: int) -> dict | None:
        return None

    def choice(self, index: int, text: str, finish_reason: str | None, logprobs: dict | None = None) -> dict:
        return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}

    def chunk(self, index: int, text: str, finish_reason: str | None, logprobs: dict | None = None) -> dict:
        return {**self._head(), "choices": [self.choice(index, text, finish_reason, logprobs)]}

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

    def _head(self, object: str) -> dict:
        return {"id": self.id, "object": object, "created": self.created, "model": self.model}

    def opening_chunk(self, index: int) -> dict | None:
        return self._delta_chunk(index, {"role": "assistant", "content": ""}, None, None)

    def _delta_chunk(self, index: int, delta: dict, finish_reason: str | None, logprobs: dict | None) -> dict:
        return {
            **self._head("chat.completion.chunk"),
            "choices": [{"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}],
        }

    def chunk(self, index: int, text: str, finish_reason: str | None, logprobs: dict | None = None) -> dict:
        return self._delta_chunk(index, {"content": text} if text else {}, finish_reason, logprobs)

    def choice(self, index: int, text: str, finish_reason: str | None, logprobs: dict | None = None) -> dict:
        message = {"role": "assistant", "content": text}
        return {"index": index, "message": message, "logprobs": logprobs, "finish_reason": finish_reason}

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
