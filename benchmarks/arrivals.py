"""Prompts that arrive together: TTFT of N simultaneous prompts against one prompt alone, through the real server.

    python -m benchmarks.arrivals --launch "--model M --device cpu" [--together 32 --rounds 5 --json FILE]

Rounds of one prompt alone, then rounds of `--together` prompts sent at once (one client process, each
prompt distinct so none reuses another's KV blocks), then the same two again, interleaved. The verdict is the
ratio of the medians: the slowest first token of a simultaneous round over a lone prompt's TTFT. When the
scheduler prefills prompts that arrive together in one step the ratio stays near 1 on a model whose step
costs about the same for one prompt as for 32 (a small model, few tokens each); each extra step they are
spread over adds one step time to it. Also printed: per round, the forwards the server ran until the last
first token (GET /stats `steps`), the steps the first tokens came from, how far apart each stage's stamp fell
across the N (the spread: where they stopped arriving together), and the slowest request's own stages.

With --launch, the floor under the ratio is measured too (benchmarks/engine_ttft.py): the same prompts in the
offline engine with the same flags, all N in one prefill, no HTTP; the server's ratio over it is the serving
path's share.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import json
import statistics
import time

import httpx

from benchmarks.engine_ttft import measure_in_child
from benchmarks.latency import RequestTimings
from benchmarks.load_client import make_session, send_request
from benchmarks.serve import LaunchedServer, server_stats
from benchmarks.workloads import WorkloadRequest
from common.engine_replica import is_scheduler_role


def prompt(index: int, words: int) -> str:
    """A prompt no other prompt shares a block with: its index first."""
    return f"{index} " + " ".join(["tell me about the weather"] * max(1, words // 5))


async def one_round(session, prompts: list[str], max_tokens: int) -> list[RequestTimings]:
    sampling = {"temperature": 0.0, "ignore_eos": True}
    requests = [WorkloadRequest(max_tokens, p) for p in prompts]
    return list(await asyncio.gather(*(send_request(session, r, sampling) for r in requests)))


def ttfts_ms(timings: list[RequestTimings]) -> list[float]:
    bad = [t.error for t in timings if not t.ok]
    if bad:
        raise RuntimeError(f"{len(bad)} requests failed, the first: {bad[0]}")
    return [1000 * (t.token_streamed[0] - t.submit) for t in timings]


# Each stage of a request's first token: who holds it (benchmarks/latency.py has the clock).
STAGES = {
    "submit_to_arrival": lambda t: t.arrival - t.submit,  # the client's send, the frontend's HTTP intake
    "tokenize": lambda t: t.tokenized - t.arrival,  # frontend -> tokenizer worker, tokenizing
    "to_scheduler": lambda t: t.queued - t.tokenized,  # tokenizer worker -> scheduler, admission into the queue
    "wait_for_plan": lambda t: t.first_scheduled - t.queued,  # behind the plans in flight
    "prefill": lambda t: t.token_sampled[0] - t.first_scheduled,  # its prefill plan, sent to the token sampled
    "stream": lambda t: t.token_streamed[0] - t.token_sampled[0],  # scheduler -> tokenizer worker -> frontend
}
# Each stamp on the way to the first token: how far apart it fell across the round's requests.
STAMPS = {
    "submit": lambda t: t.submit,
    "arrival": lambda t: t.arrival,
    "tokenized": lambda t: t.tokenized,
    "queued": lambda t: t.queued,
    "first_scheduled": lambda t: t.first_scheduled,
    "first_sampled": lambda t: t.token_sampled[0],
    "first_streamed": lambda t: t.token_streamed[0],
}


def stages_ms_max(timings: list[RequestTimings]) -> dict[str, float]:
    """Each stage's longest time among the round's requests."""
    return {name: round(1000 * max(f(t) for t in timings), 1) for name, f in STAGES.items()}


def slowest_stages_ms(timings: list[RequestTimings]) -> dict[str, float]:
    """The stages of the request whose first token came last (from its own submit): where it waited."""
    slowest = max(timings, key=lambda t: t.token_streamed[0] - t.submit)
    return {name: round(1000 * f(slowest), 1) for name, f in STAGES.items()}


def spreads_ms(timings: list[RequestTimings]) -> dict[str, float]:
    """Each stamp's spread (latest - earliest) across the round: the stage where it grows holds the spread."""
    return {name: round(1000 * (max(map(f, timings)) - min(map(f, timings))), 1) for name, f in STAMPS.items()}


async def scheduler_steps(client: httpx.AsyncClient) -> int:
    stats = await server_stats(client) or {}
    return sum(int(s.get("steps", 0)) for role, s in stats.items() if is_scheduler_role(role))


