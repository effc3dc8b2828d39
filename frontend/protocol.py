"""Request bodies the HTTP layer accepts, and how each becomes engine inputs (prompts and SamplingParams).

Models are strict (a string is not a number) and refuse unknown fields, as OpenAI's API does: a misspelled
`max_token` is a 400 naming it, never a request served without it. Every field of OpenAI's two request
schemas is declared: honoured, or refused with a 400 naming it when set to anything but its no-op value
(README.md, "API", lists which). Every refusal is an ApiError(400) naming the field at fault.
"""

from __future__ import annotations

import json
from functools import cached_property
from typing import Annotated, Any, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Discriminator, Field, PrivateAttr, Tag, model_validator
from pydantic_core import PydanticCustomError
from typing_extensions import Self

from common.messages import CHAT_TEMPLATE_RESERVED, ChatTemplateOptions, check_cache_salt
from common.sampling_params import InvalidParameter, SamplingParams, StructuredOutput
from frontend.engine_client import EngineLimits
from frontend.errors import ApiError, model_not_found
from frontend.limits import HttpLimits
from frontend.tool_calls import ToolPlan, plan_tools, template_message_tool_calls


class RequestBody(BaseModel):
    # NaN and Infinity (which Python's JSON reads) are no number a field means: a 400, not a sampler fed NaN.
    # Unknown fields are kept, then refused by _checked with one error: refused by pydantic (extra="forbid"),
    # each was an error of its own, and 32,760 of them took 0.1 s to turn into Python for the 400, in one call.
    model_config = ConfigDict(extra="allow", strict=True, allow_inf_nan=False)

    @model_validator(mode="after")
    def _checked(self) -> Self:
        """Runs after each model is built, in Python: refuses its first unknown field (the one pydantic would
        have named first), and is where the interpreter hands the GIL to a thread that has asked for it.

        Validation (pydantic, in Rust) holds the GIL for the whole call except where it calls back into Python,
        as here: the event loop, while the body-parsing thread reads a large body, waits for one model's own
        values at most, not for the body (10,920 chat messages were one 27 ms hold without this). A collection's
        callback, common/garbage.py, is another such point, every ~700 allocations of containers, but only in a
        process that registers one: by accident, not by design."""
        if self.__pydantic_extra__:
            field = next(iter(self.__pydantic_extra__))
            raise PydanticCustomError("extra_forbidden", "Extra inputs are not permitted", {"field": field})
        return self


T = TypeVar("T")
# A list whose validation stops at its first bad element: the 400 names that one, and an invalid list of 30,000
# elements costs one error, not 30,000 (whose conversion to Python for the 400 held the GIL 0.1-0.4 s).
Items = Annotated[list[T], Field(fail_fast=True)]


# Every integer a request carries travels in msgpack, whose integers are 64-bit: a larger one is a 400 here,
# not an OverflowError after the request was half submitted.
Int = Annotated[int, Field(ge=-(2**63), lt=2**63)]
GREEDY_BELOW = 1e-5  # vLLM's: a temperature this small is greedy (dividing logits by 1e-40 overflows them)


def check_prompt_chars(texts: list[str], max_chars: int, field: str) -> None:
    """Before tokenizing: a tokenizer worker serves its requests in turn, and tokenizing megabytes would
    stall every other request routed to it."""
    for text in texts:
        if len(text) > max_chars:
            raise ApiError(
                400,
                f"'{field}' has {len(text)} characters; this server takes at most {max_chars} (--max-prompt-chars)",
                param=field,
                code="prompt_too_long",
            )


