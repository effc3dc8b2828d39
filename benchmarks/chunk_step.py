"""Steps that prefill a long prompt in chunks while other requests decode: the wall time of each, by the context
its chunk starts at, against a step of the decodes alone; and with --profile, the kernels that fill them.

    python -m benchmarks.chunk_step --model .device-cache/smollm2 --load-format dummy \\
        --prompt-len 7000 --chunk 512 --decodes 64 --profile

In-process (`offline.LLM`, one step at a time, synchronised): what the long-prompts pair of
benchmarks.scheduler_suite pays per mixed step, without the server around it. The chunk size is the prompt
budget (--max-num-batched-tokens); the decodes are short prompts that generate until the long prompt is done.
A step replayed from a CUDA graph may show in the profile as its launch alone: --enforce-eager shows each kernel
(at the eager step's host cost).
"""

from __future__ import annotations

import argparse
import statistics
import time
from dataclasses import replace

import torch

from common.config import EngineConfig, add_engine_args
from common.sampling_params import SamplingParams

DECODE_PROMPT_LEN = 16
DECODE_ONLY_STEPS = 5


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", help="folder, .gguf or hub id (default: embedded SmolLM2)")
    parser.add_argument("--prompt-len", type=int, default=7000, help="tokens of the long prompt")
    parser.add_argument("--chunk", type=int, default=512, help="prompt tokens per step (the prompt budget)")
    parser.add_argument("--decodes", type=int, default=64, help="requests decoding beside the chunks")
    parser.add_argument("--profile", action="store_true", help="print the kernels that take the chunk steps' time")
    parser.add_argument(
        "--sync-debug", action="store_true", help="warn where a pipelined step makes the host wait for the device"
    )
    add_engine_args(parser)
    args = parser.parse_args(argv)
    from offline import LLM

    config = replace(EngineConfig.from_args(args), max_num_batched_tokens=args.chunk)
    llm = LLM.from_config(config)
    llm.record_plans = True
    device = llm.runner.device
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)

    def timed_step() -> float:
        sync()
        start = time.perf_counter()
        llm.step()
        sync()
        return time.perf_counter() - start

    vocab = llm.runner.model.vocab_size
    num_chunks = -(-args.prompt_len // args.chunk)
    # Long enough to decode through their own prefill, both phases' decode-only steps and chunks.
    decoding = SamplingParams(max_tokens=2 * (num_chunks + 2 * DECODE_ONLY_STEPS) + 8, temperature=0.0, ignore_eos=True)
    prefilling = {
        llm.add_request([(31 * i + j) % (vocab - 1) + 1 for j in range(DECODE_PROMPT_LEN)], decoding)
        for i in range(args.decodes)
    }
    while prefilling:  # until every decode has its first token
        batch = llm.step()
        if batch is not None:
            prefilling -= set(batch.rids)
    decode_only = statistics.median(timed_step() for _ in range(DECODE_ONLY_STEPS)) * 1e3

    long_rid = llm.add_request(
        [(7 * j) % (vocab - 1) + 1 for j in range(args.prompt_len)], SamplingParams(max_tokens=1, temperature=0.0)
    )
    profiler = _profiler(device) if args.profile else None
    chunks = []
    if profiler is not None:
        profiler.__enter__()
    try:
        while True:
            seconds = timed_step()
            plan = llm.plans_executed[-1]
            mine = [c for c in plan.chunks if c.rid == long_rid]
            if not mine:
                break
            chunks.append({"start": mine[0].start, "tokens": mine[0].num_tokens, "ms": seconds * 1e3})
            if mine[0].sample:
                break
    finally:
        if profiler is not None:
            profiler.__exit__(None, None, None)

    # The same again as the server runs it: each step launched before the previous one's tokens are read.
    if args.sync_debug and device.type == "cuda":
        torch.cuda.set_sync_debug_mode("warn")
    pipelined_decode = _pipelined_ms_per_step(llm, None, DECODE_ONLY_STEPS * 4)
    second_rid = llm.add_request(
        [(11 * j) % (vocab - 1) + 1 for j in range(args.prompt_len)], SamplingParams(max_tokens=1, temperature=0.0)
    )
    pipelined_chunk = _pipelined_ms_per_step(llm, second_rid, None)
    if args.sync_debug and device.type == "cuda":
        torch.cuda.set_sync_debug_mode("default")

    print(f"device {device}, {args.decodes} decodes beside a {args.prompt_len}-token prompt in chunks of {args.chunk}")
    print(
        f"pipelined (as the server steps, no synchronisation): {pipelined_decode:.2f} ms per decode-only step, "
        f"{pipelined_chunk:.2f} ms per chunk step"
    )
    print(f"decodes alone: {decode_only:.2f} ms per step (median of {DECODE_ONLY_STEPS})")
    print(f"{'chunk at context':>18}{'tokens':>8}{'step ms':>10}")
    for c in chunks:
        print(f"{c['start']:>18}{c['tokens']:>8}{c['ms']:>10.2f}")
    if profiler is not None:
        sort = "cuda_time_total" if device.type == "cuda" else "self_cpu_time_total"
        print(profiler.key_averages().table(sort_by=sort, row_limit=15))
    return {
        "decode_only_ms": decode_only,
        "chunks": chunks,
        "pipelined_decode_ms": pipelined_decode,
        "pipelined_chunk_ms": pipelined_chunk,
    }


def _pipelined_ms_per_step(llm, long_rid: int | None, num_steps: int | None) -> float:
    """Mean wall time of steps run as `LLM.generate` runs them (the next launched before the last is read):
    `num_steps` decode-only steps, or (long_rid given) every step until that request's prompt is computed."""
    from gpu_worker.step_queue import StepQueue

    steps = StepQueue(llm.runner)
    launched = 0
    done = False
    start = time.perf_counter()
    while not done:
        plan = llm.scheduler.schedule()
        assert plan is not None, "the decodes ran out before the measurement ended"
        plan = llm._sent(plan)
        launched += 1
        if long_rid is None:
            done = launched >= num_steps
        else:
            done = any(c.rid == long_rid and c.sample for c in plan.chunks)
        for result in steps.launch(plan):
            llm._process(result)
    while steps:
        llm._process(steps.finish_oldest())
    return (time.perf_counter() - start) / launched * 1e3


def _profiler(device: torch.device) -> torch.profiler.profile:
    activities = [torch.profiler.ProfilerActivity.CPU]
    if device.type == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    return torch.profiler.profile(activities=activities)


if __name__ == "__main__":
    main()
