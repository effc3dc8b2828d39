"""A chat choice's text as its answer shows it: the model's thinking (frontend/reasoning.py, with
--reasoning-parser), then content and tool calls (frontend/tool_calls.py, for a request with tools). Streamed or
whole, one reader per choice, so both answers say the same:

    text ──ReasoningStream──▶ reasoning_content
                        └──▶ answer ──ToolCallStream──▶ content, tool_calls      (each stage only where asked)
"""

from __future__ import annotations

from dataclasses import dataclass

from frontend.reasoning import ReasoningStream
from frontend.tool_calls import ToolCallStream


@dataclass(slots=True)
class ChatOutputReader:
    reasoning: ReasoningStream | None
    tools: ToolCallStream | None

    def feed(self, text: str, final: bool) -> list[dict]:
        """The chat deltas `text` completes (with `final`: everything left)."""
        deltas: list[dict] = []
        answer = text
        if self.reasoning is not None:
            thought, answer = self.reasoning.feed(text, final)
            if thought:
                deltas.append({"reasoning_content": thought})
        if self.tools is not None:
            deltas += self.tools.feed(answer, final)
        elif answer:
            deltas.append({"content": answer})
        return deltas

    def finish_reason(self, engine_reason: str) -> str:
        return engine_reason if self.tools is None else self.tools.finish_reason(engine_reason)

    def message(self, text: str) -> dict:
        """The whole choice's message, from its whole text."""
        deltas = self.feed(text, final=True)
        content = "".join(d["content"] for d in deltas if "content" in d)
        calls = self.tools.calls if self.tools is not None else []
        message: dict = {"role": "assistant", "content": (content or None) if calls else content}
        if self.reasoning is not None:
            message["reasoning_content"] = "".join(d.get("reasoning_content", "") for d in deltas) or None
        if calls:
            message["tool_calls"] = calls
        return message
