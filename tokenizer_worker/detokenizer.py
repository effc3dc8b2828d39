"""Incremental detokenization: token ids in, text deltas out, exact whatever the token boundaries.

Decoding each new token on its own is wrong twice over: a byte-level token may carry only part of a
UTF-8 character (decoded alone it is U+FFFD), and some decoders change a token's text by its position
(a SentencePiece decode drops the leading space of its first token). So each step decodes a short window
instead: the tokens of the previous delta (the context) followed by the tokens not yet emitted,

    window:   [ context tokens | unread tokens ]
    text(window) = text(context) + delta

and emits text(window) minus text(context). While the window's text ends in U+FFFD its last character
is still missing bytes: nothing is emitted, and the next token extends the window. Once a delta is
emitted the unread tokens become the next context and everything before them is forgotten.

Why the deltas add up to decode(all ids): a context always begins where an earlier window ended on a
whole character, and the decoders of the models we serve (byte-level BPE, SentencePiece with byte
fallback) give each token text that depends only on the bytes since such a boundary and on whether the
token is first in the decode, which the context and the window agree on. Special tokens are dropped on
entry, as decode(skip_special_tokens=True) drops them, so a context always has text to anchor on (a
SentencePiece decode would otherwise strip the space of the token after a special one). A request that asks
to see them (skip_special_tokens false) keeps them: each decodes to its own non-empty text, an anchor too.
The one case no stream can follow is invalid UTF-8 under byte fallback, where a bad byte turns the valid
character before it into U+FFFD after that character was sent; byte-level BPE has no such rewrite.

Cost per token: two decodes of the window, which holds the previous delta's tokens plus the unread
ones: a handful, the same at token 10 as at token 10,000. A fast tokenizer has this very method built in
(`tokenizers`' DecodeStream, in Rust: one call per token, 31 % less time per token, docs/benchmarks.md); the
windows are still kept here, for the final flush and for slow tokenizers.
"""

from __future__ import annotations

from tokenizers.decoders import DecodeStream

from tokenizer_worker.tokenizer import Tokenizer

INCOMPLETE = "\ufffd"  # what a decoder yields for the bytes of a character that has not fully arrived


class IncrementalDetokenizer:
    """A request's text, delta by delta. With a fast tokenizer the windows are decoded by its own
    `DecodeStream` (the same method, in Rust: one call per token instead of two decodes from Python); the
    windows are kept here too, for the final flush and for slow tokenizers."""

    __slots__ = ("_tokenizer", "_window", "_num_context", "_context_text", "_skipped", "_skip", "_spaces", "_stream")

    def __init__(
        self, tokenizer: Tokenizer, skip_special_tokens: bool = True, spaces_between_special_tokens: bool = True
    ):
        self._tokenizer = tokenizer
        self._window: list[int] = []
        self._num_context = 0  # window[:num_context] is the context: its text was emitted already
        self._context_text = ""
        self._skipped = tokenizer.skipped_ids if skip_special_tokens else frozenset()
        self._skip = skip_special_tokens
        self._spaces = spaces_between_special_tokens
        self._stream = None if tokenizer.backend is None else DecodeStream(skip_special_tokens=skip_special_tokens)

    @property
    def window_tokens(self) -> int:
        """The tokens the next decode reads: the context and those not yet emitted."""
        return len(self._window)

    def step(self, token_ids: list[int], final: bool = False) -> str:
        """The text that `token_ids` complete. With `final`, also what waits for bytes that will never come."""
        if self._stream is not None:
            if len(token_ids) == 1 and not final:
                return self._stream_token(token_ids[0])
            return self._stream_step(token_ids, final)
        skipped = self._skipped
        self._window.extend(t for t in token_ids if t not in skipped)
        if len(self._window) == self._num_context:
            return ""
        text = self._decode(self._window)
        if text.endswith(INCOMPLETE) and not final:
            return ""
        delta = text[len(self._context_text) :]
        del self._window[: self._num_context]
        self._num_context = len(self._window)
        self._context_text = self._decode(self._window)
        return delta

    def _stream_token(self, token: int) -> str:
        """_stream_step of one token, not the last: every decoding step but a request's last, hence its own few lines
        (a third less time per token than the general loop)."""
        if token in self._skipped:
            return ""
        try:
            delta = self._stream.step(self._tokenizer.backend, token)  # type: ignore[union-attr]
        except Exception:  # as in _stream_step: decode here from now on
            self._stream = None
            self._context_text = self._decode(self._window[: self._num_context])
            return self.step([token])
        window = self._window
        window.append(token)
        if delta is None:
            return ""
        del window[: self._num_context]
        self._num_context = len(window)
        return delta

    def _stream_step(self, token_ids: list[int], final: bool) -> str:
        """step() through the DecodeStream, which holds the same window: kept here as tokens in and deltas out."""
        stream, backend, skipped, window = self._stream, self._tokenizer.backend, self._skipped, self._window
        deltas = []
        for i, token in enumerate(token_ids):
            if token in skipped:
                continue
            try:
                delta = stream.step(backend, token)
            except Exception:  # a decoder whose window text does not extend its context's: decode here instead
                self._stream = None
                self._context_text = self._decode(window[: self._num_context])
                return "".join(deltas) + self.step(token_ids[i:], final)
            window.append(token)
            if delta is not None:
                deltas.append(delta)
                del window[: self._num_context]  # the tokens read before this delta are no context any more
                self._num_context = len(window)
        if final and len(window) > self._num_context:  # bytes that will never complete: as decode() shows them
            deltas.append(self._decode(window)[len(self._decode(window[: self._num_context])) :])
        return "".join(deltas)

    def _decode(self, ids: list[int]) -> str:
        return self._tokenizer.decode(ids, self._skip, self._spaces)