class SamplingFields(RequestBody):
    """The sampling knobs that every generation endpoint shares (top_k, min_p, min_tokens,
    repetition_penalty, stop_token_ids, ignore_eos, include_stop_str_in_output, skip_special_tokens and
    spaces_between_special_tokens are vLLM's extensions)."""

    temperature: float | None = None
    top_p: float | None = None
    top_k: Int | None = None
    min_p: float | None = None
    seed: Int | None = None
    stop: str | Items[str] | None = None
    stop_token_ids: Items[Int] | None = None
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    min_tokens: Int = 0
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    logit_bias: Annotated[dict[str, float], Field(fail_fast=True)] | None = None  # keys: token ids as text (JSON)
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True

    def check_stop_strings(self, limits: HttpLimits) -> None:
        """Stop strings are matched against every output token's text: their count and length bound that cost."""
        stop = [self.stop] if isinstance(self.stop, str) else self.stop or []
        if len(stop) > limits.max_stop_strings:
            raise ApiError(
                400, f"at most {limits.max_stop_strings} stop strings (--max-stop-strings), got {len(stop)}", "stop"
            )
        if any(len(s) > limits.max_stop_string_chars for s in stop):
            raise ApiError(
                400, f"stop strings may have at most {limits.max_stop_string_chars} characters", param="stop"
            )

    def _logit_bias(self) -> dict[int, float]:
        bias = {}
        for key, value in (self.logit_bias or {}).items():
            try:
                token = int(key)
                if not 0 <= token < 2**63:
                    raise ValueError(key)
                bias[token] = value
            except ValueError:
                raise ApiError(400, f"logit_bias keys must be token ids, got {key!r}", param="logit_bias") from None
        return bias

    def _logprobs(self, max_logprobs: int) -> tuple[int | None, int | None]:
        """(logprobs, prompt_logprobs) as the engine takes them, each at most max_logprobs (--max-logprobs);
        none on the native endpoint."""
        return None, None

    def _structured_output(self) -> StructuredOutput | None:
        return None

    def sampling_params(
        self, max_tokens: int | None, max_tokens_field: str, limits: EngineLimits, max_logprobs: int
    ) -> SamplingParams:
        defaults = SamplingParams(**limits.sampling_defaults)  # for the fields the request leaves out
        params = SamplingParams(
            max_tokens=max_tokens,
            temperature=_greedy_if_tiny(defaults.temperature if self.temperature is None else self.temperature),
            top_p=defaults.top_p if self.top_p is None else self.top_p,
            top_k=defaults.top_k if self.top_k is None else self.top_k,
            seed=self.seed,
            stop=[self.stop] if isinstance(self.stop, str) else list(self.stop or []),
            stop_token_ids=list(self.stop_token_ids or []),
            ignore_eos=self.ignore_eos,
            include_stop_str_in_output=self.include_stop_str_in_output,
            min_p=defaults.min_p if self.min_p is None else self.min_p,
            min_tokens=self.min_tokens,
            presence_penalty=self.presence_penalty or 0.0,
            frequency_penalty=self.frequency_penalty or 0.0,
            repetition_penalty=defaults.repetition_penalty
            if self.repetition_penalty is None
            else self.repetition_penalty,
            logit_bias=self._logit_bias(),
            skip_special_tokens=self.skip_special_tokens,
            spaces_between_special_tokens=self.spaces_between_special_tokens,
        )
        params.logprobs, params.prompt_logprobs = self._logprobs(max_logprobs)
        params.structured = self._structured_output()
        try:
            params.validate(max_logprobs)
            if params.structured is not None:
                params.structured.check_size(limits.max_grammar_bytes)
        except InvalidParameter as exc:
            field = max_tokens_field if exc.field == "max_tokens" else exc.field
            raise ApiError(400, str(exc), param=field) from None
        if max_tokens is not None and max_tokens > limits.max_model_len:
            raise ApiError(
                400,
                f"{max_tokens_field}={max_tokens} exceeds the model's context of {limits.max_model_len} tokens",
                param=max_tokens_field,
            )
        return params


def _greedy_if_tiny(temperature: float) -> float:
    return 0.0 if 0 <= temperature < GREEDY_BELOW else temperature


class StreamOptions(RequestBody):
    include_usage: bool = False
    continuous_usage_stats: bool = False  # vLLM's: with include_usage, every chunk carries the usage so far


MAX_N = 128  # choices per request (n times the prompts of a completion)
MAX_TOOLS = 128  # OpenAI's bound


def _structured(
    field: str,
    schema: dict | str | None,
    regex: str | None,
    choice: list[str] | None,
    grammar: str | None,
    json_object: bool | None,
) -> list[StructuredOutput]:
    """What vLLM's structured output fields ask for (`field`: "guided_" for each guided_* field, else the one
    field that holds them all)."""

    def named(kind: str) -> str:
        return field + kind if field.endswith("_") else field

    asked = []
    if schema is not None:
        asked.append(StructuredOutput("json", schema if isinstance(schema, str) else json.dumps(schema), named("json")))
    if regex is not None:
        asked.append(StructuredOutput("regex", regex, named("regex")))
    if choice is not None:
        if not choice or not all(choice):
            where = named("choice") if field.endswith("_") else f"{field}.choice"
            raise ApiError(400, f"{where} must be a list of non-empty strings", param=named("choice"))
        asked.append(StructuredOutput("choice", json.dumps(choice), named("choice")))
    if grammar is not None:
        asked.append(StructuredOutput("grammar", grammar, named("grammar")))
    if json_object:
        asked.append(StructuredOutput("json_object", "", named("json_object")))
    return asked


