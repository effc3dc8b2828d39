"""Wall time of one engine step that admits a prompt of N tokens, in-process (`offline.LLM`, no overlap).

    python -m benchmarks.step_time --model ../shared/models/gpt2 --load-format dummy --prompt-lens 4,23,158

On a GPU such a step replays a CUDA graph of its token-count bucket (gpu_worker/mixed_graphs.py); with
--enforce-eager it runs op by op and mostly measures how fast the host launches the forward's kernels. Each
figure is the median of --repeats steps, synchronised.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from common.config import EngineConfig, add_engine_args
from common.sampling_params import SamplingParams


def main(argv: list[str] | None = None) -> dict[int, float]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", help="folder, .gguf or hub id (default: embedded SmolLM2)")
    parser.add_argument("--prompt-lens", default="4,23,158", help="comma-separated prompt lengths")
    parser.add_argument("--repeats", type=int, default=7)
    add_engine_args(parser)
    args = parser.parse_args(argv)
    from offline import LLM

    llm = LLM.from_config(EngineConfig.from_args(args))
    params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    sync = torch.cuda.synchronize if llm.runner.device.type == "cuda" else (lambda: None)
    results = {}
    print(f"device {llm.runner.device}, attention {type(llm.runner.attention).__name__}")
    for n in (int(x) for x in args.prompt_lens.split(",")):
        times = []
        for i in range(args.repeats):
            llm.add_request([(7 * i + j) % 1000 + 1 for j in range(n)], params)
            sync()
            start = time.perf_counter()
            llm.step()
            sync()
            times.append(time.perf_counter() - start)
        results[n] = statistics.median(times) * 1e3
        print(f"prompt {n:>5} tokens: step {results[n]:7.1f} ms (median of {args.repeats})")
    return results


if __name__ == "__main__":
    main()
