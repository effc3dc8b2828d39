"""Warm-up: run every kind of step once before the worker reports READY, so that no request pays for a
kernel compile or an autotune: prefill, graph decode, and mixed steps whose decodes take both attention
paths (a long context is split, short ones are not).

Four requests (negative ids, never the scheduler's) on blocks from 0 up, before any request has one:

    step -1:  prefill a, prefill b (long)
    step -2:  decode a, decode b                      (a CUDA graph where there are graphs)
    step -3:  prefill c + decode b (long context: split-KV path)
    step -4:  prefill d + decode a (short context: unsplit path)
    step -9:  release all four
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from common.messages import NewRequestSpec, ScheduledChunk, StepPlan
from common.sampling_params import SamplingParams

if TYPE_CHECKING:
    from gpu_worker.model_runner import ModelRunner

WARM_UP_REQUESTS = 4  # mirrors alive at once during warm-up


def warm_up(runner: ModelRunner) -> None:
    greedy = SamplingParams(temperature=0.0, seed=0)
    bs = runner.block_size
    max_model_len = runner.info.max_model_len
    room = (runner.num_kv_blocks // WARM_UP_REQUESTS) * bs - 2  # tokens each request may use
    short = min(16, max_model_len - 2, room)
    if short < 1:
        return  # a pool this small is a test's; nothing worth warming
    long = min(1024, max_model_len - 2, room) if runner.device.type == "cuda" else short
    a, b, c, d = -1, -2, -3, -4
    lengths = {a: short, b: long, c: short, d: short}
    tables, first = {}, 0
    for rid, n in lengths.items():  # room for the prompt and two decoded tokens, blocks side by side
        used = -(-(n + 2) // bs)
        tables[rid], first = list(range(first, first + used)), first + used
    new = {rid: NewRequestSpec(rid, [1] * n, greedy, 0) for rid, n in lengths.items()}

    def prefill(rid: int) -> ScheduledChunk:
        return ScheduledChunk(rid, 0, lengths[rid], tables[rid], True)

    steps = [
        ([new[a], new[b]], [prefill(a), prefill(b)]),
        ([], [ScheduledChunk(a, short, 1, [], True), ScheduledChunk(b, long, 1, [], True)]),  # decode
        ([new[c]], [prefill(c), ScheduledChunk(b, long + 1, 1, [], True)]),  # mixed, long decode
        ([new[d]], [prefill(d), ScheduledChunk(a, short + 1, 1, [], True)]),  # mixed, short decode
    ]
    for i, (specs, chunks) in enumerate(steps):
        runner.execute(StepPlan(-1 - i, specs, chunks, []))
    runner.execute(StepPlan(-9, [], [], list(lengths)))
