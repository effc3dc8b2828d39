"""Soak: a long run of mixed requests with random cancellations against a small KV pool (so requests are
preempted), that reports what a leak or a lost request would show.

    python -m benchmarks.soak --duration-s 1800 --output-json soak.json --plot soak_rss.png
    python -m benchmarks.soak --launch "--model ../shared/models/gpt2 --load-format dummy --device cpu \\
        --num-kv-blocks 48" --concurrency 32 --duration-s 600

Requests (seeded): completions or chat, streamed or not, n of 1, 2 or 4, shared prompt prefixes, 1-96 new
tokens, sometimes stop strings, structured output (repeated grammars and never-seen ones) or echo with
logprobs; a --cancel-fraction of the streams is dropped after a random number of chunks. Reports, at the end:
- lost requests: a stream that ended without a finish_reason or [DONE] (or an error event), or a request
  that got no answer within --request-timeout-s;
- outcomes and errors by type (HTTP status, error code, or exception class);
- RSS of every process over time (sampled from /proc every --sample-s; --plot draws it) and each one's
  trend over the run's second half, in MiB per minute;
- block accounting once the server is idle: blocks in use (0 expected) and free + cached == total.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import time
from collections import Counter
from pathlib import Path

import httpx

from benchmarks.serve import LaunchedServer

DEFAULT_LAUNCH = "--model ../shared/models/gpt2 --load-format dummy --device cpu --num-kv-blocks 48"
PREFIXES = ["You are a helpful assistant. ", "Summarize the following text: ", "Translate into French: ", ""]
WORDS = "the quick brown fox jumps over a lazy dog while seven wizards quietly judge boxing matches".split()  # noqa: SIM905


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--launch", default=DEFAULT_LAUNCH, help="launch.py arguments (ignored with --url)")
    p.add_argument("--url", default=None, help="a running server instead of launching one")
    p.add_argument("--duration-s", type=float, default=1800.0)
    p.add_argument("--num-requests", type=int, default=None, help="stop after this many instead")
    p.add_argument("--concurrency", type=int, default=32)
    p.add_argument("--cancel-fraction", type=float, default=0.1)
    p.add_argument("--request-timeout-s", type=float, default=300.0)
    p.add_argument("--sample-s", type=float, default=5.0, help="RSS sampling period")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--output-json", default=None)
    p.add_argument("--plot", default=None, help="PNG of RSS per process over time")
    return p.parse_args(argv)


# Structured outputs, as clients send them: a few grammars every request repeats (the compile cache's hits) and
# a choice list no one has sent before (a compile each time, and the cache's byte bound at work).
REPEATED_GRAMMARS = [
    {"choice": ["yes", "no", "maybe"]},
    {"regex": "[a-z]{1,8}( [a-z]{1,8}){0,3}"},
    {"json": {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}}}},
]


def structured_output(rng: random.Random) -> dict:
    if rng.random() < 0.3:
        return {"choice": [f"{rng.random():.6f} option {i}" for i in range(200)]}
    return rng.choice(REPEATED_GRAMMARS)


def make_request(rng: random.Random, chat: bool) -> tuple[str, dict]:
    """(path, body): one request of a random shape."""
    text = rng.choice(PREFIXES) + " ".join(rng.choices(WORDS, k=rng.randint(1, 120)))
    stream = rng.random() < 0.7
    body: dict = {"max_tokens": rng.randint(1, 96), "stream": stream, "temperature": rng.choice([0.0, 0.8])}
    if rng.random() < 0.2:
        body["n"] = rng.choice([2, 2, 4])
    if rng.random() < 0.1:
        body["structured_outputs"] = structured_output(rng)
    if rng.random() < 0.2:
        body["stop"] = [rng.choice(WORDS)]
    if not chat or rng.random() < 0.5:
        path, body["prompt"] = "/v1/completions", text
        if rng.random() < 0.05:  # the prompt's logprobs, shared by its n samples
            body["echo"], body["logprobs"] = True, 2
    else:
        path, body["messages"] = "/v1/chat/completions", [{"role": "user", "content": text}]
    return path, body


async def one_request(client: httpx.AsyncClient, path: str, body: dict, cancel_after: int | None) -> str:
    """The outcome: ok, cancelled, lost, or an error's name."""
    try:
        if not body["stream"]:
            response = await client.post(path, json=body)
            if response.status_code != 200:
                return _error_name(response.status_code, response.json())
            choices = response.json()["choices"]
            return "ok" if all(c["finish_reason"] for c in choices) else "lost"
        async with client.stream("POST", path, json=body) as response:
            if response.status_code != 200:
                await response.aread()
                return _error_name(response.status_code, response.json())
            finished, chunks, done = set(), 0, False
            async for line in response.aiter_lines():
                if not line.startswith("data: "):
                    continue
                data = line[len("data: ") :]
                if data == "[DONE]":
                    done = True
                    break
                event = json.loads(data)
                if "error" in event:
                    return _error_name(200, event)
                chunks += 1
                if cancel_after is not None and chunks >= cancel_after:
                    return "cancelled"  # leaving the block closes the connection: the server aborts
                finished.update(c["index"] for c in event.get("choices", []) if c.get("finish_reason"))
            return "ok" if done and len(finished) == body.get("n", 1) else "lost"
    except httpx.TimeoutException:
        return "lost"
    except httpx.HTTPError as exc:
        return type(exc).__name__


