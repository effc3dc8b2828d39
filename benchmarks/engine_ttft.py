"""The floor under benchmarks/arrivals.py's ratio: N prompts' TTFT against one prompt's in the engine alone.

The offline engine (offline/llm.py: the scheduler and the model runner in one process, no HTTP, no tokenizer
worker) is given the same prompts as token ids, all N before its first plan: the best any server can do with
prompts that arrive together is one prefill of all of them, and this times exactly that. What the server's
ratio has above this one is the serving path's: taking the N requests in, handing them over, streaming back.

It runs in a child spawned as the launcher spawns a GPU worker (its share of the cores, idle threads asleep:
common/cpu_threads.py), so its forward runs as the server's does.
"""

from __future__ import annotations

import multiprocessing as mp
import shlex
import statistics
import time
from collections.abc import Callable


def measure_in_child(launch_args: str, prompt_of: Callable[[int], str], together: int, rounds: int, max_tokens: int):
    """{"alone_ttft_ms_median", "together_ttft_ms_max_median", "ratio", ...} from a child process."""
    from common.cpu_threads import forward_on_cpu, machine_cores, spawned_with_threads
    from launch import parse_args

    args = parse_args(shlex.split(launch_args))
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    child = ctx.Process(target=_measure, args=(queue, launch_args, prompt_of, together, rounds, max_tokens))
    with spawned_with_threads(args.cpu_threads or machine_cores(), forward_on_cpu(args.device)):
        child.start()
    result = queue.get(timeout=600)
    child.join()
    if isinstance(result, str):
        raise RuntimeError(f"the offline engine failed: {result}")
    return result


def _measure(queue, launch_args: str, prompt_of, together: int, rounds: int, max_tokens: int) -> None:
    try:
        queue.put(engine_ttfts(launch_args, prompt_of, together, rounds, max_tokens))
    except Exception as exc:  # the parent reports it
        queue.put(f"{type(exc).__name__}: {exc}")


def engine_ttfts(launch_args: str, prompt_of: Callable[[int], str], together: int, rounds: int, max_tokens: int):
    from common.config import EngineConfig
    from common.sampling_params import SamplingParams
    from launch import parse_args
    from offline import LLM

    llm = LLM.from_config(EngineConfig.from_args(parse_args(shlex.split(launch_args))))
    sampling = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    counter = iter(range(10**9))

    def slowest_ttft_ms(n: int) -> float:
        prompts = [llm.tokenizer.encode(prompt_of(next(counter))) for _ in range(n)]  # as a tokenizer worker did
        started = time.time()
        outputs = llm.generate(prompts, sampling)
        return 1000 * (max(o.first_token_time for o in outputs) - started)

    slowest_ttft_ms(together)  # warm-up, left out, as the server's
    alone, groups = [], []
    for _ in range(rounds):
        alone.append(slowest_ttft_ms(1))
        groups.append(slowest_ttft_ms(together))
    llm.close()
    return {
        "alone_ttft_ms": alone,
        "together_ttft_ms_max": groups,
        "alone_ttft_ms_median": statistics.median(alone),
        "together_ttft_ms_max_median": statistics.median(groups),
        "ratio": statistics.median(groups) / statistics.median(alone),
    }
