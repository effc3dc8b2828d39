"""The scheduler process's own work per step, without a model: N requests decoding in steady state, results
answered at once by a fake worker one step late (as at PIPELINE_DEPTH 2).

    python -m benchmarks.scheduler_step --requests 256 --steps 3000

Per step, the parts the scheduler loop does between a result and the streamed tokens (scheduler/process.py):
decode the result, `process_result`, `schedule`, encode the plan, split and encode the token batches for
--tokenizers workers. Prints each part's median and mean in ms, and the collector's pauses; start-up's objects
are frozen first, as the scheduler process does (common/garbage.py). Requests all start together, so every
block-size-th step is the one where each fills a block (the mean shows it, the median does not).

    python -m benchmarks.scheduler_step --bursts 3 --requests 1024 --max-num-seqs 512 --num-blocks 32768

--bursts: the requests come and go instead, as in a served burst (W1's shape: prompts of 64-512 unique tokens,
256 new ones), the whole burst run --bursts times on one scheduler; a burst's blocks outnumber --num-blocks, so
from the second burst on the prefix cache evicts what the last one left. Prints each burst's scheduler seconds
(the same parts, summed), µs per token, and the part from results to plans (the chain the device may wait on).

    python -m benchmarks.scheduler_step --arrival-rate 800 --step-ms 4 --steps 3000

--arrival-rate: requests arrive as a Poisson process at that many per second on a clock that advances --step-ms per
step (W1's prompts, outputs of 16-256 tokens: at 800/s and 4 ms, a few requests arrive and a few finish each step,
~430 running, as on a served GPU). Prints the shape of the steps, each part's mean in ms, the chain from
results to plans (mean, p50, p99), and the collector's pauses, over --steps steps past a --warmup-steps warm-up that
fills the batch.
"""

from __future__ import annotations

import argparse
import statistics
import time

from common.config import EngineConfig
from common.garbage import freeze_startup_objects, process_gc_pauses
from common.messages import StageTimes, StepPlan, StepResult, StepTimings, TokenizedRequest
from common.model_info import ModelInfo
from common.sampling_params import SamplingParams
from common.wire import decode, encode
from gpu_worker.limits import decide_limits
from scheduler.process import split_by_tokenizer
from scheduler.scheduler import Scheduler

PARTS = ("decode result", "process_result", "schedule", "encode plan", "stream tokens")


