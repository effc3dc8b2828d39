"""A reasoning model's thinking, apart from its answer (vLLM's --reasoning-parser): `reasoning_content` beside
`content` in the chat message, streamed as `reasoning_content` deltas.

    deepseek_r1   the output up to `</think>` is reasoning (DeepSeek-R1 and its distills, on Llama among others:
                  their chat template opens `<think>` in the prompt, so the output need not hold it; a leading
                  `<think>` is dropped); what follows is the answer. An output with no `</think>` was cut short
                  while thinking: all reasoning, as vLLM reads it.

The answer's text goes on to tool calling (frontend/tool_calls.py) where the request has tools.
"""

from __future__ import annotations

from dataclasses import dataclass

from frontend.streaming import partial_tag_suffix

THINK_OPEN, THINK_CLOSE = "<think>", "</think>"


@dataclass(slots=True)
class ReasoningStream:
    """One choice's text in: (reasoning, answer) pieces out, as they are known."""

    _held: str = ""  # text that may be the start of a tag
    _opened: bool = False  # the output's beginning is past (a leading <think> dropped, or none there)
    _answering: bool = False  # past </think>

    def feed(self, text: str, final: bool) -> tuple[str, str]:
        """The reasoning and the answer that `text` completes (with `final`: everything left)."""
        if self._answering:
            return "", text
        self._held += text
        if not self._opened:
            head = self._held.lstrip()
            if not final and THINK_OPEN.startswith(head) and head != THINK_OPEN:
                return "", ""  # may still become <think>
            self._held = head.removeprefix(THINK_OPEN) if head.startswith(THINK_OPEN) else self._held
            self._opened = True
        end = self._held.find(THINK_CLOSE)
        if end >= 0:
            reasoning, answer = self._held[:end], self._held[end + len(THINK_CLOSE) :]
            self._held, self._answering = "", True
            return reasoning, answer
        keep = 0 if final else partial_tag_suffix(self._held, THINK_CLOSE)
        reasoning, self._held = self._held[: len(self._held) - keep], self._held[len(self._held) - keep :]
        return reasoning, ""
