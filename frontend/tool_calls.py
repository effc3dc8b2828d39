"""Tool calling on chat completions: OpenAI's `tools` and `tool_choice`, as vLLM serves them.

    tool_choice                      the output                                  the answer
    "none" (or no tools)             text                                        content
    {"type": "function",             constrained to that function's parameters   one call of it, the output its
     "function": {"name": N}}        schema (structured output: any model)       arguments; finish "stop"
    "required"                       constrained to a JSON list of calls,        those calls (streamed: each
                                     [{"name": ..., "parameters": {...}}, ...]   name, then its arguments as
                                                                                 written); finish "tool_calls"
    "auto" (the default with tools)  text in the model's own call format (its    the text before the calls, and
                                     chat template is given the tools), read by  the calls; finish "tool_calls"
                                     --tool-call-parser                          when it made any

The tools always reach the chat template (`ChatTemplateOptions.tools`). A choice's text goes through one
ToolCallStream whether it is streamed (fed each delta) or not (fed the whole text once: chat_output.py), so both
answers say the same. Parsers:
- "hermes": `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, the format of Hermes (3 on Llama 3.1
  among them), Qwen 2.5 / 3 and SmolLM3's templates; text outside the tags is content.
- "llama3_json": Llama 3.1 / 3.2 Instruct's JSON calls, the whole output `{"name": ..., "parameters": {...}}`
  (after `<|python_tag|>` or not; several joined by ";"); an output that does not begin so is content.
"""

from __future__ import annotations

import json
import re
import secrets
from dataclasses import dataclass, field
from typing import Any, Literal

from common.sampling_params import StructuredOutput
from frontend.errors import ApiError
from frontend.streaming import partial_tag_suffix

HERMES_OPEN, HERMES_CLOSE = "<tool_call>", "</tool_call>"
LLAMA_PYTHON_TAG = "<|python_tag|>"

ToolMode = Literal["named", "required", "auto"]


@dataclass(frozen=True, slots=True)
class ToolPlan:
    """How a request's tool calls are made (the table above); None where the model just writes text."""

    mode: ToolMode
    function: str = ""  # "named": the function called
    structured: StructuredOutput | None = None  # "named" and "required": the grammar the output follows
    parser: str = ""  # "auto": one of TOOL_CALL_PARSERS


def plan_tools(
    tools: list[dict] | None, tool_choice: str | dict | None, parallel_tool_calls: bool | None, parser: str | None
) -> ToolPlan | None:
    """The request's plan, checked. tools: OpenAI's function definitions; parser: the server's
    --tool-call-parser (None: "auto" is not served)."""
    if not tools:
        if tool_choice not in (None, "none"):
            raise ApiError(400, "tool_choice needs tools to choose from", param="tool_choice")
        return None
    functions = {tool["function"]["name"]: tool["function"] for tool in tools}
    if len(functions) < len(tools):
        raise ApiError(400, "tool names must be unique", param="tools")
    if tool_choice == "none":
        return None
    if isinstance(tool_choice, dict):
        name = tool_choice["function"]["name"]
        if name not in functions:
            raise ApiError(400, f"tool_choice names '{name}', which is not among the tools", param="tool_choice")
        schema = json.dumps(_parameters(functions[name]))
        return ToolPlan("named", name, StructuredOutput("json", schema, "tools"))  # a schema that fails is in tools
    if tool_choice == "required":
        calls: dict[str, Any] = {
            "type": "array",
            "minItems": 1,
            "items": {
                "anyOf": [
                    {
                        "type": "object",
                        "properties": {"name": {"const": name}, "parameters": _parameters(function)},
                        "required": ["name", "parameters"],
                        "additionalProperties": False,
                    }
                    for name, function in functions.items()
                ]
            },
        }
        if parallel_tool_calls is False:
            calls["maxItems"] = 1
        return ToolPlan("required", structured=StructuredOutput("json", json.dumps(calls), "tools"))
    if parser is None:  # "auto", given or by default
        raise ApiError(
            400,
            'tool_choice "auto" (the default with tools) needs the server started with --enable-auto-tool-choice '
            'and --tool-call-parser; "required" or a named function work with any model',
            param="tool_choice",
        )
    return ToolPlan("auto", parser=parser)


def _parameters(function: dict) -> dict:
    return function.get("parameters") or {"type": "object", "properties": {}}


def _call(parsed: Any, *argument_keys: str) -> dict | None:
    """The OpenAI call a parsed JSON object names ({"name": ..., <the first of argument_keys>: {...}}, arguments
    as JSON text), with a new id; None where the object is not one."""
    if not isinstance(parsed, dict) or not isinstance(parsed.get("name"), str):
        return None
    arguments = next((parsed[key] for key in argument_keys if key in parsed), {})
    if not isinstance(arguments, str):
        arguments = json.dumps(arguments, ensure_ascii=False)
    function = {"name": parsed["name"], "arguments": arguments}
    return {"id": f"chatcmpl-tool-{secrets.token_hex(12)}", "type": "function", "function": function}


