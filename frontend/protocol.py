"""Request bodies the HTTP layer accepts, and how each becomes engine inputs (prompt and SamplingParams).

Models are strict (a string is not a number) and ignore unknown fields (OpenAI clients send some we
do not use). Every refusal is an ApiError(400) naming the field at fault.
"""

from __future__ import annotations

from typing import Literal, TypeVar

from fastapi import Request
from pydantic import BaseModel, ConfigDict, ValidationError

from common.sampling_params import InvalidParameter, SamplingParams
from frontend.engine_client import EngineLimits
from frontend.errors import ApiError

Body = TypeVar("Body", bound=BaseModel)


class RequestBody(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)


async def parse_body(request: Request, model: type[Body]) -> Body:
    try:
        return model.model_validate_json(await request.body())
    except ValidationError as exc:
        raise _invalid_body(exc) from None


def _invalid_body(exc: ValidationError) -> ApiError:
    first = exc.errors()[0]
    if first["type"] == "json_invalid":
        return ApiError(400, f"the request body is not valid JSON ({first.get('ctx', {}).get('error', '')})")
    if not first["loc"]:
        return ApiError(400, f"the request body must be a JSON object: {first['msg']}")
    # `param` is the top-level field: nested locations carry pydantic's union tags ("prompt.list[int].0").
    param = str(first["loc"][0])
    where = f" (at {'.'.join(map(str, first['loc']))})" if len(first["loc"]) > 1 else ""
    return ApiError(400, f"invalid '{param}'{where}: {first['msg']}", param=param)


class SamplingFields(RequestBody):
    """The sampling knobs that every generation endpoint shares (top_k, stop_token_ids and ignore_eos
    are vLLM-style extensions)."""

    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False

    def sampling_params(self, max_tokens: int | None, max_tokens_field: str, limits: EngineLimits) -> SamplingParams:
        defaults = SamplingParams()
        params = SamplingParams(
            max_tokens=max_tokens,
            temperature=defaults.temperature if self.temperature is None else self.temperature,
            top_p=defaults.top_p if self.top_p is None else self.top_p,
            top_k=defaults.top_k if self.top_k is None else self.top_k,
            seed=self.seed,
            stop=[self.stop] if isinstance(self.stop, str) else list(self.stop or []),
            stop_token_ids=list(self.stop_token_ids or []),
            ignore_eos=self.ignore_eos,
            include_stop_str_in_output=self.include_stop_str_in_output,
        )
        try:
            params.validate()
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


class StreamOptions(RequestBody):
    include_usage: bool = False


class OpenAIFields(SamplingFields):
    """Fields both OpenAI endpoints share, and the checks the engine cannot make."""

    model: str | None = None  # absent: the served model
    n: int | None = 1
    stream: bool | None = False
    stream_options: StreamOptions | None = None

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    def check_common(self, limits: EngineLimits) -> None:
        if self.model is not None and self.model != limits.served_model_name:
            raise ApiError(
                400,
                f"model '{self.model}' is not served here; this server serves '{limits.served_model_name}'",
                param="model",
                code="model_not_found",
            )
        if self.n not in (None, 1):
            raise ApiError(400, f"only n=1 is supported, got n={self.n}", param="n")


class CompletionRequest(OpenAIFields):
    prompt: str | list[int] | list[str] | list[list[int]]
    max_tokens: int | None = 16  # OpenAI's default for completions; null: up to the context
    echo: bool | None = False
    logprobs: int | None = None

    def engine_prompt(self) -> tuple[str | None, list[int] | None]:
        """The prompt as text or as token ids; batches of one are unwrapped, larger ones refused."""
        prompt = self.prompt
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
            if len(prompt) != 1:
                raise ApiError(
                    400,
                    f"a batch of {len(prompt)} prompts is not supported; send one prompt per request",
                    param="prompt",
                )
            prompt = prompt[0]
        if not prompt:
            raise ApiError(400, "the prompt is empty", param="prompt")
        if isinstance(prompt, str):
            return prompt, None
        if any(t < 0 for t in prompt):
            raise ApiError(400, "prompt token ids must be non-negative", param="prompt")
        return None, list(prompt)

    def check_unsupported(self) -> None:
        if self.echo:
            raise ApiError(400, "echo is not supported", param="echo")
        if self.logprobs:
            raise ApiError(400, "logprobs are not supported", param="logprobs")


class TextPart(RequestBody):
    type: str
    text: str | None = None


class ChatMessage(RequestBody):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None  # null: an assistant turn that only called tools

    def text(self) -> str:
        if self.content is None or isinstance(self.content, str):
            return self.content or ""
        if any(part.type != "text" or part.text is None for part in self.content):
            raise ApiError(
                400, 'only text content parts ({"type": "text", "text": ...}) are supported', param="messages"
            )
        return "".join(part.text or "" for part in self.content)


class ChatCompletionRequest(OpenAIFields):
    messages: list[ChatMessage]
    max_tokens: int | None = None  # absent: up to the context
    max_completion_tokens: int | None = None  # OpenAI's newer name for max_tokens; wins when both are set
    logprobs: bool | None = False

    def engine_messages(self) -> list[dict]:
        if not self.messages:
            raise ApiError(400, "messages must not be empty", param="messages")
        return [{"role": m.role, "content": m.text()} for m in self.messages]

    def max_tokens_field(self) -> str:
        return "max_completion_tokens" if self.max_completion_tokens is not None else "max_tokens"

    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def check_unsupported(self) -> None:
        if self.logprobs:
            raise ApiError(400, "logprobs are not supported", param="logprobs")


class NativeSampling(SamplingFields):
    max_tokens: int | None = 16


class GenerateBody(RequestBody):
    """POST /generate: the engine's own interface, for benchmarks that want per-token times."""

    prompt: str | None = None
    input_ids: list[int] | None = None
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
