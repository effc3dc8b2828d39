"""Per-token cost of structured output's mask for the two grammar libraries considered: xgrammar and
llguidance, on SmolLM2's tokenizer, walking a JSON document of a 4-field schema token by token (fill the
next-token bitmask, then advance by the document's token).

    python -m benchmarks.grammar_mask        (needs `pip install llguidance` besides xgrammar)
"""

from __future__ import annotations

import json
import time

from transformers import AutoTokenizer

from common.model_source import resolve_model

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer"},
        "tags": {"type": "array", "items": {"type": "string"}},
        "city": {"type": "string", "enum": ["Paris", "London", "Tokyo"]},
    },
    "required": ["name", "age", "tags", "city"],
}
DOCUMENT = {"name": "Alice Smith of the long name", "age": 42, "tags": ["a", "bcd", "efgh ijk"], "city": "Tokyo"}
REPEATS = 3


def per_token_us(walk, ids: list[int]) -> float:
    best = float("inf")
    for _ in range(REPEATS):
        started = time.perf_counter()
        walk(ids)
        best = min(best, time.perf_counter() - started)
    return best / len(ids) * 1e6


def xgrammar_walk(tokenizer, vocab: int):
    import xgrammar

    info = xgrammar.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab)
    compiled = xgrammar.GrammarCompiler(info).compile_json_schema(json.dumps(SCHEMA))
    bitmask = xgrammar.allocate_token_bitmask(1, vocab)

    def walk(ids: list[int]) -> None:
        matcher = xgrammar.GrammarMatcher(compiled)
        for token in ids:
            matcher.fill_next_token_bitmask(bitmask)
            assert matcher.accept_token(token)

    return walk


def llguidance_walk(tokenizer, vocab: int):
    import llguidance
    import llguidance.hf
    import llguidance.torch

    lltok = llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab)
    grammar = llguidance.LLMatcher.grammar_from_json_schema(SCHEMA)
    bitmask = llguidance.torch.allocate_token_bitmask(1, vocab)

    def walk(ids: list[int]) -> None:
        matcher = llguidance.LLMatcher(lltok, grammar)
        for token in ids:
            llguidance.torch.fill_next_token_bitmask(matcher, bitmask, 0)
            assert matcher.consume_token(token), matcher.get_error()

    return walk


def main() -> None:
    folder = resolve_model(None)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    vocab = json.loads((folder / "config.json").read_text())["vocab_size"]
    ids = tokenizer.encode(json.dumps(DOCUMENT), add_special_tokens=False)
    for name, make in (("xgrammar", xgrammar_walk), ("llguidance", llguidance_walk)):
        print(
            f"{name}: {per_token_us(make(tokenizer, vocab), ids):.1f} us per token (mask + advance), {len(ids)} tokens"
        )


if __name__ == "__main__":
    main()
