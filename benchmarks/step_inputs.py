"""The GPU worker's host work to build a step's inputs from its plan (`PersistentBatch.prepare`), without a
device: a decode step and a mixed step (decodes with prompt chunks behind them, as the scheduler plans them),
each timed over many repetitions.

    python -m benchmarks.step_inputs --decodes 440 --prompts 4 --prompt-len 300

The decodes' inputs are the tokens the step in flight samples (on the device, as at PIPELINE_DEPTH 2); the prompt
chunks' are on the host. Prints each step kind's mean µs.
"""

from __future__ import annotations

import argparse
import random
import time

import numpy as np

from gpu_worker.input_batch import PersistentBatch

BLOCK_SIZE = 16


def step_columns(rng: random.Random, decodes: int, prompts: int, prompt_len: int) -> tuple:
    """A plan's columns and the host's tokens: decodes first (the running batch), prompt chunks last (admitted)."""
    starts = [rng.randrange(100, 600) for _ in range(decodes)] + [0] * prompts
    num_tokens = [1] * decodes + [prompt_len] * prompts
    known = [[7] * start for start in starts[:decodes]] + [[5] * prompt_len for _ in range(prompts)]
    n = decodes + prompts
    return list(range(n)), starts, num_tokens, [True] * n, list(range(n)), [len(k) for k in known], known


def time_prepare(batch: PersistentBatch, columns: tuple, repeats: int) -> float:
    rids, starts, num_tokens, samples, slots, num_known, known = columns

    def prepare():
        return batch.prepare(
            rids,
            np.array(starts, np.int64),
            np.array(num_tokens, np.int64),
            np.array(samples, bool),
            np.array(slots, np.int64),
            np.array(num_known, np.int64),
            known,
        )

    for _ in range(min(50, repeats)):
        prepare()
    start = time.perf_counter()
    for _ in range(repeats):
        prepare()
    return (time.perf_counter() - start) / repeats


def main(argv: list[str] | None = None) -> dict[str, float]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--decodes", type=int, default=440)
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--prompt-len", type=int, default=300)
    parser.add_argument("--repeats", type=int, default=3000)
    args = parser.parse_args(argv)
    rng = random.Random(0)
    n = args.decodes + args.prompts
    batch = PersistentBatch(n, -(-(600 + args.prompt_len) // BLOCK_SIZE), BLOCK_SIZE)
    for slot in range(n):
        batch.append_blocks(slot, [rng.randrange(30000) for _ in range(batch.block_table.shape[1])])
    summary = {
        "decode": time_prepare(batch, step_columns(rng, args.decodes, 0, args.prompt_len), args.repeats),
        "mixed": time_prepare(batch, step_columns(rng, args.decodes, args.prompts, args.prompt_len), args.repeats),
    }
    print(f"decode step, {args.decodes} decodes: {1e6 * summary['decode']:.1f} µs")
    print(f"mixed step, + {args.prompts} prompt chunks of {args.prompt_len}: {1e6 * summary['mixed']:.1f} µs")
    return summary


if __name__ == "__main__":
    main()