@dataclass(slots=True)
class ToolCallStream:
    """One choice's text in, OpenAI chat deltas out: {"content": ...} and {"tool_calls": [...]}."""

    plan: ToolPlan
    calls: list[dict] = field(default_factory=list)  # every call made so far, whole
    _held: str = ""  # text not yet answered for: a call being written, or what may begin one
    _after_call: bool = False  # the newlines that follow a call's closing tag are the format's, not content
    _whole_output_calls: bool | None = None  # llama3_json: whether the output is calls (None: not known yet)
    _listed: str = ""  # required: the whole output so far (content, should it turn out not to be a list of calls)
    _list_state: Literal["start", "calls", "arguments", "call_end", "end"] = "start"  # required: what comes next
    _arguments: _ValueEnd | None = None  # required: the end of the arguments being streamed

    def feed(self, text: str, final: bool) -> list[dict]:
        """The deltas `text` completes (with `final`: everything left)."""
        if self.plan.mode == "named":
            return self._named(text)
        self._held += text
        if self.plan.mode == "required":
            self._listed += text
            return self._required(final)
        return self._llama3_json(final) if self.plan.parser == "llama3_json" else self._hermes(final)

    def finish_reason(self, engine_reason: str) -> str:
        """OpenAI's: "tool_calls" where the model chose to call (required or auto); a named call is a "stop"."""
        if engine_reason == "stop" and self.calls and self.plan.mode != "named":
            return "tool_calls"
        return engine_reason

    def _named(self, text: str) -> list[dict]:
        if not self.calls:
            self.calls.append(_call({"name": self.plan.function, "arguments": text}, "arguments"))
            return [{"tool_calls": [{"index": 0, **self.calls[0]}]}]
        self.calls[0]["function"]["arguments"] += text
        return [{"tool_calls": [{"index": 0, "function": {"arguments": text}}]}] if text else []

    def _required(self, final: bool) -> list[dict]:
        """The list of calls as it is written: each call once its name is, then its arguments' text piece by
        piece (the grammar writes "name" before "parameters", the schema's order; a call written otherwise is
        made whole once its object is). An output that is not such a list, or is cut short before its first
        call, is content."""
        deltas: list[dict] = []
        while self._read_list(deltas):
            pass
        if final and not self.calls and self._listed:
            self._held = ""
            return [{"content": self._listed}]
        if final and self._held.strip() and self._list_state != "end":
            deltas.append({"content": self._held})  # cut short after a call: what is left, as it came
            self._held = ""
        return deltas

    def _read_list(self, deltas: list[dict]) -> bool:
        """Read what the held text completes of the list; False when it must wait for more (or it ended)."""
        state = self._list_state
        if state == "arguments":
            assert self._arguments is not None
            if not self.calls[-1]["function"]["arguments"]:
                self._held = self._held.lstrip()  # the whitespace before the value is the list's, however cut
                if not self._held:
                    return False
            end = self._arguments.scan(self._held)
            piece, self._held = self._held[: end or len(self._held)], self._held[end or len(self._held) :]
            if piece:
                self.calls[-1]["function"]["arguments"] += piece
                deltas.append({"tool_calls": [{"index": len(self.calls) - 1, "function": {"arguments": piece}}]})
            if not end:
                return False
            self._list_state = "call_end"
            return True
        held = self._held.lstrip()
        if not held or state == "end":
            return False
        if state == "start" or state == "call_end":
            expected = "[" if state == "start" else "}"
            if held[0] != expected:
                self._list_state = "end"  # not the grammar's list: read no further
                return False
            self._held, self._list_state = held[1:], "calls"
            return True
        if held[0] in ",]":
            self._held, self._list_state = held[1:], "calls" if held[0] == "," else "end"
            return True
        head = REQUIRED_CALL_HEAD.match(held)
        if head is not None:
            self._held, self._list_state = held[head.end() :], "arguments"
            self._arguments = _ValueEnd()
            call = _call({"name": json.loads(head.group(1)), "parameters": ""}, "parameters")
            deltas += self._made([call] if call is not None else [])
            return True
        try:  # a call whose keys came in another order: made whole, once its object is
            parsed, end = json.JSONDecoder().raw_decode(held)
        except ValueError:
            return False
        call = _call(parsed, "parameters")
        if call is None:
            self._list_state = "end"
            return False
        self._held = held[end:]
        deltas += self._made([call])
        return True

    def _made(self, new: list[dict]) -> list[dict]:
        first = len(self.calls)
        self.calls.extend(new)
        # Each delta's own copy of the function: a required call's arguments grow in self.calls after its first delta.
        deltas = [{"index": first + i, **call, "function": dict(call["function"])} for i, call in enumerate(new)]
        return [{"tool_calls": deltas}] if new else []

    def _hermes(self, final: bool) -> list[dict]:
        deltas: list[dict] = []
        while True:
            if self._after_call:
                self._held = self._held.lstrip("\n")
                self._after_call = not self._held
            if not self._held:
                break
            start = self._held.find(HERMES_OPEN)
            if start < 0:
                # Content, but for a tail that may be the start of a call's tag.
                keep = 0 if final else partial_tag_suffix(self._held, HERMES_OPEN)
                content, self._held = self._held[: len(self._held) - keep], self._held[len(self._held) - keep :]
                if content:
                    deltas.append({"content": content})
                break
            if start:
                deltas.append({"content": self._held[:start]})
                self._held = self._held[start:]
            end = self._held.find(HERMES_CLOSE)
            if end < 0 and not final:
                break  # the call is still being written
            body = self._held[len(HERMES_OPEN) : end if end >= 0 else None]
            call = _hermes_call(body)
            if call is None:  # not a call after all: the text as it came
                taken = len(self._held) if end < 0 else end + len(HERMES_CLOSE)
                deltas.append({"content": self._held[:taken]})
            else:
                deltas += self._made([call])
            self._held = "" if end < 0 else self._held[end + len(HERMES_CLOSE) :]
            self._after_call = call is not None
        return _merged_content(deltas)

    def _llama3_json(self, final: bool) -> list[dict]:
        if self._whole_output_calls is None:  # decided by the output's first characters
            head = self._held.lstrip()
            if not final and (not head or (LLAMA_PYTHON_TAG.startswith(head) and head != LLAMA_PYTHON_TAG)):
                return []  # too early to tell
            self._whole_output_calls = head.startswith(("{", LLAMA_PYTHON_TAG))
        if not self._whole_output_calls:
            text, self._held = self._held, ""
            return [{"content": text}] if text else []
        if not final:
            return []
        text, self._held = self._held, ""
        calls = _llama3_calls(text.strip().removeprefix(LLAMA_PYTHON_TAG))
        return [{"content": text}] if calls is None else self._made(calls)


