"""Tensor parallelism, TP=1 against TP=N, in process (`offline.LLM`, rank 0 here, the others spawned):
are the greedy tokens the same, and how long does a decode step take? On two or more GPUs, first: how long
does one all-reduce of a decode step's size take, through NCCL and one-shot over peer memory
(gpu_worker/all_reduce.py)?

    python -m benchmarks.tensor_parallel --model ../shared/models/gpt2 --load-format dummy --dtype float32 \\
        --tp-sizes 1,2 --batch 32
    python -m benchmarks.shapes llama-3-8b /tmp/shapes/llama-3-8b --tokenizer-from .device-cache/gpt2
    python -m benchmarks.tensor_parallel --model /tmp/shapes/llama-3-8b --load-format dummy --tp-sizes 1,2 \\
        --batch 64                                     # 2 GPUs: all-reduce latencies, then the 8B decode step

Dummy weights are drawn whole and split, so every size holds the same model. The decode step is one
`LLM.step()` (plan, launch, read back; no overlap) of --batch one-token decodes, synchronised: on CUDA a
CUDA-graph replay unless --enforce-eager. Figures are medians of --decode-steps steps. The all-reduce
latencies are of [batch, --hidden-size] bf16 tensors on the largest TP size's GPUs, each the mean of
--all-reduce-repeats all-reduces captured back to back in a CUDA graph (as a decode step holds them); beside
them the residual add and norm alone ("norm") and the one-shot sum ending in them in one kernel ("fused"), which
is what a Llama layer runs in place of one-shot + norm.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from collections.abc import Callable
from dataclasses import replace
from functools import partial

import torch

from common.config import EngineConfig, add_engine_args
from common.sampling_params import SamplingParams

TARGET_TP2_STEP_RATIO = 0.6  # issue 29: a TP=2 decode step at most 0.6x TP=1's

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
        tp = llm._followers.tp if llm._followers is not None else None
        return {
            "device": str(llm.runner.device),
            "cuda_graphs": llm.runner.graphs is not None,
            "one_shot_all_reduce": tp is not None and tp.peer is not None,
            "decode_step_ms": statistics.median(times) * 1e3,
            "tokens": tokens,
        }


def all_reduce_latencies(size: int, batches: list[int], hidden: int, repeats: int) -> list[dict]:
    """Per batch: µs per all-reduce through NCCL, and one-shot where it could be set up, on `size` GPUs."""
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "latencies.json")
        mp.spawn(_all_reduce_rank, args=(size, tmp, batches, hidden, repeats, out), nprocs=size)
        with open(out) as f:
            return json.load(f)


def _all_reduce_rank(rank: int, size: int, tmp: str, batches: list[int], hidden: int, repeats: int, out: str):
    import torch.distributed as dist

    from gpu_worker.models import triton_ops
    from gpu_worker.parallel import close_tensor_parallel, init_tensor_parallel

    # Buffers for the largest batch, beyond the engine's threshold: where the two cross is what this measures.
    tp = init_tensor_parallel(rank, size, os.path.join(tmp, "store"), "cuda", peer_max_bytes=max(batches) * hidden * 2)
    device = torch.device("cuda", rank)
    peer = tp.peer
    rows = []
    for batch in batches:
        x = torch.randn(batch, hidden, dtype=torch.bfloat16, device=device)
        summed = x.clone()
        dist.all_reduce(summed)
        nccl_x = x.clone()
        row = {"batch": batch, "bytes": x.nbytes, "nccl_us": _graphed_us(partial(dist.all_reduce, nccl_x), repeats)}
        if peer is not None and peer.takes(x):
            row["one_shot_us"] = _graphed_us(partial(peer, x), repeats)
            row["one_shot_equals_nccl"] = bool(torch.equal(peer(x), summed))
        if peer is not None and peer.takes_rows(x, x):
            # A layer's real pair: the sum, then the residual add and norm; apart, and fused in one kernel.
            weight, residual = torch.randn(hidden, dtype=x.dtype, device=device), torch.randn_like(x)
            row["norm_us"] = _graphed_us(partial(triton_ops.add_rms_norm, summed, weight, 1e-5, residual), repeats)
            fused = partial(peer.sum_add_rms_norm, x, residual, weight, 1e-5, 0.0, False, False)
            row["one_shot_and_norm_fused_us"] = _graphed_us(fused, repeats)
        rows.append(row)
    if rank == 0:
        with open(out, "w") as f:
            json.dump(rows, f)
    close_tensor_parallel(tp)


def _graphed_us(all_reduce: Callable[[], object], repeats: int) -> float:
    """Mean µs of one call among `repeats` captured in one CUDA graph, over 5 replays after a warm one."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):  # eager warm-up (NCCL sets up its channels on first use)
            all_reduce()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(repeats):
            all_reduce()
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(5):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1e3 / (5 * repeats)


