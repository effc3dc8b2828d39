"""The GPU worker's host work between a plan's arrival and its graph's launch, the parts that need no device: a
decode step and a mixed step (decodes with prompt chunks behind them, as the scheduler plans them), each timed
over many repetitions.

    python -m benchmarks.step_inputs --decodes 440 --prompts 4 --prompt-len 300

    plan:    the plan decoded from its msgpack bytes (common/wire.py)
    update:  its new blocks (one to every sixteenth decode, as 16-token blocks do) into the block tables
    inputs:  the step's inputs from the plan and the request mirrors (RequestMirrors.step_inputs)
    graph:   a mixed step's static graph inputs filled from them (MixedStepLayout.fill: tiles, decode slices)

The decodes' inputs are the tokens the step in flight samples (on the device, as at PIPELINE_DEPTH 2); the prompt
chunks' are on the host. Prints each part's µs per step kind (the median of batches' means: the machine may be
shared).
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from collections.abc import Callable

import torch

from common import wire
from common.messages import NewRequestSpec, StepPlan
from common.sampling_params import SamplingParams
from gpu_worker.attention.triton_backend import TritonAttention
from gpu_worker.graph_capture import GraphInputs
from gpu_worker.mixed_graphs import MixedStepLayout
from gpu_worker.request_mirrors import RequestMirrors

BLOCK_SIZE = 16
NUM_KV_HEADS = 12  # GPT-2 small's: sizes the decodes' slices
VOCAB_SIZE = 50257
BATCHES = 15


def seated_mirrors(rng: random.Random, decodes: int, prompts: int, prompt_len: int) -> RequestMirrors:
    """Mirrors of `decodes` running requests (100-600 tokens held) and `prompts` admitted ones, every block given."""
    n = decodes + prompts
    width = -(-(600 + prompt_len) // BLOCK_SIZE)
    mirrors = RequestMirrors(n, width, BLOCK_SIZE, VOCAB_SIZE, torch.device("cpu"))
    lengths = [rng.randrange(100, 600) for _ in range(decodes)] + [prompt_len] * prompts
    greedy = SamplingParams(temperature=0.0, max_tokens=None, seed=0)
    specs = [NewRequestSpec(rid, [7] * length, greedy, 0) for rid, length in enumerate(lengths)]
    blocks = {
        rid: [rng.randrange(30000) for _ in range(-(-length // BLOCK_SIZE))] for rid, length in enumerate(lengths)
    }
    mirrors.update(StepPlan(0, specs, [], [], [], [], [], blocks))
    return mirrors


def step_plan(mirrors: RequestMirrors, decodes: int, prompts: int) -> StepPlan:
    """Each decode computes the token the step in flight samples; each prompt chunk its whole prompt."""
    rids = list(range(decodes + prompts))
    starts = [len(mirrors[rid].token_ids) for rid in rids[:decodes]] + [0] * prompts
    num_tokens = [1] * decodes + [len(mirrors[rid].token_ids) for rid in rids[decodes:]]
    new_blocks = {rid: [30000 + rid] for rid in range(0, decodes, BLOCK_SIZE)}
    return StepPlan(1, [], rids, starts, num_tokens, [True] * len(rids), [], new_blocks)


def mean_seconds(work: Callable[[], object], repeats: int) -> float:
    """The median of BATCHES batches' means: a batch that other processes slowed down does not move it."""
    for _ in range(min(50, repeats)):
        work()
    per_batch = max(1, repeats // BATCHES)
    means = []
    for _ in range(BATCHES):
        start = time.perf_counter()
        for _ in range(per_batch):
            work()
        means.append((time.perf_counter() - start) / per_batch)
    return statistics.median(means)


def time_step(mirrors: RequestMirrors, plan: StepPlan, repeats: int) -> dict[str, float]:
    data = wire.encode(plan)
    num_blocks = mirrors.batch.num_blocks.copy()

    def update():
        mirrors.update(plan)
        mirrors.batch.num_blocks[:] = num_blocks  # the tables as they were, for the next repetition

    times = {
        "plan": mean_seconds(lambda: wire.decode(data), repeats),
        "update": mean_seconds(update, repeats),
        "inputs": mean_seconds(lambda: mirrors.step_inputs(plan), repeats),
    }
    _, inputs = mirrors.step_inputs(plan)
    if inputs.layout.num_prefill_seqs:
        num_tokens, num_seqs = len(inputs.input_ids), len(inputs.layout.query_lens)
        layout = MixedStepLayout(num_tokens, num_seqs, mirrors.batch.block_table.shape[1], 0, attention())
        fields = GraphInputs(layout.shapes, torch.device("cpu"))

        times["graph"] = mean_seconds(lambda: layout.fill_step(fields.fill(), inputs), repeats)
    return times


def attention() -> TritonAttention:
    return TritonAttention(BLOCK_SIZE, NUM_KV_HEADS)  # on a CPU it plans the slices as for an H100's SMs


def main(argv: list[str] | None = None) -> dict[str, dict[str, float]]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--decodes", type=int, default=440)
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--prompt-len", type=int, default=300)
    parser.add_argument("--repeats", type=int, default=3000)
    args = parser.parse_args(argv)
    mirrors = seated_mirrors(random.Random(0), args.decodes, args.prompts, args.prompt_len)
    summary = {
        "decode": time_step(mirrors, step_plan(mirrors, args.decodes, 0), args.repeats),
        "mixed": time_step(mirrors, step_plan(mirrors, args.decodes, args.prompts), args.repeats),
    }
    kinds = {"decode": f"{args.decodes} decodes", "mixed": f"+ {args.prompts} prompt chunks of {args.prompt_len}"}
    for kind, times in summary.items():
        parts = ", ".join(f"{part} {1e6 * seconds:.1f}" for part, seconds in times.items())
        print(f"{kind} step ({kinds[kind]}), µs: {parts}; total {1e6 * sum(times.values()):.1f}")
    return summary


if __name__ == "__main__":
    main()