class StructuredOutputs(RequestBody):
    """vLLM's structured_outputs: one of these at most."""

    json_schema: dict | str | None = Field(default=None, alias="json")
    regex: str | None = None
    choice: Items[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None

    def asked(self) -> list[StructuredOutput]:
        return _structured(
            "structured_outputs", self.json_schema, self.regex, self.choice, self.grammar, self.json_object
        )


class OpenAIFields(SamplingFields):
    """Fields both OpenAI endpoints share, and the checks the engine cannot make."""

    model: str | None = None  # absent: the served model
    n: Int | None = 1
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    user: str | None = None  # an end-user id for the client's own records: accepted, used for nothing
    # Structured output: OpenAI's response_format, or vLLM's structured_outputs (and the guided_* fields that
    # vLLM had before it).
    response_format: dict | None = None
    structured_outputs: StructuredOutputs | None = None
    guided_json: dict | str | None = None
    guided_regex: str | None = None
    guided_choice: Items[str] | None = None
    guided_grammar: str | None = None
    truncate_prompt_tokens: Int | None = None  # vLLM's: keep the prompt's last k tokens; -1: the context's worth
    priority: Int = 0  # vLLM's: under --scheduling-policy priority, lower is served first
    # vLLM's: the prompt's prefix-cache entries are shared only with requests of the same salt, so no other
    # client can learn from cached_tokens what was sent (null: shared with the other unsalted requests)
    cache_salt: str | None = None

    @property
    def num_choices(self) -> int:
        return 1 if self.n is None else self.n

    def prompt_tokens_kept(self, limits: EngineLimits) -> int | None:
        """truncate_prompt_tokens as the tokenizer worker applies it: None (the whole prompt) or k >= 1."""
        k = self.truncate_prompt_tokens
        if k is None:
            return None
        if k == -1:
            return limits.max_model_len
        if k < 1:
            raise ApiError(
                400, f"truncate_prompt_tokens must be at least 1, or -1, got {k}", param="truncate_prompt_tokens"
            )
        return k

    def _structured_output(self) -> StructuredOutput | None:
        asked = []
        fmt = self.response_format
        if fmt is not None and fmt != {"type": "text"}:
            kind = fmt.get("type")
            if kind == "json_object":
                asked.append(StructuredOutput("json_object"))
            elif kind == "json_schema":
                schema = (fmt.get("json_schema") or {}).get("schema")
                if not isinstance(schema, dict):
                    raise ApiError(
                        400, "response_format json_schema needs json_schema.schema, an object", "response_format"
                    )
                asked.append(StructuredOutput("json", json.dumps(schema)))
            else:
                raise ApiError(
                    400, "response_format type must be 'text', 'json_object' or 'json_schema'", param="response_format"
                )
        if self.structured_outputs is not None:
            asked += self.structured_outputs.asked()
        asked += _structured(
            "guided_", self.guided_json, self.guided_regex, self.guided_choice, self.guided_grammar, json_object=False
        )
        if len(asked) > 1:
            raise ApiError(400, "ask for one structured output at most", param=asked[1].field)
        return asked[0] if asked else None

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    @property
    def continuous_usage(self) -> bool:
        return self.include_usage and self.stream_options is not None and self.stream_options.continuous_usage_stats

    def check_common(self, limits: EngineLimits) -> None:
        if self.model is not None and self.model != limits.served_model_name:
            raise model_not_found(self.model)
        if not 1 <= self.num_choices <= MAX_N:
            raise ApiError(400, f"n must be in [1, {MAX_N}], got n={self.n}", param="n")
        try:
            check_cache_salt(self.cache_salt)
        except InvalidParameter as exc:
            raise ApiError(400, str(exc), param=exc.field) from None


def refuse_unless(value: Any, allowed: tuple, field: str, why: str) -> None:
    """A 400 naming `field` unless it holds one of its no-op values."""
    if value not in allowed:
        raise ApiError(400, f"'{field}' is not supported: {why}", param=field)


def _prompt_shape(prompt: Any) -> str:
    """Which of a prompt's shapes a value has, told by its first element, so that it is validated as that one
    alone: tried as each in turn, a list of 30,000 strings was first refused as token ids, one error each."""
    if isinstance(prompt, list) and prompt:
        first = prompt[0]
        return "list[str]" if isinstance(first, str) else "list[list[int]]" if isinstance(first, list) else "list[int]"
    return "list[int]" if isinstance(prompt, list) else "str"


# The tags are the names pydantic gives union members in an error's location, which invalid_body leaves out.
Prompt = Annotated[
    Annotated[str, Tag("str")]
    | Annotated[Items[Int], Tag("list[int]")]
    | Annotated[Items[str], Tag("list[str]")]
    | Annotated[Items[Items[Int]], Tag("list[list[int]]")],
    Discriminator(_prompt_shape),
]


class CompletionRequest(OpenAIFields):
    prompt: Prompt
    max_tokens: Int | None = 16  # OpenAI's default for completions; null: the server's --default-max-tokens
    echo: bool | None = False
    logprobs: Int | None = None
    best_of: Int | None = None
    suffix: str | None = None
    add_special_tokens: bool = True  # vLLM's: a text prompt gets the tokenizer's BOS and the like

    def engine_prompts(self) -> list[tuple[str | None, list[int] | None]]:
        """Each prompt as text or as token ids (a list of prompts gives one choice per prompt and sample)."""
        prompt = self.prompt
        prompts = prompt if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)) else [prompt]
        if len(prompts) * self.num_choices > MAX_N:
            raise ApiError(400, f"at most {MAX_N} choices (prompts times n) per request", param="prompt")
        out: list[tuple[str | None, list[int] | None]] = []
        for one in prompts:
            if not one:
                raise ApiError(400, "the prompt is empty", param="prompt")
            if isinstance(one, str):
                out.append((one, None))
            elif any(t < 0 for t in one):
                raise ApiError(400, "prompt token ids must be non-negative", param="prompt")
            else:
                out.append((None, list(one)))
        return out

    def _logprobs(self, max_logprobs: int) -> tuple[int | None, int | None]:
        # With echo, the prompt's logprobs too, as many per token: the same bound.
        if self.logprobs is not None and not 0 <= self.logprobs <= max_logprobs:
            raise ApiError(
                400, f"logprobs must be in [0, {max_logprobs}] (--max-logprobs), got {self.logprobs}", param="logprobs"
            )
        return self.logprobs, self.logprobs if self.echo else None

    def check_unsupported(self) -> None:
        refuse_unless(self.best_of, (None, self.num_choices), "best_of", "only best_of equal to n (or absent)")
        refuse_unless(self.suffix, (None, ""), "suffix", "this server does not insert text (no fill-in-the-middle)")


