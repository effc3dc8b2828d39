"""Where a decode step's GPU time goes: the kernels of --steps decode steps (torch profiler, rank 0), summed by
kind (matrix products, attention, all-reduce, norms, rotary, activation, KV writes, sampling, other), per step,
set against the step's wall time and its roofline floor.

    python -m benchmarks.shapes llama-3-8b /tmp/shapes/llama-3-8b --tokenizer-from .device-cache/gpt2
    python -m benchmarks.decode_breakdown --model /tmp/shapes/llama-3-8b --load-format dummy --batch 256 \\
        --prompt-lens 64-512 --warm-steps 128                       # add --tensor-parallel-size 2 on two GPUs

The batch decodes --warm-steps tokens before the profiled steps, so the contexts are W1's halfway (prompts of
64-512 tokens, 256 new). The sum of the kinds is the GPU's busy time; wall minus that sum is time the GPU waited
(the host, or a graph's gaps). With TP the all-reduce row includes the wait for the slower rank.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import re
import statistics
import time
from collections import defaultdict

import torch

from common.config import EngineConfig, add_engine_args
from common.sampling_params import SamplingParams

# First match wins: a kernel's name decides its kind. Attention before "gemm" (FlashInfer's prefill names it).
KINDS = (
    # (our one-shot kernels, all_reduce_kernels.py: _sum_kernel, and _sum_add_rms_norm_kernel with the norm in it)
    ("all-reduce", re.compile(r"allreduce|all_reduce|nccl|one_shot|multimem|symm|_sum_kernel|_sum_add_rms", re.I)),
    ("attention", re.compile(r"attention|attn|flashinfer|decode_kernel|paged|splitk_merge|merge_state", re.I)),
    # (cuBLAS's split-K products end in a reduce kernel of their own: splitKreduce_kernel)
    ("matmul", re.compile(r"gemm|gemv|sm90|cutlass|nvjet|matmul|_mm_|scaled_mm|xmma|fp8_linear|splitkreduce", re.I)),
    ("norm", re.compile(r"norm", re.I)),
    ("rotary", re.compile(r"rotary|rope", re.I)),
    ("kv write", re.compile(r"store_kv|kv_write|write_kv|reshape_and_cache|append|scatter|index_put", re.I)),
    ("activation", re.compile(r"silu|gelu|act_and_mul|swiglu", re.I)),
    ("sampling", re.compile(r"argmax|softmax|topk|sort|multinomial|sample|exponential|max_|reduce_kernel", re.I)),
    ("elementwise", re.compile(r"elementwise|vectorized|add|mul|copy|cat|fill", re.I)),
)


def kind_of(name: str) -> str:
    return next((kind for kind, pattern in KINDS if pattern.search(name)), "other")


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", help="folder, .gguf or hub id")
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--prompt-lens", default="64-512", help="LO-HI: prompt lengths drawn uniformly")
    parser.add_argument("--warm-steps", type=int, default=128, help="decode steps before the profiled ones")
    parser.add_argument("--steps", type=int, default=20, help="decode steps profiled")
    parser.add_argument("--top", type=int, default=12, help="kernels listed by name")
    parser.add_argument("--json", help="write the breakdown here")
    parser.add_argument(
        "--gpu-clocks",
        action="store_true",
        help="sample the SM clock and power over the profiled steps (nvidia-smi); print the floors at the clock held",
    )
    add_engine_args(parser)
    args = parser.parse_args(argv)
    config = EngineConfig.from_args(args)
    from benchmarks.gpu_clocks import GpuClockLog
    from benchmarks.gpu_clocks import describe as describe_clocks
    from benchmarks.roofline import gpu_peak
    from offline import LLM

    low, high = (int(x) for x in args.prompt_lens.split("-"))
    gen = torch.Generator().manual_seed(0)
    with LLM.from_config(config) as llm:
        vocab = llm.info.vocab_size
        cuda = llm.runner.device.type == "cuda"
        sync = torch.cuda.synchronize if cuda else (lambda: None)
        params = SamplingParams(max_tokens=args.warm_steps + args.steps + 8, temperature=0.0, ignore_eos=True)
        lens = torch.randint(low, high + 1, (args.batch,), generator=gen).tolist()
        for n in lens:
            llm.add_request(torch.randint(1, vocab, (n,), generator=gen).tolist(), params)
        for _ in range(args.warm_steps):  # the prefills (chunked as the budget takes them), then decodes
            llm.step()
        sync()
        walls = []
        activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
        clocks = GpuClockLog() if args.gpu_clocks and cuda else None
        with torch.profiler.profile(activities=activities) as prof, clocks or contextlib.nullcontext():
            for _ in range(args.steps):
                sync()
                start = time.perf_counter()
                llm.step()
                sync()
                walls.append(time.perf_counter() - start)
        by_kind: dict[str, float] = defaultdict(float)
        by_name: dict[str, list[float]] = defaultdict(lambda: [0.0, 0])
        for event in prof.events():
            if event.device_type != torch.autograd.DeviceType.CUDA:
                continue
            us = event.device_time_total if hasattr(event, "device_time_total") else event.cuda_time_total
            by_kind[kind_of(event.name)] += us
            by_name[event.name][0] += us
            by_name[event.name][1] += 1
        steps = args.steps
        wall_ms = statistics.median(walls) * 1e3
        busy_ms = sum(by_kind.values()) / steps / 1e3
        context_lens = [n + args.warm_steps + args.steps // 2 for n in lens]  # halfway through the profiled steps
        contexts = sum(context_lens) / len(context_lens)
        device_name = torch.cuda.get_device_name() if cuda else "cpu"
        peak = gpu_peak(device_name)
        floors = _floor_parts_ms(llm, args.model, context_lens, peak)
        floor = sum(floors.values()) if floors else None
        print(
            f"{device_name}, TP={config.tensor_parallel_size}, batch {args.batch}, mean context "
            f"{contexts:.0f}: decode step {wall_ms:.2f} ms wall (median of {steps}), GPU busy {busy_ms:.2f} ms, "
            + (f"floor {floor:.2f} ms" if floor else "floor unknown")
        )
        print(f"{'kind':<12} {'ms/step':>8} {'share':>6}   its floor (the kind's kernels at the roofline)")
        rows = sorted(by_kind.items(), key=lambda kv: -kv[1])
        for kind, us in rows:
            ms = us / steps / 1e3
            floor_of = floors.get(kind) if floors else None
            at = f"   {floor_of:.3f} ms, reached {100 * floor_of / ms:.0f}%" if floor_of else ""
            print(f"{kind:<12} {ms:8.3f} {100 * ms / wall_ms:5.1f}%{at}")
        print(f"{'idle':<12} {wall_ms - busy_ms:8.3f} {100 * (wall_ms - busy_ms) / wall_ms:5.1f}%")
        held = clocks.summary() if clocks is not None else None
        held_floors = None
        if held is not None:
            print(describe_clocks(held))
        if held is not None and peak is not None:
            mhz, rated = held["sm_mhz_p50"], peak.rated_sm_mhz
            held_floors = _floor_parts_ms(llm, args.model, context_lens, peak.at_sm_clock(mhz)) or {}
            reached = ", ".join(
                f"{kind} {ms:.3f} ms ({100 * ms * steps * 1e3 / by_kind[kind]:.0f}% reached)"
                for kind, ms in held_floors.items()
                if by_kind.get(kind)
            )
            print(f"floors at the SM clock held ({mhz:.0f} MHz; the FLOP rates are rated at {rated:.0f}): {reached}")
        print(f"top {args.top} kernels (ms/step, launches/step):")
        top = sorted(by_name.items(), key=lambda kv: -kv[1][0])[: args.top]
        for name, (us, count) in top:
            print(f"  {us / steps / 1e3:7.3f} {count / steps:6.0f}  {kind_of(name):<11} {name[:110]}")
        out = {
            "device": device_name,
            "tensor_parallel_size": config.tensor_parallel_size,
            "batch": args.batch,
            "mean_context": contexts,
            "decode_step_ms": wall_ms,
            "gpu_busy_ms": busy_ms,
            "floor_ms": floor,
            "floor_parts_ms": floors,
            "gpu_clocks": held,
            "floor_parts_at_held_clock_ms": held_floors,
            "kinds_ms": {k: us / steps / 1e3 for k, us in rows},
            "top_kernels": [{"name": n, "ms": us / steps / 1e3, "launches": c / steps} for n, (us, c) in top],
        }
        if args.json:
            with open(args.json, "w") as f:
                json.dump(out, f, indent=1)
        return out


def _floor_parts_ms(llm, folder: str, contexts: list[int], peak) -> dict[str, float] | None:
    """benchmarks/roofline.py's floor of one decode step of these contexts, for this rank's weights and KV: its
    matrix products' and its attention's, ms."""
    if peak is None:
        return None
    from pathlib import Path

    from benchmarks.roofline import ModelCost, decode_step_parts

    config = json.loads((Path(folder) / "config.json").read_text())
    kv_itemsize = llm.runner.eager.kv_cache.data.element_size()
    cost = ModelCost.of(llm.runner.model, config.get("num_attention_heads") or config["n_head"], kv_itemsize)
    parts = decode_step_parts(cost, contexts, peak, fp8=llm.config.quantization == "fp8")
    return {kind: 1e3 * seconds for kind, seconds in parts.items()}


if __name__ == "__main__":
    main()
