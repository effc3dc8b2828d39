"""Tensor parallelism, TP=1 against TP=N, in process (`offline.LLM`, rank 0 here, the others spawned):
are the greedy tokens the same, and how long does a decode step take?

    python -m benchmarks.tensor_parallel --model ../shared/models/gpt2 --load-format dummy --dtype float32 \\
        --tp-sizes 1,2 --batch 32

Dummy weights are drawn whole and split, so every size holds the same model. The decode step is one
`LLM.step()` (plan, launch, read back; no overlap) of --batch one-token decodes, synchronised: on CUDA a
CUDA-graph replay unless --enforce-eager. Figures are medians of --decode-steps steps.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from dataclasses import replace

import torch

from common.config import EngineConfig, add_engine_args
from common.sampling_params import SamplingParams

CHECK_PROMPT_LENS = [5, 13, 17, 23, 31, 35, 47, 50]


def prompts(count: int, lengths: list[int], vocab: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(0)
    return [torch.randint(1, vocab, (lengths[i % len(lengths)],), generator=gen).tolist() for i in range(count)]


def measure(config: EngineConfig, args: argparse.Namespace) -> dict:
    from offline import LLM

    with LLM.from_config(config) as llm:
        vocab = llm.info.vocab_size
        greedy = SamplingParams(max_tokens=args.check_tokens, temperature=0.0, ignore_eos=True)
        tokens = [o.token_ids for o in llm.generate(prompts(len(CHECK_PROMPT_LENS), CHECK_PROMPT_LENS, vocab), greedy)]
        sync = torch.cuda.synchronize if llm.runner.device.type == "cuda" else (lambda: None)
        long = SamplingParams(max_tokens=args.decode_steps + 2, temperature=0.0, ignore_eos=True)
        for prompt in prompts(args.batch, [args.prompt_len], vocab):
            llm.add_request(prompt, long)
        llm.step()  # the prefill
        times = []
        for _ in range(args.decode_steps):
            sync()
            start = time.perf_counter()
            llm.step()
            sync()
            times.append(time.perf_counter() - start)
        return {
            "device": str(llm.runner.device),
            "cuda_graphs": llm.runner.graphs is not None,
            "decode_step_ms": statistics.median(times) * 1e3,
            "tokens": tokens,
        }


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", help="folder, .gguf or hub id (default: embedded SmolLM2)")
    parser.add_argument(
        "--tp-sizes", default="1,2", help="comma-separated tensor-parallel sizes; the first is the reference"
    )
    parser.add_argument("--batch", type=int, default=32, help="requests decoding together in the timed steps")
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--decode-steps", type=int, default=50)
    parser.add_argument("--check-tokens", type=int, default=32, help="greedy tokens per prompt compared across sizes")
    add_engine_args(parser)
    args = parser.parse_args(argv)
    base = EngineConfig.from_args(args)
    report: dict = {}
    for size in (int(x) for x in args.tp_sizes.split(",")):
        result = measure(replace(base, tensor_parallel_size=size), args)
        report[size] = result
        print(
            f"TP={size} on {result['device']} (CUDA graphs: {result['cuda_graphs']}): decode step of "
            f"{args.batch} sequences {result['decode_step_ms']:.2f} ms (median of {args.decode_steps})",
            flush=True,
        )
    sizes = list(report)
    reference = report[sizes[0]]
    summary = {}
    for size in sizes[1:]:
        diffs = [
            next((i for i, (a, b) in enumerate(zip(ref, got)) if a != b), None)
            for ref, got in zip(reference["tokens"], report[size]["tokens"])
        ]
        mismatched = [(p, i) for p, i in enumerate(diffs) if i is not None]
        ratio = report[size]["decode_step_ms"] / reference["decode_step_ms"]
        summary[size] = {
            "token_exact": not mismatched,
            "first_mismatch (prompt, position)": mismatched,
            "step_ratio": ratio,
        }
        print(f"TP={size} vs TP={sizes[0]}: token-exact {not mismatched} {mismatched or ''}; decode step x{ratio:.2f}")
    out = {"decode_step_ms": {s: r["decode_step_ms"] for s, r in report.items()}, "compare": summary}
    print(json.dumps(out, indent=1))
    return out


if __name__ == "__main__":
    main()
