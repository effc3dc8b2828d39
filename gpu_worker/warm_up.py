"""Warm-up: run every kind of step once before the worker reports READY (builder.py), so that no request pays for a
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

import torch
from torch import nn

from common.messages import NewRequestSpec, ScheduledChunk, StepPlan
from common.sampling_params import SamplingParams
from gpu_worker.input_batch import eager_bucket

if TYPE_CHECKING:
    from gpu_worker.model_runner import ModelRunner

WARM_UP_REQUESTS = 4  # mirrors alive at once during warm-up


def warm_up(runner: ModelRunner, block_size: int) -> None:
    greedy = SamplingParams(temperature=0.0, seed=0)
    bs = block_size
    max_model_len = runner.info.max_model_len
    room = (runner.limits.num_kv_blocks // WARM_UP_REQUESTS) * bs - 2  # tokens each request may use
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
        runner.execute(StepPlan.of(-1 - i, specs, chunks, []))
    runner.execute(StepPlan.of(-9, [], [], list(lengths)))
    if runner.eager.pad:
        warm_up_matmuls(runner)


@torch.inference_mode()
def warm_up_matmuls(runner: ModelRunner) -> None:
    """Each linear layer and the LM head once at every padded size an eager step may have (eager_bucket):
    cuBLAS picks its kernel for a shape it has not seen at ~150 µs of host time per layer, which the
    first prefill steps of every new size would otherwise pay (tens of milliseconds each)."""
    model = runner.model
    largest = runner.limits.max_num_batched_tokens + runner.limits.max_num_seqs
    sizes = sorted({eager_bucket(n) for n in range(1, largest + 1)})
    # One layer of each distinct shape is enough: the choice is cached per shape, not per weight. The LM head
    # (vocabulary-wide) only ever sees the sampling rows, at most one per running request.
    layers = {
        (m.in_features, m.out_features, m.bias is not None): m
        for m in model.modules()
        if isinstance(m, nn.Linear) and m.out_features < model.vocab_size
    }
    width = next(m for m in model.modules() if isinstance(m, nn.Embedding)).embedding_dim

    def zeros(rows: int, columns: int) -> torch.Tensor:
        return torch.zeros(rows, columns, dtype=runner.dtype, device=runner.device)

    for size in sizes:
        for layer in layers.values():
            layer(zeros(size, layer.in_features))
        if size <= runner.limits.max_num_seqs:
            model.compute_logits(zeros(size, width))
    if runner.device.type == "cuda":
        torch.cuda.synchronize(runner.device)
