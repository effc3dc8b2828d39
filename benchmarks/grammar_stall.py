"""Structured output's grammars against everyone else: a running stream's token gaps while grammars compile, and
the scheduler's memory over many distinct grammars.

    python -m benchmarks.grammar_stall                           # launches DEFAULT_LAUNCH's server
    python -m benchmarks.grammar_stall --memory 150 --launch "--model ../shared/models/gpt2 --load-format dummy \
        --device cpu --tokenizer-workers 1 --grammar-compile-timeout 120"   # the big grammar compiled to the end
    python -m benchmarks.grammar_stall --root /path/to/checkout  # the server of another checkout (before/after)
    python -m benchmarks.grammar_stall --url http://127.0.0.1:8000

A stream (greedy completions of --stream-tokens tokens with ignore_eos, started again whenever one ends) runs
throughout, from the moment the server is ready. First, where the server says it is preparing the grammar
vocabulary (/stats: grammar_vocabulary_ready), until it is done:
  vocabulary   the compile worker's start beside the stream (a server that prepares the vocabulary before it is
               ready has no such phase)
Then, one at a time, each a completion of one token:
  control   no grammar, sampled at temperature 1: what any request beside the stream costs it
  first     the server's first structured request, a small regex (before the compile worker, it prepared the
            tokenizer's vocabulary on the scheduler's loop; now it comes once the vocabulary is ready)
  choices   a choice of --choices unique strings (the issue's case: 8,000 choices, about 230 KB)
  choices_again   the same again: with a cache of compiled grammars, what the way in of so large a request costs
  none      no request: the stream alone for as long as `choices` took to its verdict (the noise floor: the
            longest of that many gaps on this machine, at its load, without a grammar)
Each is streamed, so that its verdict (the response's headers: the scheduler queued it, its grammar
compiled) is timed apart from its end. Each reports the stream's longest time without a token until its
verdict (its way in and its compile: the target is at most 2x the stream's median gap outside every such
window) and until its end (its own step beside the stream's too: the control shows what that costs without a
grammar), and its status and times. --memory K then sends K distinct grammars of
--memory-choices choices, one after another, and reports the RSS of the scheduler and of its compile worker
(if any) before, after, and the growth per grammar over the second half.
"""

from __future__ import annotations

import argparse
import json
import statistics
import threading
import time
from pathlib import Path

import httpx

from benchmarks.serve import LaunchedServer
from benchmarks.soak import rss_mib

DEFAULT_LAUNCH = "--model ../shared/models/gpt2 --load-format dummy --device cpu --tokenizer-workers 1"
WAIT_S = 600.0


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--launch", default=DEFAULT_LAUNCH, help="launch.py arguments (ignored with --url)")
    p.add_argument("--root", default=None, help="the checkout whose launch.py runs (default: this one)")
    p.add_argument("--url", default=None, help="a running server instead of launching one")
    p.add_argument("--choices", type=int, default=8000, help="choices of the big grammar")
    p.add_argument("--stream-tokens", type=int, default=500, help="tokens per stream (restarted when done)")
    p.add_argument("--settle-tokens", type=int, default=30, help="stream tokens between the phases")
    p.add_argument("--memory", type=int, default=0, help="distinct grammars sent for the memory phase")
    p.add_argument("--memory-choices", type=int, default=3000)
    p.add_argument("--output-json", default=None)
    return p.parse_args(argv)


