"""Structured output: a grammar per request (JSON schema, any JSON object, regex, or a choice of strings),
advanced with each of its tokens, giving the mask of tokens allowed next.

    add_request:  the grammar from the cache (grammars.py), or compiled off the loop by the compile worker
                  (compile_worker.py) while the request waits for it; a grammar that does not compile is a 400
    each plan:    a sampling chunk of such a request carries the matcher's bitmask (int32 words, bit j of
                  word i allows token 32 i + j); the GPU worker applies it in the batched sampler
    each result:  the matcher accepts the sampled token; the grammar complete and EOS sampled: "stop"

The mask for a token depends on the tokens before it, so a structured request is never planned while its
last token is in flight (scheduler.py): it samples every other step when two plans are outstanding.

xgrammar, chosen by measurement (benchmarks/grammar_mask.py on SmolLM2's tokenizer, a 4-field JSON
schema): 4.3 us per token for mask and advance, against 20.9 us for llguidance.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import numpy as np

from common.library_errors import library_message
from common.sampling_params import STRUCTURED_KIND_NAMES


@dataclass(slots=True)
class RequestGrammar:
    matcher: Any  # xgrammar.GrammarMatcher (imported on first use)
    vocab_size: int

    def next_bitmask(self) -> bytes:
        import xgrammar

        bitmask = xgrammar.allocate_token_bitmask(1, self.vocab_size)
        self.matcher.fill_next_token_bitmask(bitmask)
        return bitmask.numpy().astype(np.int32).tobytes()

    def accept(self, token: int) -> bool:
        """Advance by one sampled token; False if the grammar refuses it (it cannot, under its mask)."""
        return self.matcher.accept_token(token)

    @property
    def terminated(self) -> bool:
        return self.matcher.is_terminated()


def compile_spec(compiler: Any, kind: str, spec: str) -> Any:
    """The xgrammar.CompiledGrammar of one structured output (in the compile worker's process); RuntimeError or
    ValueError if it does not compile (compile_error_message says why in the user's terms)."""
    if kind == "json":
        # Compact JSON: a small model given free whitespace tends to spend its tokens on it.
        return compiler.compile_json_schema(spec, any_whitespace=False)
    if kind == "json_object":
        return compiler.compile_builtin_json_grammar()
    if kind == "regex":
        return compiler.compile_regex(spec)
    if kind == "choice":
        choices = json.loads(spec)
        return compiler.compile_grammar("root ::= " + " | ".join(json.dumps(c) for c in choices))
    if kind == "grammar":
        return compiler.compile_grammar(spec)
    raise ValueError(f"unknown structured output kind {kind!r}")


def compile_error_message(kind: str, exc: BaseException) -> str:
    """Why a grammar does not compile, in the user's terms (common/library_errors.py: no library paths, log
    stamps or C++ frames)."""
    return f"the {STRUCTURED_KIND_NAMES.get(kind, kind)} does not compile: {library_message(exc)}"