def print_all_reduce_latencies(size: int, rows: list[dict]) -> None:
    from gpu_worker.all_reduce import PEER_ALL_REDUCE_MAX_BYTES

    print(
        f"all-reduce on {size} GPUs, bf16, µs per call (the engine goes one-shot up to "
        f"{PEER_ALL_REDUCE_MAX_BYTES // 1024} KiB):"
    )
    print(f"{'batch':>6} {'KiB':>7} {'NCCL':>8} {'one-shot':>9} {'ratio':>6}  same sum  {'norm':>6} {'fused':>6}")
    for row in rows:
        one_shot = row.get("one_shot_us")
        ratio = f"{one_shot / row['nccl_us']:6.2f}" if one_shot else "     -"
        shot = f"{one_shot:9.1f}" if one_shot else "        -"
        norm, fused = row.get("norm_us"), row.get("one_shot_and_norm_fused_us")
        print(
            f"{row['batch']:>6} {row['bytes'] / 1024:>7.0f} {row['nccl_us']:>8.1f} {shot} {ratio}  "
            f"{row.get('one_shot_equals_nccl', '-')!s:>8}  {norm or 0:6.1f} {fused or 0:6.1f}",
            flush=True,
        )


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
    parser.add_argument(
        "--all-reduce-batches", default="1,2,4,8,16,32,64,128,256", help="decode batch sizes timed, comma-separated"
    )
    parser.add_argument("--hidden-size", type=int, default=4096, help="of the all-reduced tensors (Llama-3-8B's)")
    parser.add_argument("--all-reduce-repeats", type=int, default=50)
    add_engine_args(parser)
    args = parser.parse_args(argv)
    base = EngineConfig.from_args(args)
    report: dict = {}
    largest = max(int(x) for x in args.tp_sizes.split(","))
    latencies = None
    if largest < 2 or base.device == "cpu":
        print("all-reduce latencies: skipped (they need --tp-sizes above 1 on CUDA)")
    elif torch.cuda.device_count() < largest:
        print(f"all-reduce latencies: skipped ({largest} GPUs wanted, {torch.cuda.device_count()} visible)")
    else:
        batches = [int(x) for x in args.all_reduce_batches.split(",")]
        latencies = all_reduce_latencies(largest, batches, args.hidden_size, args.all_reduce_repeats)
        print_all_reduce_latencies(largest, latencies)
    for size in (int(x) for x in args.tp_sizes.split(",")):
        result = measure(replace(base, tensor_parallel_size=size), args)
        report[size] = result
        print(
            f"TP={size} on {result['device']} (CUDA graphs: {result['cuda_graphs']}, one-shot all-reduce: "
            f"{result['one_shot_all_reduce']}): decode step of {args.batch} sequences "
            f"{result['decode_step_ms']:.2f} ms (median of {args.decode_steps})",
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
        target = f" (target for TP=2 against TP=1: <= x{TARGET_TP2_STEP_RATIO})" if (sizes[0], size) == (1, 2) else ""
        print(
            f"TP={size} vs TP={sizes[0]}: token-exact {not mismatched} {mismatched or ''}; "
            f"decode step x{ratio:.2f}{target}"
        )
    out = {
        "decode_step_ms": {s: r["decode_step_ms"] for s, r in report.items()},
        "compare": summary,
        "all_reduce_us": latencies,
    }
    print(json.dumps(out, indent=1))
    return out


if __name__ == "__main__":
    main()
