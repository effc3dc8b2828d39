"""A tokenizer worker's per-token detokenization: the IncrementalDetokenizer on a fast tokenizer's DecodeStream
against the same windows decoded from Python (what a slow tokenizer, or a DecodeStream that failed, gets), one
token at a time as the worker feeds it.

    python -m benchmarks.detokenize [--model FOLDER] [--text FILE] [--tokens 20000]
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from common.model_source import resolve_model
from tokenizer_worker.detokenizer import IncrementalDetokenizer
from tokenizer_worker.tokenizer import Tokenizer

ROUNDS = 5


def main(argv: list[str] | None = None) -> dict[str, float]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", help="folder, .gguf or hub id (default: embedded SmolLM2)")
    parser.add_argument("--text", default=str(Path(__file__).parent.parent / "README.md"), help="what to tokenize")
    parser.add_argument("--tokens", type=int, default=20000)
    args = parser.parse_args(argv)
    tokenizer = Tokenizer.load(str(resolve_model(args.model)))
    text = Path(args.text).read_text()
    ids = tokenizer.hf.encode(text * (1 + args.tokens // max(1, len(text) // 4)))[: args.tokens]
    expected = tokenizer.decode(ids)
    results = {}
    for arm, stream in (("python windows", False), ("decode stream", True)):
        best = float("inf")
        for _ in range(ROUNDS):
            detokenizer = IncrementalDetokenizer(tokenizer)
            if not stream:
                detokenizer._stream = None  # the windows path, as a slow tokenizer takes it
            start = time.perf_counter()
            out = "".join(detokenizer.step([i]) for i in ids)
            best = min(best, time.perf_counter() - start)
            assert out == expected, f"{arm}: the deltas do not add up to the decode"
        results[arm] = best / len(ids) * 1e6
        print(f"{arm:<16}{results[arm]:8.2f} µs per token (best of {ROUNDS}, {len(ids)} tokens)")
    return results


if __name__ == "__main__":
    main()