# A "required" call's start, up to its arguments: {"name": "<name>", "parameters":
REQUIRED_CALL_HEAD = re.compile(r'\{\s*"name"\s*:\s*("(?:[^"\\]|\\.)*")\s*,\s*"parameters"\s*:\s*')


@dataclass(slots=True)
class _ValueEnd:
    """Where a JSON object or array ends, its text fed piece by piece."""

    depth: int = 0
    in_string: bool = False
    escaped: bool = False

    def scan(self, text: str) -> int:
        """The index just past the value's end in `text`, or 0 if the value goes on past it."""
        for i, ch in enumerate(text):
            if self.in_string:
                if self.escaped:
                    self.escaped = False
                elif ch == "\\":
                    self.escaped = True
                elif ch == '"':
                    self.in_string = False
            elif ch == '"':
                self.in_string = True
            elif ch in "{[":
                self.depth += 1
            elif ch in "}]":
                self.depth -= 1
                if self.depth == 0:
                    return i + 1
        return 0


def _llama3_calls(text: str) -> list[dict] | None:
    """The calls of `{...}; {...}`, each with "name" and "parameters" (or "arguments"); None if it is not that."""
    decoder, calls, at = json.JSONDecoder(), [], 0
    while True:
        while at < len(text) and text[at] in " \t\r\n;":
            at += 1
        if at == len(text):
            return calls or None
        try:
            parsed, at = decoder.raw_decode(text, at)
        except ValueError:
            return None
        call = _call(parsed, "parameters", "arguments")
        if call is None:
            return None
        calls.append(call)


def _hermes_call(body: str) -> dict | None:
    try:
        return _call(json.loads(body), "arguments")
    except ValueError:
        return None


def _merged_content(deltas: list[dict]) -> list[dict]:
    """Neighbouring content deltas as one."""
    merged: list[dict] = []
    for delta in deltas:
        if "content" in delta and merged and "content" in merged[-1]:
            merged[-1] = {"content": merged[-1]["content"] + delta["content"]}
        else:
            merged.append(delta)
    return merged


def template_message_tool_calls(tool_calls: list[dict]) -> list[dict]:
    """An assistant message's tool calls as chat templates read them: arguments as an object where they are one
    (templates write them with `tojson`; a JSON string would be written twice encoded)."""
    out = []
    for call in tool_calls:
        function = dict(call["function"])
        try:
            arguments = json.loads(function["arguments"])
        except ValueError:
            arguments = None
        if isinstance(arguments, dict):
            function["arguments"] = arguments
        out.append({**call, "function": function})
    return out