class TextPart(RequestBody):
    type: str
    text: str | None = None


class FunctionCall(RequestBody):
    name: str
    arguments: str  # JSON, as the model wrote it


class ToolCall(RequestBody):
    """A call an assistant message made (sent back with the conversation), answered by a "tool" message."""

    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(RequestBody):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | Items[TextPart] | None = None  # null: an assistant turn that only called tools
    name: str | None = None  # passed to the chat template
    tool_calls: Items[ToolCall] | None = None  # an assistant's calls
    tool_call_id: str | None = None  # a tool message: the call it answers
    # What an assistant message returned by an OpenAI client carries when sent back: accepted while empty.
    refusal: str | None = None
    function_call: dict | None = None
    audio: dict | None = None
    annotations: list | None = None

    def engine_message(self) -> dict:
        """The message as the chat template reads it."""
        message: dict[str, Any] = {"role": self.role, "content": self.text()}
        if self.name is not None:
            message["name"] = self.name
        if self.tool_calls:
            message["tool_calls"] = template_message_tool_calls([call.model_dump() for call in self.tool_calls])
        if self.tool_call_id is not None:
            message["tool_call_id"] = self.tool_call_id
        return message

    def text(self) -> str:
        if self.function_call or self.audio or self.refusal:
            raise ApiError(
                400, "messages with a legacy function_call, audio or a refusal are not supported", param="messages"
            )
        if self.content is None:  # as OpenAI: only an assistant turn that called tools may say nothing
            if self.role == "assistant" and self.tool_calls:
                return ""
            raise ApiError(
                400,
                f"a {self.role} message needs content (null only in an assistant message with tool_calls)",
                param="messages",
            )
        if isinstance(self.content, str):
            return self.content
        if any(part.type != "text" or part.text is None for part in self.content):
            raise ApiError(
                400, 'only text content parts ({"type": "text", "text": ...}) are supported', param="messages"
            )
        return "".join(part.text or "" for part in self.content)