class Stream:
    """Streams run one after another in a thread; each one's chunk arrival times are kept."""

    def __init__(self, url: str, tokens: int):
        self.url, self.tokens = url, tokens
        self.streams: list[list[float]] = []
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        body = {"prompt": "Hello", "max_tokens": self.tokens, "stream": True, "ignore_eos": True, "temperature": 0}
        with httpx.Client(base_url=self.url, timeout=WAIT_S) as client:
            while not self.stop.is_set():
                times: list[float] = []
                self.streams.append(times)
                with client.stream("POST", "/v1/completions", json=body) as response:
                    for line in response.iter_lines():
                        if line.startswith("data:") and "[DONE]" not in line:
                            times.append(time.perf_counter())
                        if self.stop.is_set():
                            break

    def count(self) -> int:
        return sum(len(times) for times in self.streams)

    def wait_for(self, tokens: int) -> None:
        """Until `tokens` more chunks have arrived (a poll bounded by a deadline)."""
        target, deadline = self.count() + tokens, time.monotonic() + WAIT_S
        while self.count() < target:
            if time.monotonic() > deadline or not self.thread.is_alive():
                raise RuntimeError("the stream stopped")
            time.sleep(0.01)

    def gaps(self) -> list[tuple[float, float]]:
        """(start, end) of every gap between consecutive chunks of one stream."""
        return [(a, b) for times in self.streams for a, b in zip(times, times[1:])]


def timed_post(url: str, body: dict) -> dict:
    """The request streamed, so that its verdict (the response's headers: 200 once the scheduler has queued it, its
    grammar compiled; else the error) is timed apart from its end."""
    started = time.perf_counter()
    with httpx.stream("POST", f"{url}/v1/completions", json={**body, "stream": True}, timeout=WAIT_S) as response:
        verdict = time.perf_counter()
        text = response.read().decode()
    ended = time.perf_counter()
    error = json.loads(text).get("error", {}).get("message", "") if response.status_code != 200 else ""
    return {"started": started, "verdict": verdict, "ended": ended, "status": response.status_code,
            "error": error[:200]}  # fmt: skip


def choices_body(count: int, tag: str = "") -> dict:
    choices = [f"{tag}{time.time()} o{i}" for i in range(count)]  # the issue's; unique: never from a cache
    return {"prompt": "x", "max_tokens": 1, "structured_outputs": {"choice": choices}}


def vocabulary_ready(url: str) -> bool:
    """Every scheduler's grammar vocabulary is prepared (a server that does not say: it was before it was ready)."""
    replies = httpx.get(f"{url}/stats", timeout=60).json()["replies"]
    schedulers = [reply for role, reply in replies.items() if role.startswith("scheduler")]
    return all(reply["payload"].get("grammar_vocabulary_ready", 1) for reply in schedulers)


def stall_phases(url: str, args: argparse.Namespace) -> dict:
    stream = Stream(url, args.stream_tokens)
    started = time.perf_counter()
    stream.thread.start()
    phases = {}
    if not vocabulary_ready(url):
        deadline = time.monotonic() + WAIT_S
        while not vocabulary_ready(url):
            if time.monotonic() > deadline:
                raise RuntimeError("the grammar vocabulary was not ready in time")
            time.sleep(0.2)  # a poll bounded by the deadline
        ready = time.perf_counter()
        phases["vocabulary"] = {"started": started, "verdict": ready, "ended": ready, "status": None, "error": ""}
    stream.wait_for(args.settle_tokens)
    bodies = {
        # No grammar: the gap that any request arriving beside the stream costs it (its prefill joins a step)
        "control": {"prompt": "x", "max_tokens": 1, "temperature": 1.0},
        "first": {"prompt": "x", "max_tokens": 1, "structured_outputs": {"regex": "[a-c]{2,4}-[0-9]{3}"}},
        "choices": choices_body(args.choices),
    }
    bodies["choices_again"] = bodies["choices"]  # from the cache where there is one: the way in alone, no compile
    for name, body in bodies.items():
        phases[name] = timed_post(url, body)
        stream.wait_for(args.settle_tokens)
    # The noise floor: the stream alone for as long as the big grammar took to its verdict. Its longest gap, over
    # as many gaps as that window held, is what the machine's own noise gives (its load, its other processes).
    quiet_s = phases["choices"]["verdict"] - phases["choices"]["started"]
    started = time.perf_counter()
    time.sleep(quiet_s)
    phases["none"] = {"started": started, "verdict": started + quiet_s, "ended": started + quiet_s, "status": None,
                      "error": ""}  # fmt: skip
    stream.stop.set()
    stream.thread.join(timeout=WAIT_S)
    gaps = stream.gaps()
    windows = [(p["started"], p["ended"]) for p in phases.values()]
    outside = [b - a for a, b in gaps if not any(a < end and b > start for start, end in windows)]
    median = statistics.median(outside)
    result = {"median_gap_ms": 1e3 * median, "largest_gap_outside_ms": 1e3 * max(outside), "gaps_outside": len(outside)}
    origin = stream.streams[0][0]
    result["stream_times_s"] = [[round(t - origin, 4) for t in times] for times in stream.streams]
    for phase in phases.values():
        started, verdict, ended = phase.pop("started"), phase.pop("verdict"), phase.pop("ended")
        phase["window_s"] = [round(t - origin, 4) for t in (started, verdict, ended)]
        phase["verdict_s"], phase["seconds"] = verdict - started, ended - started
        # Until the verdict: the request's way in and its compile. To its end: its step(s) beside the stream too.
        # A gap counts for the part of it inside the window: the stream's time without a token while it lasted.
        for part, end in (("to_verdict", verdict), ("to_end", ended)):
            longest = max((min(b, end) - max(a, started) for a, b in gaps if a < end and b > started), default=0.0)
            phase[f"largest_gap_{part}_ms"] = 1e3 * longest
            phase[f"largest_gap_{part}_over_median"] = longest / median
        tokens = sum(started < b < verdict for _, b in gaps)
        phase["stream_tokens_to_verdict"] = tokens
    return {**result, "phases": phases}


