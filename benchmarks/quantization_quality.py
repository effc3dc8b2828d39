"""What --quantization fp8 and --kv-cache-dtype fp8 do to a real model's outputs, against bfloat16: greedy
agreement, and the logprobs of the same tokens.

    python -m benchmarks.quantization_quality --device cpu --out docs/results/quantization_quality_cpu.json

The 32 PROMPTS below (questions through the model's chat template; code, lists and prose to continue) are
generated greedily, up to --max-tokens each, by the base engine (bfloat16) and by each compared one:
- greedy agreement: the tokens each output shares with the base's before their first difference, as a share
  of the base's tokens; exact outputs: the share of outputs identical throughout.
- mean |Δ logprob|: every engine scores the base's outputs teacher-forced (prompt + output as one prompt, its
  prompt logprobs), so all score the same tokens; the mean over those tokens of |logprob - the base's|.
Compared: fp8 (weights e4m3 with per-channel scales, activations per token, the rest bfloat16); kv_fp8 (the KV
store in e4m3 with one calibrated scale per layer for K and for V: gpu_worker/kv_scales.py), alone and with
fp8 weights; float32 (no quantization: how much precision alone moves the outputs, the yardstick). With
--fp8-checkpoints, the model saved as FP8 checkpoints too (128 x 128 block scales as Qwen3's FP8 releases, and one
scale per tensor), served as the engine serves them, and the block checkpoint's own values unquantized. On a CPU fp8
weights run the emulation with the same numbers (gpu_worker/models/fp8.py), on CUDA torch._scaled_mm; the e4m3
store is the same bits on both (the torch backend on a CPU, the Triton kernels on CUDA).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

from common.model_source import resolve_model
from common.sampling_params import SamplingParams

BASE = "bfloat16"
ENGINES = {
    "bfloat16": dict(dtype="bfloat16"),
    "fp8": dict(dtype="bfloat16", quantization="fp8"),
    "kv_fp8": dict(dtype="bfloat16", kv_cache_dtype="fp8"),
    "fp8+kv_fp8": dict(dtype="bfloat16", quantization="fp8", kv_cache_dtype="fp8"),
    "float32": dict(dtype="float32"),
}

CHAT = [
    "What is the capital of France, and why is it famous?",
    "Explain photosynthesis to a ten-year-old.",
    "Give me three tips for sleeping better.",
    "What is the difference between a list and a tuple in Python?",
    "Write a haiku about autumn leaves.",
    "How do I boil an egg so that the yolk stays soft?",
    "Summarize the plot of Romeo and Juliet in two sentences.",
    "What causes the seasons on Earth?",
    "Translate 'Good morning, how are you?' into Spanish.",
    "Why is the sky blue?",
    "List five fruits that are rich in vitamin C.",
    "What is 17 times 23? Show your steps.",
    "Write a short, polite email declining a meeting invitation.",
    "What does HTTP stand for, and what is it used for?",
    "Suggest a name for a friendly robot and explain the choice.",
    "How does a binary search work?",
    "What are the health benefits of walking every day?",
    "Describe the water cycle in a few sentences.",
    "Write a SQL query that counts the rows of a table named users.",
    "What is a prime number? Give three examples.",
]
TEXT = [
    "def fibonacci(n):\n    ",
    "import numpy as np\n\n# Compute the mean of each column of a matrix\n",
    "class Stack:\n    def __init__(self):\n",
    "for i in range(10):\n    if i % 2 == 0:\n",
    "Ingredients for pancakes:\n1.",
    "The three primary colors are",
    "Once upon a time, in a small village by the sea,",
    "Steps to change a flat tire:\n1.",
    "The largest planets of the solar system, in order of size:",
    "<html>\n<head>\n  <title>My page</title>\n",
    "Dear hiring manager,\n\nI am writing to apply for",
    "A list of common kitchen tools: knife, cutting board,",
]


@dataclass(slots=True)
class EngineRun:
    outputs: list[list[int]]  # each prompt's greedy tokens
    scored: list[list[float]]  # the logprobs it gives the base's greedy tokens, teacher-forced


def prompt_ids(tokenizer) -> list[list[int]]:
    chats = [
        tokenizer.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True, tokenize=False)
        for q in CHAT
    ]
    return [tokenizer.encode(text, add_special_tokens=False) for text in chats + TEXT]


def run_engine(model: str, device: str, engine_args: dict, max_tokens: int, base: EngineRun | None) -> EngineRun:
    """Greedy outputs, then the logprobs of the base's outputs (of its own when it is the base)."""
    from offline import LLM

    llm = LLM(model, device=device, **engine_args)
    prompts = prompt_ids(llm.tokenizer)
    outputs = [o.token_ids for o in llm.generate(prompts, SamplingParams(max_tokens=max_tokens, temperature=0.0))]
    reference = outputs if base is None else base.outputs
    teacher_forced = [p + out for p, out in zip(prompts, reference, strict=True)]
    scoring = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0)
    scored = []
    for prompt, out in zip(prompts, llm.generate(teacher_forced, scoring), strict=True):
        assert out.prompt_logprobs is not None and out.prompt_logprobs.start == 0
        scored.append(out.prompt_logprobs.logprobs[len(prompt) :])
    llm.close()
    return EngineRun(outputs, scored)