def _error_name(status: int, body: dict) -> str:
    error = body.get("error", {})
    return f"{status} {error.get('code') or error.get('type')}"


def rss_mib(pid: int) -> float | None:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024
    except FileNotFoundError:
        return None
    return None


async def sample_rss(client: httpx.AsyncClient, period: float, samples: list, stop: asyncio.Event) -> None:
    pids = {role: r["pid"] for role, r in (await client.get("/stats")).json()["replies"].items()}
    started = time.monotonic()
    while not stop.is_set():
        samples.append({"t": time.monotonic() - started, **{role: rss_mib(pid) for role, pid in pids.items()}})
        try:
            await asyncio.wait_for(stop.wait(), period)
        except asyncio.TimeoutError:
            pass


def trend_mib_per_min(samples: list[dict], role: str) -> float | None:
    """Least-squares slope of RSS over the second half of the run (the first half includes warm-up)."""
    points = [(s["t"], s[role]) for s in samples[len(samples) // 2 :] if s.get(role) is not None]
    if len(points) < 3:
        return None
    n = len(points)
    mt, mr = sum(t for t, _ in points) / n, sum(r for _, r in points) / n
    var = sum((t - mt) ** 2 for t, _ in points)
    return 60 * sum((t - mt) * (r - mr) for t, r in points) / var if var else None


async def block_accounting(client: httpx.AsyncClient, timeout_s: float = 60) -> dict:
    deadline = time.monotonic() + timeout_s
    while True:
        s = (await client.get("/stats")).json()["replies"]["scheduler"]["payload"]
        idle = s["num_running"] == 0 and s["num_waiting"] == 0
        if idle or time.monotonic() > deadline:
            break
        await asyncio.sleep(0.5)  # a poll bounded by the deadline: aborts are freed before the next plan
    leaked = s["kv_blocks_total"] - s["kv_blocks_free"] - s["kv_blocks_cached"]
    keys = ("kv_blocks_total", "kv_blocks_free", "kv_blocks_cached", "kv_blocks_used", "num_running", "num_waiting")
    return {**{k: s[k] for k in keys}, "leaked_blocks": leaked, "preemptions": s.get("preemptions")}


async def soak(url: str, args: argparse.Namespace) -> dict:
    rng = random.Random(args.seed)
    outcomes: Counter[str] = Counter()
    samples: list[dict] = []
    stop = asyncio.Event()
    started = time.monotonic()
    limits = httpx.Limits(max_connections=args.concurrency + 4)
    async with httpx.AsyncClient(base_url=url, timeout=args.request_timeout_s, limits=limits) as client:
        sampler = asyncio.create_task(sample_rss(client, args.sample_s, samples, stop))
        probe = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
        chat = (await client.post("/v1/chat/completions", json=probe)).status_code == 200  # a chat template?
        sent = 0

        def more() -> bool:
            if args.num_requests is not None:
                return sent < args.num_requests
            return time.monotonic() - started < args.duration_s

        async def worker() -> None:
            nonlocal sent
            while more():
                sent += 1
                path, body = make_request(rng, chat)
                cancel = body["stream"] and rng.random() < args.cancel_fraction
                outcomes[await one_request(client, path, body, rng.randint(1, 8) if cancel else None)] += 1

        await asyncio.gather(*(worker() for _ in range(args.concurrency)))
        accounting = await block_accounting(client)
        health = (await client.get("/health")).status_code
        stop.set()
        await sampler
    roles = [k for k in samples[0] if k != "t"] if samples else []
    return {
        "duration_s": round(time.monotonic() - started, 1),
        "requests": sum(outcomes.values()),
        "chat": chat,
        "lost": outcomes.get("lost", 0),
        "outcomes": dict(outcomes.most_common()),
        "blocks": accounting,
        "health_after": health,
        "rss_mib_first": {r: samples[0][r] for r in roles} if samples else {},
        "rss_mib_last": {r: samples[-1][r] for r in roles} if samples else {},
        "rss_trend_mib_per_min": {r: trend_mib_per_min(samples, r) for r in roles},
        "rss_samples": samples,
    }


def plot(samples: list[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 5))
    for role in [k for k in samples[0] if k != "t"]:
        ax.plot([s["t"] / 60 for s in samples], [s[role] for s in samples], label=role)
    ax.set_xlabel("minutes")
    ax.set_ylabel("RSS (MiB)")
    ax.set_title("soak: resident memory per process")
    ax.legend()
    fig.savefig(path, dpi=100, bbox_inches="tight")


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    if args.url:
        result = asyncio.run(soak(args.url, args))
    else:
        with LaunchedServer(args.launch) as server:
            result = asyncio.run(soak(server.url, args))
    printable = {k: v for k, v in result.items() if k != "rss_samples"}
    print(json.dumps(printable, indent=2))
    if args.output_json:
        Path(args.output_json).write_text(json.dumps(result, indent=1))
    if args.plot and result["rss_samples"]:
        plot(result["rss_samples"], args.plot)
    return result


if __name__ == "__main__":
    main()