def main(argv: list[str] | None = None) -> dict[str, float]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=256)
    parser.add_argument("--prompt-len", type=int, default=300)
    parser.add_argument("--steps", type=int, default=3000)
    parser.add_argument("--tokenizers", type=int, default=2)
    parser.add_argument("--bursts", type=int, default=0, help="requests that come and go, this many bursts of them")
    parser.add_argument("--arrival-rate", type=float, default=0.0, help="requests per second that arrive, Poisson")
    parser.add_argument("--step-ms", type=float, default=4.0, help="--arrival-rate: the simulated clock's step")
    parser.add_argument("--warmup-steps", type=int, default=300, help="--arrival-rate: steps not timed")
    parser.add_argument("--max-num-seqs", type=int, default=512, help="--bursts, --arrival-rate: the batch's seats")
    parser.add_argument("--num-blocks", type=int, default=32768, help="--bursts, --arrival-rate: KV blocks")
    args = parser.parse_args(argv)
    if args.bursts:
        return bursts(args)
    if args.arrival_rate:
        return arrivals(args)

    config = EngineConfig(block_size=16, max_num_seqs=args.requests, max_num_batched_tokens=8192)
    # Blocks for every request's whole run: no eviction or preemption in the way of the steady state.
    num_blocks = args.requests * -(-(args.prompt_len + args.steps + 2) // config.block_size) + 1
    info = ModelInfo("gpt2", 10**6, [50256], 50257)
    scheduler = Scheduler(config, info, decide_limits(config, info, on_gpu=False, num_kv_blocks=num_blocks))
    sampling = SamplingParams(max_tokens=args.steps + 2, ignore_eos=True)  # decoding until the last step
    for rid in range(args.requests):
        prompt = [100 + (rid + i) % 1000 for i in range(args.prompt_len)]
        scheduler.add_request(TokenizedRequest(rid, prompt, sampling, StageTimes()))
    freeze_startup_objects()

    in_flight = [p for p in (scheduler.schedule(), scheduler.schedule()) if p is not None]
    if not in_flight:
        raise SystemExit("the scheduler planned nothing: were the requests refused?")
    times: list[list[float]] = []
    for step in range(args.steps):
        data = result_of(in_flight.pop(0))
        t = [time.perf_counter()]
        result = decode(data)
        t.append(time.perf_counter())
        batch = scheduler.process_result(result)
        t.append(time.perf_counter())
        plan = scheduler.schedule()
        t.append(time.perf_counter())
        if plan is not None:
            encode(plan)
            in_flight.append(plan)
        t.append(time.perf_counter())
        for part in split_by_tokenizer(batch, args.tokenizers).values():
            encode(part)
        t.append(time.perf_counter())
        if step >= args.steps // 10 and plan is not None:  # past the prefills
            times.append([b - a for a, b in zip(t, t[1:])])
        if not in_flight:
            raise SystemExit(f"no plan in flight after step {step}")

    summary = {}
    for name, column in zip(PARTS, zip(*times)):
        summary[name] = statistics.median(column) * 1e3
        print(f"{name:16s} median {summary[name]:.3f} ms   mean {statistics.mean(column) * 1e3:.3f} ms")
    totals = [sum(row) for row in times]
    summary["total"] = statistics.median(totals) * 1e3
    print(f"{'total':16s} median {summary['total']:.3f} ms   mean {statistics.mean(totals) * 1e3:.3f} ms")
    print_gc_pauses()
    return summary


def print_gc_pauses() -> None:
    gc = process_gc_pauses().summary()
    print(
        f"collector: {gc['gc_collections']} pauses ({gc['gc_full_collections']} full), "
        f"{gc['gc_pause_s'] * 1e3:.1f} ms in all, the longest {gc['gc_max_pause_ms']:.2f} ms"
    )


def result_of(plan: StepPlan) -> bytes:
    """The fake worker's answer to a plan, as bytes off the wire: token 7 for every request that samples."""
    rids = [rid for rid, sample in zip(plan.rids, plan.samples) if sample]
    return encode(StepResult(plan.step_id, rids, [7] * len(rids), time.time(), StepTimings()))


def w1_scheduler(args: argparse.Namespace) -> Scheduler:
    """A scheduler for W1-shaped requests that come and go (--bursts, --arrival-rate): --max-num-seqs seats,
    --num-blocks KV blocks."""
    config = EngineConfig(block_size=16, max_num_seqs=args.max_num_seqs, max_num_batched_tokens=8192)
    info = ModelInfo("gpt2", 1024, [50256], 50257)
    return Scheduler(config, info, decide_limits(config, info, on_gpu=False, num_kv_blocks=args.num_blocks))


def bursts(args: argparse.Namespace) -> dict[str, float]:
    import random

    scheduler = w1_scheduler(args)
    sampling = SamplingParams(max_tokens=256, ignore_eos=True)
    freeze_startup_objects()
    rng = random.Random(0)
    top_up = getattr(scheduler, "top_up_free_blocks", lambda: 0)  # (a checkout from before it has none)
    summary: dict[str, float] = {}
    for burst in range(args.bursts):
        base = burst * args.requests
        for rid in range(base, base + args.requests):
            prompt = [rng.randrange(50000) for _ in range(rng.randint(64, 512))]
            scheduler.add_request(TokenizedRequest(rid, prompt, sampling, StageTimes()))
        in_flight = [p for p in (scheduler.schedule(), scheduler.schedule()) if p is not None]
        spent, chain, tokens, steps = 0.0, 0.0, 0, 0
        while in_flight:
            data = result_of(in_flight.pop(0))
            start = time.perf_counter()
            batch = scheduler.process_result(decode(data))
            for finished in batch.finish_reasons:
                scheduler.requests.pop(finished, None)
            for _ in range(2 - len(in_flight)):
                ahead = scheduler.schedule(ahead=bool(in_flight))
                if ahead is None:
                    break
                encode(ahead)
                in_flight.append(ahead)
            chain += time.perf_counter() - start  # from the result to the plans: what the device may wait for
            for part in split_by_tokenizer(batch, args.tokenizers).values():
                encode(part)
            top_up()  # as the server's loop does, after streaming
            spent += time.perf_counter() - start
            tokens += len(batch.rids)
            steps += 1
        summary[f"burst {burst + 1}"] = spent
        summary[f"burst {burst + 1} chain"] = chain
        per_token = 1e6 * spent / tokens
        print(
            f"burst {burst + 1}: {steps} steps, {tokens} tokens, scheduler {spent:.3f} s, {per_token:.2f} µs/token, "
            f"{chain:.3f} s of it from results to plans"
        )
    return summary


def arrivals(args: argparse.Namespace) -> dict[str, float]:
    import random

    scheduler = w1_scheduler(args)
    freeze_startup_objects()
    rng = random.Random(0)
    next_arrival, rid = rng.expovariate(args.arrival_rate), 0
    in_flight: list[StepPlan] = []
    times: list[list[float]] = []  # per timed step: each part's seconds
    shape: list[tuple[int, int, int, int, int]] = []  # per timed step: arrived, finished, running, prompt, decode
    for step in range(args.warmup_steps + args.steps):
        # Requests that arrived while the last step ran: the server's loop queues them in a wake-up of their own.
        arrived, clock = 0, step * args.step_ms / 1000
        while next_arrival <= clock:
            prompt = rng.choices(range(50000), k=rng.randint(64, 512))
            sampling = SamplingParams(max_tokens=rng.randint(16, 256), ignore_eos=True)
            scheduler.add_request(TokenizedRequest(rid, prompt, sampling, StageTimes()))
            rid, arrived = rid + 1, arrived + 1
            next_arrival += rng.expovariate(args.arrival_rate)
        if not in_flight:  # idle: the first requests, or a lull
            in_flight += [p for p in (scheduler.schedule(),) if p is not None]
            continue
        data = result_of(in_flight.pop(0))
        parts = [0.0] * len(PARTS)  # seconds, in PARTS' order
        start = time.perf_counter()
        result = decode(data)
        decoded = time.perf_counter()
        batch = scheduler.process_result(result)
        parts[0], parts[1] = decoded - start, time.perf_counter() - decoded
        while len(in_flight) < 2:  # one plan in flight while the next is made (PIPELINE_DEPTH 2)
            planning = time.perf_counter()
            ahead = scheduler.schedule(ahead=bool(in_flight))
            planned = time.perf_counter()
            parts[2] += planned - planning
            if ahead is None:
                break
            encode(ahead)
            parts[3] += time.perf_counter() - planned
            in_flight.append(ahead)
        streaming = time.perf_counter()
        for part in split_by_tokenizer(batch, args.tokenizers).values():
            encode(part)
        parts[4] = time.perf_counter() - streaming
        scheduler.top_up_free_blocks()  # as the server's loop does, off the chain
        if step >= args.warmup_steps:
            times.append(parts)
            stats = scheduler.stats
            shape.append(
                (
                    arrived,
                    len(batch.finish_reasons),
                    len(scheduler.running),
                    stats.last_step_prefill_tokens,
                    stats.last_step_decode_tokens,
                )
            )
    if not times:
        raise SystemExit("no step had a result to time: more steps, or a higher --arrival-rate")
    arrived_mean, finished_mean, running_mean, prompt_mean, decode_mean = (statistics.mean(c) for c in zip(*shape))
    print(
        f"{len(times)} steps: per step {arrived_mean:.1f} arrived, {finished_mean:.1f} finished, {running_mean:.0f} "
        f"running, {prompt_mean:.0f} prompt + {decode_mean:.0f} decode tokens planned"
    )
    summary = {"arrived": float(sum(row[0] for row in shape)), "finished": float(sum(row[1] for row in shape))}
    for name, column in zip(PARTS, zip(*times)):
        summary[name] = statistics.mean(column) * 1e3
        print(f"{name:16s} mean {summary[name]:.3f} ms   p50 {statistics.median(column) * 1e3:.3f} ms")
    chain = [sum(row[:4]) * 1e3 for row in times]  # decode, process, schedule, encode: until the plans are sent
    summary["results to plans mean"] = statistics.mean(chain)
    summary["results to plans p50"] = statistics.median(chain)
    summary["results to plans p99"] = statistics.quantiles(chain, n=100)[98] if len(chain) > 1 else chain[0]
    print(
        f"{'results to plans':16s} mean {summary['results to plans mean']:.3f} ms   "
        f"p50 {summary['results to plans p50']:.3f} ms   p99 {summary['results to plans p99']:.3f} ms"
    )
    print_gc_pauses()
    return summary


if __name__ == "__main__":
    main()