class FunctionDefinition(RequestBody):
    name: Annotated[str, Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.\-]+$")]
    description: str | None = None
    parameters: dict | None = None  # a JSON schema of the arguments
    strict: bool | None = None  # calls always follow the schema where one is forced; accepted


class ToolDefinition(RequestBody):
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(RequestBody):
    name: str


class NamedToolChoice(RequestBody):
    type: Literal["function"]
    function: NamedFunction


class ChatTemplateFields(RequestBody):
    """vLLM's chat rendering fields (common/messages.py: ChatTemplateOptions), on chat completions and /tokenize
    alike, so both render messages the same way."""

    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict | None = None
    # Described to the model by templates that know tools.
    tools: Annotated[Items[ToolDefinition], Field(max_length=MAX_TOOLS)] | None = None

    # The request's messages as the chat template reads them, or the refusal of one: read as the body is
    # validated (by a validator of each request with messages), so for a large body on the parsing thread, not
    # the event loop (which 10,920 messages held 15-35 ms); raised by template_messages, after the checks a
    # request makes before it.
    _template_messages: list[dict] | ApiError | None = PrivateAttr(None)

    def _read_messages(self, messages: list[ChatMessage] | None) -> None:
        try:
            self._template_messages = None if messages is None else [m.engine_message() for m in messages]
        except ApiError as exc:
            self._template_messages = exc

    def template_messages(self) -> list[dict]:
        if isinstance(self._template_messages, ApiError):
            raise self._template_messages
        return self._template_messages or []

    @cached_property
    def tool_definitions(self) -> list[dict] | None:
        """The tools as the chat template, the prompt's bound and the tool plan read them (dumped once)."""
        return [tool.model_dump(exclude_none=True) for tool in self.tools] if self.tools else None

    def chat_options(self) -> ChatTemplateOptions | None:
        """The options, checked; None when every one is its default (the common case sends nothing more)."""
        kwargs = self.chat_template_kwargs or {}
        if self.continue_final_message and self.add_generation_prompt:
            raise ApiError(
                400,
                "continue_final_message continues the last message: set add_generation_prompt to false with it",
                param="continue_final_message",
            )
        reserved = sorted(CHAT_TEMPLATE_RESERVED.intersection(kwargs))
        if reserved:
            raise ApiError(
                400,
                f"chat_template_kwargs may set the template's own variables, not {', '.join(reserved)}",
                param="chat_template_kwargs",
            )
        tools = self.tool_definitions
        if self.add_generation_prompt and not self.continue_final_message and not kwargs and tools is None:
            return None
        return ChatTemplateOptions(self.add_generation_prompt, self.continue_final_message, dict(kwargs), tools)

    def rendered_text(self, messages: list[dict]) -> str:
        """What the template renders from the request, for the prompt's character bound: the messages' texts
        and tool calls, and the tools' definitions."""
        calls = [json.dumps(m["tool_calls"]) for m in messages if "tool_calls" in m]
        tools = self.tool_definitions
        return "".join(m["content"] for m in messages) + "".join(calls) + (json.dumps(tools) if tools else "")