def process_pids(url: str) -> dict[str, int]:
    """The scheduler's pid and its children's (the compile worker), from /stats and /proc."""
    replies = httpx.get(f"{url}/stats", timeout=60).json()["replies"]
    scheduler = next(reply["pid"] for role, reply in replies.items() if role.startswith("scheduler"))
    pids = {"scheduler": scheduler}
    children: list[int] = []
    for task in Path(f"/proc/{scheduler}/task").iterdir():
        children += [int(pid) for pid in (task / "children").read_text().split()]
    for i, pid in enumerate(children):
        pids[f"scheduler_child_{i}"] = pid
    return pids


def memory_phase(url: str, args: argparse.Namespace) -> dict:
    pids = process_pids(url)
    samples = [{role: rss_mib(pid) for role, pid in pids.items()}]
    statuses: dict[int, int] = {}
    for k in range(args.memory):
        status = timed_post(url, choices_body(args.memory_choices, f"{k} "))["status"]
        statuses[status] = statuses.get(status, 0) + 1
        samples.append({role: rss_mib(pid) for role, pid in process_pids(url).items() if role in pids})
    result: dict = {"grammars": args.memory, "choices": args.memory_choices, "statuses": statuses}
    result["rss_mib_every_10"] = {role: [s.get(role) for s in samples[::10]] for role in pids}
    half = samples[len(samples) // 2 :]
    for role in pids:
        values = [s.get(role) for s in samples]
        if None in values:
            continue
        result[role] = {
            "rss_start_mib": values[0],
            "rss_end_mib": values[-1],
            "rss_peak_mib": max(values),
            "second_half_mib_per_grammar": (half[-1][role] - half[0][role]) / max(1, len(half) - 1),
        }
    return result


def run(url: str, args: argparse.Namespace) -> dict:
    result = {"choices": args.choices, "stall": stall_phases(url, args)}
    if args.memory:
        result["memory"] = memory_phase(url, args)
    return result


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    if args.url:
        result = run(args.url, args)
    else:
        launch = {"root": Path(args.root).resolve()} if args.root else {}
        with LaunchedServer(args.launch, **launch) as server:
            result = run(server.url, args)
    printable = {**result, "stall": {k: v for k, v in result["stall"].items() if k != "stream_times_s"}}
    print(json.dumps(printable, indent=2))
    if args.output_json:
        Path(args.output_json).write_text(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    main()