async def measure(url: str, together: int, rounds: int, words: int, max_tokens: int) -> dict:
    """Rounds on one session: after the first round, every request reuses a kept-alive connection, so what is
    timed is the server's work, not TCP connects."""
    counter = iter(range(10**9))
    alone: list[float] = []
    groups: list[dict] = []
    async with make_session(url, {}) as session, httpx.AsyncClient(base_url=url, timeout=10) as stats:
        # Warm-up, left out: opens the connections the rounds reuse.
        await one_round(session, [prompt(next(counter), words) for _ in range(together)], max_tokens)
        for _ in range(rounds):
            alone.extend(ttfts_ms(await one_round(session, [prompt(next(counter), words)], max_tokens)))
            before = await scheduler_steps(stats)
            timings = await one_round(session, [prompt(next(counter), words) for _ in range(together)], max_tokens)
            steps = await scheduler_steps(stats) - before
            ttft = ttfts_ms(timings)
            groups.append(
                {
                    "ttft_ms_max": max(ttft),
                    "ttft_ms_p50": statistics.median(ttft),
                    "steps": steps,  # the round's forwards, decodes included
                    # The forwards the first tokens were sampled in (one: all prefilled together).
                    "first_token_steps": len({t.token_sampled[0] for t in timings}),
                    "arrival_spread_ms": 1000 * (max(t.arrival for t in timings) - min(t.arrival for t in timings)),
                    "first_scheduled_spread_ms": 1000
                    * (max(t.first_scheduled for t in timings) - min(t.first_scheduled for t in timings)),
                    "spreads_ms": spreads_ms(timings),
                    "slowest_stages_ms": slowest_stages_ms(timings),
                    "stages_ms_max": stages_ms_max(timings),
                }
            )
    alone_ms = statistics.median(alone)
    together_max = statistics.median(g["ttft_ms_max"] for g in groups)
    return {
        "together": together,
        "prompt_words": words,
        "max_tokens": max_tokens,
        "alone_ttft_ms": alone,
        "alone_ttft_ms_median": alone_ms,
        "rounds": groups,
        "together_ttft_ms_max_median": together_max,
        "together_ttft_ms_p50_median": statistics.median(g["ttft_ms_p50"] for g in groups),
        "ratio": together_max / alone_ms,
    }


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--launch", help="start `python launch.py ARGS` for the run (else --url)")
    parser.add_argument("--url", default="http://127.0.0.1:8000")
    parser.add_argument("--together", type=int, default=32, help="prompts sent at once in a round")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--prompt-words", type=int, default=10)
    parser.add_argument("--max-tokens", type=int, default=2)
    parser.add_argument("--json", help="write the figures here")
    parser.add_argument("--server-log", help="--launch: the server's output goes here (default: a temp file)")
    parser.add_argument(
        "--no-engine-floor", action="store_true", help="--launch: skip the offline engine's ratio (the floor)"
    )
    args = parser.parse_args(argv)
    started = time.time()
    if args.launch:
        with LaunchedServer(args.launch, args.server_log) as server:
            result = asyncio.run(measure(server.url, args.together, args.rounds, args.prompt_words, args.max_tokens))
        if not args.no_engine_floor:
            prompt_of = functools.partial(prompt, words=args.prompt_words)
            floor = measure_in_child(args.launch, prompt_of, args.together, args.rounds, args.max_tokens)
            result["engine_floor"] = floor
            result["server_over_floor"] = result["ratio"] / floor["ratio"]
    else:
        result = asyncio.run(measure(args.url, args.together, args.rounds, args.prompt_words, args.max_tokens))
    result["launch"] = args.launch
    result["wall_s"] = time.time() - started
    for g in result["rounds"]:
        print(
            f"{args.together} together: slowest TTFT {g['ttft_ms_max']:.1f} ms, median {g['ttft_ms_p50']:.1f} ms, "
            f"{g['steps']} forwards, first tokens from {g['first_token_steps']}; spreads {g['spreads_ms']}; "
            f"the slowest's stages {g['slowest_stages_ms']}"
        )
    print(
        f"one prompt: TTFT {result['alone_ttft_ms_median']:.1f} ms (median of {args.rounds}); "
        f"{args.together} together: slowest {result['together_ttft_ms_max_median']:.1f} ms "
        f"(median of {args.rounds}); ratio {result['ratio']:.2f}"
    )
    floor = result.get("engine_floor")
    if floor is not None:
        print(
            f"engine alone (offline, all {args.together} in one prefill): one prompt "
            f"{floor['alone_ttft_ms_median']:.1f} ms, {args.together} together "
            f"{floor['together_ttft_ms_max_median']:.1f} ms, ratio {floor['ratio']:.2f}"
            f" (the floor); the server's ratio is {result['server_over_floor']:.2f}x it"
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    return result


if __name__ == "__main__":
    main()