class ChatCompletionRequest(OpenAIFields, ChatTemplateFields):
    messages: Items[ChatMessage]
    max_tokens: Int | None = None  # absent: the server's --default-max-tokens (never past the context)
    max_completion_tokens: Int | None = None  # OpenAI's newer name for max_tokens; wins when both are set
    logprobs: bool | None = False
    top_logprobs: Int | None = None
    # Identifiers and hints with no effect to ask for: prompt_cache_key (the prefix cache is automatic),
    # safety_identifier (like user).
    prompt_cache_key: str | None = None
    safety_identifier: str | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None  # None: "auto" with tools
    parallel_tool_calls: bool | None = None  # false: "required" makes one call at most
    # OpenAI fields refused unless they hold their no-op value (check_unsupported).
    functions: list | None = None
    function_call: str | dict | None = None
    audio: dict | None = None
    modalities: Items[str] | None = None
    prediction: dict | None = None
    reasoning_effort: str | None = None
    verbosity: str | None = None
    web_search_options: dict | None = None
    service_tier: str | None = None
    store: bool | None = None
    metadata: dict | None = None

    @model_validator(mode="after")
    def _read_messages_as_validated(self) -> Self:
        self._read_messages(self.messages)
        return self

    def engine_messages(self) -> list[dict]:
        if not self.messages:
            raise ApiError(400, "messages must not be empty", param="messages")
        return self.template_messages()

    def tool_plan(self, parser: str | None) -> ToolPlan | None:
        """How this request's tool calls are made (frontend/tool_calls.py); parser: the server's
        --tool-call-parser, None where auto tool choice is off."""
        choice = self.tool_choice.model_dump() if isinstance(self.tool_choice, NamedToolChoice) else self.tool_choice
        return plan_tools(self.tool_definitions, choice, self.parallel_tool_calls, parser)

    def tool_sampling_params(self, limits: EngineLimits, plan: ToolPlan | None, max_logprobs: int) -> SamplingParams:
        """sampling_params, with the grammar a forced tool call follows; for calls the parser reads, special
        tokens kept in the text (some models mark their call tags special, as vLLM's hermes parser knows)."""
        params = self.sampling_params(self.requested_max_tokens(), self.max_tokens_field(), limits, max_logprobs)
        if plan is not None and plan.mode == "auto":
            params.skip_special_tokens = False
        if plan is not None and plan.structured is not None:
            if params.structured is not None:
                raise ApiError(
                    400, "a forced tool call and structured output cannot be asked together", params.structured.field
                )
            params.structured = plan.structured
            try:
                plan.structured.check_size(limits.max_grammar_bytes)
            except InvalidParameter as exc:
                raise ApiError(400, str(exc), param=exc.field) from None
        return params

    def _logprobs(self, max_logprobs: int) -> tuple[int | None, int | None]:
        if self.top_logprobs is not None and not self.logprobs:
            raise ApiError(400, "top_logprobs needs logprobs set to true", param="top_logprobs")
        if self.top_logprobs is not None and not 0 <= self.top_logprobs <= max_logprobs:
            raise ApiError(
                400,
                f"top_logprobs must be in [0, {max_logprobs}] (--max-logprobs), got {self.top_logprobs}",
                param="top_logprobs",
            )
        return (self.top_logprobs or 0) if self.logprobs else None, None

    def max_tokens_field(self) -> str:
        return "max_completion_tokens" if self.max_completion_tokens is not None else "max_tokens"

    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def check_unsupported(self) -> None:
        legacy = "the legacy functions API: use tools and tool_choice"
        refuse_unless(self.functions, (None, []), "functions", legacy)
        refuse_unless(self.function_call, (None, "none"), "function_call", legacy)
        refuse_unless(self.audio, (None,), "audio", "text only")
        refuse_unless(self.modalities, (None, ["text"]), "modalities", "text only")
        refuse_unless(self.prediction, (None,), "prediction", "no predicted outputs")
        refuse_unless(self.reasoning_effort, (None,), "reasoning_effort", "not a reasoning model")
        refuse_unless(self.verbosity, (None,), "verbosity", "not a reasoning model")
        refuse_unless(self.web_search_options, (None,), "web_search_options", "no web search")
        refuse_unless(self.service_tier, (None, "auto", "default"), "service_tier", "one tier only")
        refuse_unless(self.store, (None, False), "store", "completions are not stored")
        refuse_unless(self.metadata, (None, {}), "metadata", "completions are not stored")


class NativeSampling(SamplingFields):
    max_tokens: Int | None = 16


class GenerateBody(RequestBody):
    """POST /generate: the engine's own interface, for benchmarks that want per-token times."""

    prompt: str | None = None
    input_ids: Items[Int] | None = None
    sampling_params: NativeSampling = NativeSampling()
    stream: bool = False

    def engine_prompt(self) -> tuple[str | None, list[int] | None]:
        if (self.prompt is None) == (self.input_ids is None):
            raise ApiError(400, "give exactly one of 'prompt' and 'input_ids'", param="prompt")
        if self.prompt is not None:
            if not self.prompt:
                raise ApiError(400, "the prompt is empty", param="prompt")
            return self.prompt, None
        if not self.input_ids:
            raise ApiError(400, "input_ids is empty", param="input_ids")
        if any(t < 0 for t in self.input_ids):
            raise ApiError(400, "input_ids must be non-negative", param="input_ids")
        return None, list(self.input_ids)