def fp8_checkpoint_runs(model: Path, scratch: Path) -> dict[str, tuple[str, dict]]:
    """The model saved as FP8 checkpoints, each served as the engine serves such a checkpoint (no flag: the
    checkpoint's quantization_config turns FP8 on), and the block checkpoint's values unquantized."""
    from benchmarks.fp8_checkpoints import save_fp8_checkpoint, save_with_weights

    stands_for = save_fp8_checkpoint(model, scratch / "block", "block", (128, 128))
    save_with_weights(model, scratch / "block_values", stands_for)
    save_fp8_checkpoint(model, scratch / "tensor", "tensor")
    bf16 = dict(dtype="bfloat16")
    return {
        "fp8 checkpoint, 128x128 blocks (served with its block scales)": (str(scratch / "block"), bf16),
        "its values in bfloat16 (no activation quantization)": (str(scratch / "block_values"), bf16),
        "fp8 checkpoint, one scale per tensor (served: re-quantized per channel)": (str(scratch / "tensor"), bf16),
    }


def compare(run: EngineRun, base: EngineRun) -> dict:
    shared = 0
    for got, want in zip(run.outputs, base.outputs, strict=True):
        shared += next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), min(len(got), len(want)))
    deltas = [abs(a - b) for got, want in zip(run.scored, base.scored) for a, b in zip(got, want, strict=True)]
    return {
        "greedy_agreement": shared / sum(len(out) for out in base.outputs),
        "exact_outputs": sum(a == b for a, b in zip(run.outputs, base.outputs)) / len(base.outputs),
        "mean_abs_delta_logprob": statistics.fmean(deltas),
        "max_abs_delta_logprob": max(deltas),
        "scored_tokens": len(deltas),
    }


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", help="folder, .gguf or hub id (default: embedded SmolLM2-135M-Instruct)")
    parser.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    parser.add_argument("--max-tokens", type=int, default=64, help="greedy tokens per prompt (fewer at EOS)")
    parser.add_argument("--out", help="write the report here as JSON")
    parser.add_argument(
        "--engines", default=",".join(n for n in ENGINES if n != BASE), help="which of ENGINES to compare"
    )
    parser.add_argument(
        "--fp8-checkpoints",
        action="store_true",
        help="also serve the model saved as FP8 checkpoints (benchmarks/fp8_checkpoints.py): with 128 x 128 block "
        "scales (served with them) and with one scale per tensor (re-quantized per channel as it loads), and the "
        "block checkpoint's values in bfloat16",
    )
    args = parser.parse_args(argv)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    model = str(resolve_model(args.model))
    runs = {name: (model, ENGINES[name]) for name in args.engines.split(",") if name}
    scratch = tempfile.TemporaryDirectory()
    if args.fp8_checkpoints:
        runs |= fp8_checkpoint_runs(Path(model), Path(scratch.name))
    base = run_engine(model, args.device, ENGINES[BASE], args.max_tokens, None)
    compared = {
        name: compare(run_engine(folder, args.device, engine, args.max_tokens, base), base)
        for name, (folder, engine) in runs.items()
    }
    scratch.cleanup()
    print(f"against {BASE}, {len(base.outputs)} prompts, greedy up to {args.max_tokens} tokens")
    print("| engine | greedy agreement | exact outputs | mean abs Δ logprob | max abs Δ logprob |")
    print("| --- | --- | --- | --- | --- |")
    for name, c in compared.items():
        print(
            f"| {name} | {c['greedy_agreement']:.1%} | {c['exact_outputs']:.1%} | "
            f"{c['mean_abs_delta_logprob']:.4f} | {c['max_abs_delta_logprob']:.3f} |"
        )
    report = {
        "model": model,
        "device": args.device,
        "commit": commit,
        "base": BASE,
        "prompts": len(base.outputs),
        "max_tokens": args.max_tokens,
        "base_tokens": sum(len(out) for out in base.outputs),
        "base_mean_logprob": statistics.fmean(lp for scored in base.scored for lp in scored),
        "compared": compared,
    }
    if args.out:
        with open(args.out, "w") as f:
            json.dump(report, f, indent=1)
    return report


if __name__ == "__main__":
    main()
