"""One model's tokenizer: prompts and chat messages to token ids, and the decode the detokenizer builds on.

Everything this process asks of the Hugging Face tokenizer goes through `Tokenizer`, so the rest of the
worker never depends on which tokenizer class a model folder happens to load.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from jinja2 import TemplateError

from common.library_errors import library_message
from common.messages import ChatTemplateOptions, GenerateRequest
from common.sampling_params import InvalidParameter

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

# Prompts (or chat messages' contents) of at least this many characters are encoded off the worker's loop
# (background_encoder.py): ~1,000 tokens, a millisecond or more of encoding; shorter ones cost less than the
# hand-over to a thread.
LONG_PROMPT_CHARS = 4096
DEFAULT_CHAT_OPTIONS = ChatTemplateOptions()


@dataclass(slots=True)
class Tokenizer:
    hf: PreTrainedTokenizerBase
    vocab_size: int  # ids the tokenizer knows, added tokens included
    # Ids that decode(skip_special_tokens=True) drops: the added tokens flagged special. Taken from the
    # tokenizer's own added vocabulary (not `all_special_ids`, which may list fewer, e.g. only the EOS).
    skipped_ids: frozenset[int]
    _token_texts: dict[int, str] = field(default_factory=dict)  # id -> its text decoded alone
    _backend: Any = None  # a fast tokenizer's `tokenizers.Tokenizer`, decoding without transformers' wrapper

    def __post_init__(self) -> None:
        self._backend = getattr(self.hf, "backend_tokenizer", None)

    @property
    def backend(self) -> Any:
        """A fast tokenizer's `tokenizers.Tokenizer` (None for a slow, Python one)."""
        return self._backend

    @classmethod
    def load(cls, model_folder: str, chat_template: str | None = None) -> Tokenizer:
        """`chat_template`: a Jinja template for chat requests instead of the tokenizer's own
        (read_chat_template)."""
        # Imported here, not at the top: the launcher imports this module's process only to start it, and
        # transformers costs it seconds of CPU at every server start.
        from transformers import AutoTokenizer

        hf = AutoTokenizer.from_pretrained(model_folder)
        if chat_template is not None:
            hf.chat_template = chat_template
        special = frozenset(i for i, token in hf.added_tokens_decoder.items() if token.special)
        return cls(hf, len(hf), special)

    def tokenize(self, request: GenerateRequest) -> list[int]:
        """The prompt's ids, from whichever one of the three prompt forms the request carries."""
        given = [request.prompt is not None, request.prompt_token_ids is not None, request.chat_messages is not None]
        if sum(given) != 1:
            raise InvalidParameter("prompt", "exactly one of prompt, prompt token ids or messages must be given")
        if request.prompt is not None:
            return self.encode_prompt(request.prompt, request.add_special_tokens)
        if request.prompt_token_ids is not None:
            return self.check_token_ids(request.prompt_token_ids)
        return self.render_chat(request.chat_messages, request.chat_options)

    def encode_prompt(self, prompt: str, add_special_tokens: bool = True) -> list[int]:
        """A completion prompt, with the special tokens (e.g. BOS) this tokenizer adds by default unless asked
        not to."""
        ids = self.hf.encode(prompt, add_special_tokens=add_special_tokens) if prompt else []
        if not prompt or not ids:
            raise InvalidParameter("prompt", "the prompt is empty")
        return ids

    def long_prompt_text(self, request: GenerateRequest) -> tuple[str, bool] | None:
        """(text, add_special_tokens) to encode off the loop when the request's prompt is long, with the same
        ids as tokenize() would give; None: tokenize() it inline. Only a fast tokenizer's batch encode releases
        the GIL, so only it goes off the loop. Raises InvalidParameter for chat messages that cannot render."""
        if self._backend is None or request.prompt_token_ids is not None:
            return None
        if request.prompt is not None and request.chat_messages is None:
            return (request.prompt, request.add_special_tokens) if len(request.prompt) >= LONG_PROMPT_CHARS else None
        if request.prompt is None and isinstance(request.chat_messages, list):
            contents = sum(len(str(m.get("content", ""))) for m in request.chat_messages if isinstance(m, dict))
            if contents >= LONG_PROMPT_CHARS:
                # What apply_chat_template(tokenize=True) encodes: the rendered text, with no special tokens added.
                return self.render_chat(request.chat_messages, request.chat_options, tokenize=False), False
        return None

    def encode_releasing_gil(self, text: str, add_special_tokens: bool) -> list[int]:
        """The ids hf.encode(text, add_special_tokens=...) gives, from the Rust tokenizer's batch encode, which
        lets other threads run meanwhile."""
        return self._backend.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids

    def check_token_ids(self, ids: list) -> list[int]:
        if not ids:
            raise InvalidParameter("prompt", "the prompt is empty")
        for i in ids:
            # bool is an int subclass, but `true` in a JSON prompt is a client mistake, not token 1.
            if not isinstance(i, int) or isinstance(i, bool) or not 0 <= i < self.vocab_size:
                raise InvalidParameter(
                    "prompt", f"prompt token ids must be integers in [0, {self.vocab_size}), got {i!r}"
                )
        return list(ids)

    def render_chat(
        self, messages: list[dict], options: ChatTemplateOptions | None = None, tokenize: bool = True
    ) -> Any:
        """Messages rendered with the model's chat template, ending with the assistant's turn opened (unless
        `options` say otherwise): their ids, or with tokenize=False the rendered text."""
        options = options or DEFAULT_CHAT_OPTIONS
        if not messages:
            raise InvalidParameter("messages", "messages must be a non-empty list")
        for m in messages:
            if not isinstance(m, dict) or not isinstance(m.get("role"), str):
                raise InvalidParameter("messages", "each message must be an object with a string 'role'")
        if self.hf.chat_template is None:
            raise InvalidParameter("messages", "this model has no chat template; use a completion prompt")
        try:
            rendered = self.hf.apply_chat_template(
                messages,
                add_generation_prompt=options.add_generation_prompt,
                continue_final_message=options.continue_final_message,
                tools=options.tools,
                tokenize=tokenize,
                return_dict=False,
                **options.template_kwargs,
            )
        except (TemplateError, TypeError, KeyError, ValueError) as exc:
            # Templates reject what they cannot render (an unknown role, alternation broken) by raising.
            raise InvalidParameter(
                "messages", f"the chat template cannot render these messages: {library_message(exc)}"
            ) from exc
        return list(rendered) if tokenize else rendered

    def token_texts(self, ids: list[int]) -> list[str]:
        """Each token's text decoded alone, special tokens included: how logprobs name tokens (a byte-level
        token holding part of a UTF-8 character shows as U+FFFD, as OpenAI shows it)."""
        missing = [i for i in set(ids) if i not in self._token_texts]
        if missing:
            texts = self.hf.batch_decode([[i] for i in missing], clean_up_tokenization_spaces=False)
            self._token_texts.update(zip(missing, texts))
        return [self._token_texts[i] for i in ids]

    def decode(
        self, ids: list[int], skip_special_tokens: bool = True, spaces_between_special_tokens: bool = True
    ) -> str:
        # The decoder's own text, without transformers' optional space clean-up (" ." -> "."): that
        # rewrite looks across token boundaries, which no windowed detokenizer can reproduce exactly,
        # and transformers already ignores it for BPE tokenizers, i.e. for every model this server runs.
        # A fast tokenizer's Rust decoder is asked directly: transformers' wrapper around the same call
        # (argument conversion, to_py_obj) cost more than the decode, twice per token of every request.
        # spaces_between_special_tokens is a slow tokenizer's option (transformers' Python decode); a fast one's
        # decoder places its special tokens itself, as in vLLM.
        backend = self._backend
        if backend is not None:
            return backend.decode(ids, skip_special_tokens=skip_special_tokens)
        return self.hf.decode(
            ids,
            skip_special_tokens=skip_special_tokens,
            clean_up_tokenization_spaces=False,
            spaces_between_special_tokens=spaces_between_special_tokens,
        )
