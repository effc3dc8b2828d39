"""The in-process engine: scheduler and model runner in one process, talking through the same messages."""

from offline.llm import LLM, CompletionOutput

__all__ = ["LLM", "CompletionOutput"]
