"""Streaming latency benchmark: many concurrent requests to a running server's native POST /generate.

    python -m benchmarks.serve --num-requests 32 --prompt Hello --prompt-repeats 1,1,1,64
    python -m benchmarks.serve --launch "--model ../shared/models/gpt2 --load-format dummy" \\
        --input-len-range 64-512 --output-len-range 16-128 --request-rate 4 --output-json run.json --plot-dir plots
    python -m benchmarks.serve --compare before.json after.json

Workload (one of): --prompt TEXT × --prompt-repeats (cycled per request, --unique-prompts to defeat the
prefix cache); random token ids (--input-len-range, seeded); a JSON --prompts-file. New tokens:
--max-new-tokens, or seeded random --output-len-range. Arrivals: all at once, every --submit-interval-ms,
or Poisson at --request-rate; --max-concurrency caps requests in flight. Greedy unless --temperature.

Prints p50/p95/p99 of submit latency, tokenize, queue wait, prefill→first token, TTFT, TPOT, ITL and
end-to-end latency (definitions in benchmarks/latency.py), throughput, and the scheduler's own counters
over the run (from GET /stats). --launch "ARGS" starts `python launch.py ARGS --port FREE`, waits until
/health answers, and stops it with SIGTERM afterwards; otherwise --url.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import shlex
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import httpx

from benchmarks.latency import (
    LATENCY_METRICS,
    RequestTimings,
    Summary,
    inter_token_latencies,
    request_latencies,
    summarize,
)
from benchmarks.load_client import (
    CLIENT_SATURATED_PCT,
    REQUEST_TIMEOUT_S,
    ClientUsage,
    default_client_processes,
    make_session,
    run_clients,
    send_request,
)
from benchmarks.process_cpu import process_cpu_s
from benchmarks.workloads import (
    WorkloadRequest,
    load_prompts_file,
    parse_range,
    parse_repeats,
    random_lengths,
    random_token_prompts,
    repeated_text_prompts,
    send_offsets,
    unique_prompt,
)
from common.engine_replica import is_scheduler_role

ROOT = Path(__file__).resolve().parent.parent
SERVER_START_TIMEOUT_S = 300.0
SERVER_STOP_TIMEOUT_S = 90.0  # more than the launcher waits for its processes to write their profile traces
WARMUP_PROMPT = "warm-up"  # shares no KV block with any benchmark prompt
# Cumulative scheduler counters of GET /stats; the benchmark reports their change over the run.
SCHEDULER_COUNTERS = (
    "steps",
    "prompt_tokens_computed",
    "decode_tokens_computed",
    "generated_tokens",
    "prompt_tokens_admitted",
    "cache_hit_tokens",
    "preemptions",
)


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    server = parser.add_argument_group("server")
    server.add_argument("--url", default="http://127.0.0.1:8000", help="a running server (ignored with --launch)")
    server.add_argument(
        "--launch", metavar="ARGS", help="start `python launch.py ARGS --port FREE` for this run and stop it afterwards"
    )
    server.add_argument(
        "--launch-root", help="--launch: the checkout whose launch.py to start (default: this one), e.g. a 'before'"
    )
    server.add_argument(
        "--mock-server",
        type=int,
        metavar="PROCESSES",
        help="instead of a real server, benchmarks.mock_server with this many processes: the client's ceiling",
    )
    server.add_argument("--server-log", help="--launch: the server's output goes here (default: a temp file)")
    server.add_argument("--api-key", help="sent as 'Authorization: Bearer KEY'")

    work = parser.add_argument_group("workload")
    work.add_argument("--num-requests", type=int, default=32)
    work.add_argument("--prompt", default="Hello", help="prompt text, repeated --prompt-repeats times")
    work.add_argument(
        "--prompt-repeats",
        default="1",
        help="repeat counts cycled over requests: '1,1,1,64'; ranges count up: '900-915'",
    )
    work.add_argument(
        "--unique-prompts",
        action="store_true",
        help="prefix each prompt with its request index, so the prefix cache cannot share them",
    )
    work.add_argument("--prompts-file", help='JSON list of prompts: strings or {"prompt", "max_tokens"}')
    work.add_argument("--input-len-range", help="random token-id prompts, lengths LOW-HIGH (seeded)")
    work.add_argument(
        "--model",
        help="random prompts: the model folder whose vocabulary to draw from "
        "(default: --launch's --model, else the default model)",
    )
    work.add_argument("--max-new-tokens", type=int, default=64)
    work.add_argument("--output-len-range", help="random new-token counts LOW-HIGH per request (seeded)")
    work.add_argument(
        "--no-stop-on-eos", dest="ignore_eos", action="store_true", help="generate all the new tokens even past EOS"
    )
    work.add_argument("--temperature", type=float, default=0.0, help="0: greedy")
    work.add_argument("--seed", type=int, default=0, help="seeds random lengths, random ids and Poisson arrivals")
    arrivals = work.add_mutually_exclusive_group()
    arrivals.add_argument("--submit-interval-ms", type=float, help="a fixed gap between submissions")
    arrivals.add_argument("--request-rate", type=float, help="Poisson arrivals, requests per second")
    work.add_argument("--max-concurrency", type=int, help="requests in flight at most (default: no cap)")
    work.add_argument(
        "--client-processes",
        type=int,
        default=default_client_processes(),
        help="load-generator processes sharing the requests (default: a quarter of the cores, 1 to 8)",
    )
    work.add_argument(
        "--warmup-requests", type=int, default=1, help="short requests sent before the run and left out of every figure"
    )
    work.add_argument(
        "--bursts",
        type=int,
        default=1,
        help="run the workload this many times on one server, each with prompts of its own (seed + the round); "
        "the first is reported apart from the repeated ones: what a server's first load pays",
    )

    out = parser.add_argument_group("output")
    out.add_argument("--output-json", help="per-request timings, summary, server counters and the command")
    out.add_argument("--plot-dir", help="write latency_cdf.png and tokens_over_time.png here")
    out.add_argument("--label", help="a name for this run in plots and JSON")
    out.add_argument(
        "--compare",
        nargs=2,
        metavar=("A.json", "B.json"),
        help="print two runs' --output-json side by side with ratios B/A, and exit",
    )
    args = parser.parse_args(argv)
    if args.num_requests < 1:
        parser.error("--num-requests must be at least 1")
    if args.bursts < 1:
        parser.error("--bursts must be at least 1")
    if args.max_concurrency is not None and args.max_concurrency < 1:
        parser.error("--max-concurrency must be at least 1")
    if args.prompts_file and args.input_len_range:
        parser.error("give --prompts-file or --input-len-range, not both")
    return args


# ---------------------------------------------------------------------------------------------- workload


def build_workload(args: argparse.Namespace, round_index: int = 0) -> list[WorkloadRequest]:
    """The run's requests; round_index > 0 (--bursts): the same shape with other prompts, sharing no KV block
    with another round's (other random ids; text prompts marked with the round)."""
    if round_index:
        args = argparse.Namespace(**{**vars(args), "seed": args.seed + 7919 * round_index})
        return [
            replace(r, prompt=f"round {round_index}: {r.prompt}") if r.prompt is not None else r
            for r in build_workload(args)
        ]
    n = args.num_requests
    if args.output_len_range:
        # seed + 1: output lengths drawn independently of the input lengths below
        max_tokens: list[int | None] = list(random_lengths(n, parse_range(args.output_len_range), args.seed + 1))
    else:
        max_tokens = [args.max_new_tokens] * n
    if args.input_len_range:
        vocab_size, eos = _vocabulary(args)
        ids = random_token_prompts(n, parse_range(args.input_len_range), vocab_size, args.seed, frozenset(eos))
        return [WorkloadRequest(max_tokens[i], input_ids=ids[i]) for i in range(n)]
    if args.prompts_file:
        items = load_prompts_file(args.prompts_file)
        timed = items[0][2] is not None
        if timed and (n != len(items) or args.submit_interval_ms is not None or args.request_rate is not None):
            raise ValueError("a prompts file with 'at_ms' sets the arrivals: send each of its prompts once")
        requests = []
        for i in range(n):
            text, own_max, at_ms = items[i % len(items)]
            text = unique_prompt(i, text) if args.unique_prompts else text
            request = WorkloadRequest(own_max if own_max is not None else max_tokens[i], prompt=text)
            request.send_at_s = at_ms / 1000 if at_ms is not None else None
            requests.append(request)
        return requests
    prompts = repeated_text_prompts(args.prompt, parse_repeats(args.prompt_repeats), n, args.unique_prompts)
    return [WorkloadRequest(max_tokens[i], prompt=prompts[i]) for i in range(n)]


def _vocabulary(args: argparse.Namespace) -> tuple[int, list[int]]:
    """Vocabulary size and EOS ids of the served model, for random token-id prompts."""
    from common.model_info import ModelInfo
    from common.model_source import resolve_model

    model = args.model
    if model is None and args.launch:
        words = shlex.split(args.launch)
        if "--model" in words[:-1]:
            model = words[words.index("--model") + 1]
    info = ModelInfo.from_folder(resolve_model(model))
    return info.vocab_size, info.eos_token_ids


# ---------------------------------------------------------------------------------------------- server


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class LaunchedServer:
    """`python launch.py ARGS --port FREE` (or another server command) for the length of a `with` block."""

    def __init__(
        self, launch_args: str, log_path: str | None = None, program: list[str] | None = None, root: Path = ROOT
    ):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.root = root
        program = program or [str(root / "launch.py")]
        self.command = [sys.executable, *program, *shlex.split(launch_args), "--port", str(self.port)]
        self.log_path = Path(log_path or tempfile.mkstemp(prefix="clearserve-bench-", suffix=".log")[1])
        self.proc: subprocess.Popen | None = None

    def __enter__(self) -> LaunchedServer:
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(self.command, cwd=self.root, stdout=log, stderr=subprocess.STDOUT)
        try:
            self._wait_ready()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + SERVER_START_TIMEOUT_S
        with httpx.Client(base_url=self.url, timeout=5) as client:
            while time.monotonic() < deadline:
                if self.proc.poll() is not None:
                    raise RuntimeError(
                        f"the server exited with code {self.proc.returncode} while starting; "
                        f"its log ({self.log_path}):\n{self._log_tail()}"
                    )
                try:
                    if client.get("/health").status_code == 200:
                        return
                except httpx.TransportError:
                    pass  # not listening yet
                time.sleep(0.2)  # a poll bounded by the deadline
        raise TimeoutError(
            f"the server did not answer /health within {SERVER_START_TIMEOUT_S:.0f} s; "
            f"its log ({self.log_path}):\n{self._log_tail()}"
        )

    def _log_tail(self, lines: int = 40) -> str:
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])

    def stop(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout=SERVER_STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


async def server_stats(client: httpx.AsyncClient) -> dict[str, dict] | None:
    """Every process's cumulative stats (GET /stats) by role, or None if the server does not give them. A process
    of this machine's gets `cpu_s` beside them: its CPU seconds so far, from /proc (benchmarks/process_cpu.py)."""
    try:
        response = await client.get("/stats")
        if response.status_code != 200:
            return None
        body = response.json()
        stats = {role: reply["payload"] for role, reply in body["replies"].items()}
        if "frontend" in body:  # the answering process's own, beside its children's replies
            stats["frontend"] = body["frontend"]["payload"]
        for role, reply in body["replies"].items():
            cpu = process_cpu_s(reply["pid"], role)
            if cpu is not None:
                stats[role]["cpu_s"] = cpu
        return stats
    except (httpx.HTTPError, KeyError, ValueError):
        return None


async def served_model(client: httpx.AsyncClient) -> str | None:
    try:
        response = await client.get("/v1/models")
        return response.json()["data"][0]["id"] if response.status_code == 200 else None
    except (httpx.HTTPError, KeyError, IndexError, ValueError):
        return None


def server_view(before: dict[str, dict] | None, after: dict[str, dict] | None) -> dict | None:
    """What the schedulers did during the run (every engine replica's, summed): counter deltas and per-step
    means (steps: of all replicas)."""
    if not before or not after:
        return None
    schedulers = [role for role in after if is_scheduler_role(role) and role in before]
    if not schedulers:
        return None
    delta = {
        key: sum(after[role].get(key, 0) - before[role].get(key, 0) for role in schedulers)
        for key in SCHEDULER_COUNTERS
    }
    steps = delta["steps"]
    admitted = delta["prompt_tokens_admitted"]
    return {
        **delta,
        "mean_prefill_tokens_per_step": delta["prompt_tokens_computed"] / steps if steps else 0.0,
        "mean_decode_tokens_per_step": delta["decode_tokens_computed"] / steps if steps else 0.0,
        "cache_hit_rate": delta["cache_hit_tokens"] / admitted if admitted else 0.0,
        "step_chain_ms": step_chain_view(before, after, schedulers),
    }


def step_chain_view(before: dict[str, dict], after: dict[str, dict], schedulers: list[str]) -> dict[str, float]:
    """Mean ms of each link from a step's tokens to the next plan's launch during the run (scheduler/step_chain.py);
    empty when the server does not report them."""

    def delta(key: str) -> float:
        return sum(after[role].get(key, 0) - before[role].get(key, 0) for role in schedulers)

    results, plans = delta("chain_results"), delta("chain_plans")
    if not results or not plans:
        return {}
    return {
        "result_transit": 1e3 * delta("chain_result_transit_s") / results,
        "scheduler": 1e3 * delta("chain_scheduler_s") / plans,
        "plan_transit": 1e3 * delta("chain_plan_transit_s") / results,
        "worker_launch": 1e3 * delta("chain_worker_launch_s") / results,
    }


def process_view(
    before: dict[str, dict] | None, after: dict[str, dict] | None, completion_tokens: int
) -> dict[str, dict] | None:
    """Where the server's time went during the run, per process: busy share of the run's wall time, CPU seconds
    and CPU µs per completion token (a process of this machine's), messages and msgpack seconds (deltas of
    GET /stats; see common/profiling.py ProcessStats)."""
    if not before or not after:
        return None
    view = {}
    for role in sorted(set(before) & set(after)):
        b, a = before[role], after[role]
        wall = a["uptime_s"] - b["uptime_s"]
        busy = a["busy_s"] - b["busy_s"]
        cpu = a["cpu_s"] - b["cpu_s"] if "cpu_s" in a and "cpu_s" in b else None
        view[role] = {
            "busy_pct": 100 * busy / wall if wall > 0 else 0.0,
            "busy_s": busy,
            "cpu_s": cpu,
            "cpu_us_per_token": 1e6 * cpu / completion_tokens if cpu is not None and completion_tokens else None,
            "messages_in": a["messages_in"] - b["messages_in"],
            "messages_out": a["messages_out"] - b["messages_out"],
            "msgpack_s": sum(a[k] - b[k] for k in ("msgpack_encode_s", "msgpack_decode_s")),
            # The collector's pauses in the run (common/garbage.py); the longest is since start-up.
            "gc_collections": a.get("gc_collections", 0) - b.get("gc_collections", 0),
            "gc_pause_s": a.get("gc_pause_s", 0.0) - b.get("gc_pause_s", 0.0),
            "gc_max_pause_ms": a.get("gc_max_pause_ms", 0.0),
        }
    return view


# ---------------------------------------------------------------------------------------------- client


@dataclass(slots=True)
class Measurement:
    model: str | None
    stats_before: dict | None
    stats_after: dict | None
    requests: list[RequestTimings]
    client: ClientUsage
    load_average: tuple[float, float]  # this machine's 1-minute load average as the run began, and as it ended


def measure(
    url: str,
    workload: list[WorkloadRequest],
    offsets: list[float],
    sampling: dict,
    max_concurrency: int | None,
    headers: dict,
    warmup: int,
    client_processes: int,
) -> Measurement:
    """Warm up, snapshot the server's counters, send the workload on its schedule from the client
    processes, snapshot again."""

    async def snapshot(warm: bool) -> tuple[str | None, dict | None]:
        async with httpx.AsyncClient(base_url=url, headers=headers, timeout=httpx.Timeout(REQUEST_TIMEOUT_S)) as c:
            model = await served_model(c)
            if warm:
                async with make_session(url, headers) as session:
                    for _ in range(warmup):
                        result = await send_request(session, WorkloadRequest(2, prompt=WARMUP_PROMPT), sampling)
                        if result.error:
                            raise RuntimeError(f"the warm-up request failed: {result.error}")
            return model, await server_stats(c)

    model, before = asyncio.run(snapshot(warm=True))
    load_before = os.getloadavg()[0]
    requests, usage = run_clients(url, workload, offsets, sampling, headers, client_processes, max_concurrency)
    load_after = os.getloadavg()[0]
    _, after = asyncio.run(snapshot(warm=False))
    return Measurement(model, before, after, requests, usage, (load_before, load_after))


# ---------------------------------------------------------------------------------------------- report


def summary_dict(summary: Summary) -> dict:
    return {
        "completed": summary.completed,
        "failed": summary.failed,
        "duration_s": summary.duration_s,
        "prompt_tokens": summary.prompt_tokens,
        "completion_tokens": summary.completion_tokens,
        "request_throughput": summary.request_throughput,
        "completion_throughput": summary.completion_throughput,
        "total_throughput": summary.total_throughput,
        "latencies_ms": {key: asdict(p) for key, p in summary.latencies_ms.items()},
    }


def request_dict(index: int, request: WorkloadRequest, t: RequestTimings) -> dict:
    raw = asdict(t)
    raw.update(index=index, max_tokens=request.max_tokens)
    if t.ok:
        raw["latencies_s"] = request_latencies(t)
        raw["itl_s"] = inter_token_latencies(t)
    return raw


def _fmt(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f}"


def print_repeats(result: dict) -> None:
    """The first burst against the repeated ones (--bursts): a warm server's first load costs what its later ones do."""
    if not result.get("repeats"):
        return
    first = result["summary"]

    def line(name: str, s: dict) -> str:
        ms = s["latencies_ms"]
        return (
            f"{name:<12}{s['completion_throughput']:>14,.0f}{_fmt(ms['ttft']['p50']):>12}{_fmt(ms['ttft']['p99']):>12}"
            f"{_fmt(ms['itl']['p99']):>12}{s['duration_s']:>10.2f}"
        )

    print(f"\n{'burst':<12}{'tok/s':>14}{'TTFT p50':>12}{'TTFT p99':>12}{'ITL p99':>12}{'seconds':>10}")
    print(line("first", first))
    for repeat in result["repeats"]:
        print(line(f"repeat {repeat['round']}", repeat["summary"]))
    later = sorted(r["summary"]["duration_s"] for r in result["repeats"])
    median = later[len(later) // 2]
    print(f"first burst's duration / the repeated ones' median: {first['duration_s'] / median:.3f}")
    # Which process paid for the first burst: its busy seconds against the same process's in the repeats.
    busy = {role: [p["busy_s"]] for role, p in (result.get("processes") or {}).items()}
    for repeat in result["repeats"]:
        for role, p in (repeat.get("processes") or {}).items():
            busy.setdefault(role, []).append(p["busy_s"])
    if busy:
        per_role = (f"{role} " + " / ".join(f"{b:.2f}" for b in seconds) for role, seconds in busy.items())
        print("busy seconds per burst: " + "; ".join(per_role))


def print_cpu_per_token(processes: dict[str, dict], load_average: tuple[float, float] | None) -> None:
    """Each server process's CPU per completion token, and the server's tokens/s were that process the limit
    with a core to itself (every token of the run over its CPU seconds: a frontend's share of the tokens is in
    its seconds already). About the same whatever the machine's load, unlike the busy share."""
    measured = {role: p for role, p in processes.items() if p.get("cpu_us_per_token")}
    if not measured:
        return
    print(f"\n{'process':<16}{'CPU s':>10}{'CPU µs/token':>14}{'tok/s at one core':>20}")
    for role, p in sorted(measured.items(), key=lambda item: -item[1]["cpu_us_per_token"]):
        print(f"{role:<16}{p['cpu_s']:>10.2f}{p['cpu_us_per_token']:>14.2f}{1e6 / p['cpu_us_per_token']:>20,.0f}")
    total = sum(p["cpu_us_per_token"] for p in measured.values())
    print(f"{'all':<16}{sum(p['cpu_s'] for p in measured.values()):>10.2f}{total:>14.2f}")
    if load_average:
        print(f"load average (1 min) as the run began / ended: {load_average[0]:.2f} / {load_average[1]:.2f}")


def print_report(result: dict) -> None:
    s = result["summary"]
    print(
        f"\n{result['label'] or 'run'}: {s['completed']} requests completed, {s['failed']} failed, "
        f"{s['duration_s']:.2f} s; model {result['model']!r} at {result['url']}"
    )
    print(f"{'latency (ms)':<34}{'p50':>10}{'p95':>10}{'p99':>10}{'mean':>10}{'samples':>9}")
    for key, label in LATENCY_METRICS:
        p = s["latencies_ms"][key]
        print(
            f"{label:<34}{_fmt(p['p50']):>10}{_fmt(p['p95']):>10}{_fmt(p['p99']):>10}{_fmt(p['mean']):>10}"
            f"{p['count']:>9}"
        )
    print(
        f"throughput: {s['completion_throughput']:.1f} completion tokens/s, {s['total_throughput']:.1f} total "
        f"tokens/s, {s['request_throughput']:.2f} requests/s ({s['prompt_tokens']} prompt + "
        f"{s['completion_tokens']} completion tokens)"
    )
    v = result["server"]
    if v is None:
        print("server: GET /stats gave no scheduler counters")
    else:
        print(
            f"server: {v['steps']} steps, mean {v['mean_prefill_tokens_per_step']:.1f} prefill + "
            f"{v['mean_decode_tokens_per_step']:.1f} decode tokens per step; prefix cache hit "
            f"{v['cache_hit_tokens']} of {v['prompt_tokens_admitted']} prompt tokens "
            f"({100 * v['cache_hit_rate']:.1f}%); {v['preemptions']} preemptions"
        )
        if v.get("step_chain_ms"):
            print(
                "step chain, mean ms (tokens of step N to the launch of the plan that answers them): "
                + ", ".join(f"{link} {ms:.2f}" for link, ms in v["step_chain_ms"].items())
            )
    processes = result.get("processes")
    if processes:
        print(
            "server processes, busy % of the run: "
            + ", ".join(f"{role} {p['busy_pct']:.0f}%" for role, p in processes.items())
        )
        print_cpu_per_token(processes, result.get("load_average"))
    c = result["client"]
    print(
        f"client: {c['processes']} process(es) on {c['event_loop']}, "
        f"CPU {', '.join(f'{pct:.0f}%' for pct in c['cpu_pct'])} of the run"
        f" (busiest half second {max(c['peak_cpu_pct'], default=0):.0f}%)"
    )
    if max(c["peak_cpu_pct"], default=0) >= CLIENT_SATURATED_PCT:
        print(
            f"warning: a client process reached {CLIENT_SATURATED_PCT:.0f}% CPU: the load generator may be the limit "
            "of this run (raise --client-processes)"
        )
    errors = [r["error"] for r in result["requests"] if r["error"]]
    if errors:
        print(f"first error of {len(errors)}: {errors[0]}")


def compare(path_a: str, path_b: str) -> None:
    a, b = (json.loads(Path(p).read_text()) for p in (path_a, path_b))
    print(f"A: {path_a}  ({a['command']})\nB: {path_b}  ({b['command']})")
    print(f"{'metric':<40}{'A':>12}{'B':>12}{'B/A':>8}")
    rows: list[tuple[str, float | None, float | None]] = []
    for key, label in LATENCY_METRICS:
        for stat in ("p50", "p95", "p99"):
            rows.append(
                (
                    f"{label} {stat} (ms)",
                    a["summary"]["latencies_ms"][key][stat],
                    b["summary"]["latencies_ms"][key][stat],
                )
            )
    for key, label in [
        ("completion_throughput", "completion tokens/s"),
        ("total_throughput", "total tokens/s"),
        ("request_throughput", "requests/s"),
        ("duration_s", "duration (s)"),
    ]:
        rows.append((label, a["summary"][key], b["summary"][key]))
    if a.get("server") and b.get("server"):
        for key in (
            "cache_hit_tokens",
            "preemptions",
            "steps",
            "mean_prefill_tokens_per_step",
            "mean_decode_tokens_per_step",
        ):
            rows.append((f"server {key}", a["server"][key], b["server"][key]))
    for label, x, y in rows:
        ratio = f"{y / x:.2f}" if x and y is not None else "-"
        print(f"{label:<40}{_fmt(x):>12}{_fmt(y):>12}{ratio:>8}")


# ---------------------------------------------------------------------------------------------- main


def run(args: argparse.Namespace, command: str) -> dict:
    """Run the benchmark against args.url (or a server launched for it); the result as --output-json has it."""
    workload = build_workload(args)
    interval = args.submit_interval_ms / 1000 if args.submit_interval_ms is not None else None
    if workload[0].send_at_s is not None:  # a prompts file's own arrival times
        offsets = [request.send_at_s or 0.0 for request in workload]
    else:
        offsets = send_offsets(len(workload), interval, args.request_rate, args.seed)
    sampling = {"temperature": args.temperature, "ignore_eos": args.ignore_eos}
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    if args.mock_server:
        mock = ["-m", "benchmarks.mock_server"]
        server = LaunchedServer(f"--processes {args.mock_server}", args.server_log, mock)
    else:
        root = Path(args.launch_root).resolve() if args.launch_root else ROOT
        server = LaunchedServer(args.launch, args.server_log, root=root) if args.launch else None
    repeats: list[dict] = []
    with server if server is not None else contextlib.nullcontext():
        url = server.url if server is not None else args.url
        m = measure(
            url,
            workload,
            offsets,
            sampling,
            args.max_concurrency,
            headers,
            args.warmup_requests,
            args.client_processes,
        )
        for round_index in range(1, args.bursts):
            again = build_workload(args, round_index)
            r = measure(url, again, offsets, sampling, args.max_concurrency, headers, 0, args.client_processes)
            repeat_summary = summarize(r.requests)
            repeats.append(
                {
                    "round": round_index,
                    "summary": summary_dict(repeat_summary),
                    "server": server_view(r.stats_before, r.stats_after),
                    "processes": process_view(r.stats_before, r.stats_after, repeat_summary.completion_tokens),
                    "client": r.client.to_dict(),
                }
            )
    summary = summarize(m.requests)
    result = {
        "command": command,
        "label": args.label,
        "url": url,
        "model": m.model,
        "args": vars(args),
        "started_at": min(r.submit for r in m.requests),
        "summary": summary_dict(summary),
        "server": server_view(m.stats_before, m.stats_after),
        "processes": process_view(m.stats_before, m.stats_after, summary.completion_tokens),
        "load_average": m.load_average,
        "client": m.client.to_dict(),
        "server_log": str(server.log_path) if server is not None else None,
        "requests": [request_dict(i, w, t) for i, (w, t) in enumerate(zip(workload, m.requests))],
        "repeats": repeats,  # --bursts: the later runs of the workload, after the first (above)
    }
    if args.plot_dir:
        from benchmarks.plots import write_plots

        write_plots(m.requests, Path(args.plot_dir), f"{args.label or ''} {command}".strip())
    if args.output_json:
        Path(args.output_json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.output_json).write_text(json.dumps(result, indent=1))
    return result


def main(argv: list[str] | None = None) -> dict | None:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    if args.compare:
        compare(*args.compare)
        return None
    result = run(args, shlex.join(["python", "-m", "benchmarks.serve", *argv]))
    print_report(result)
    print_repeats(result)
    return result


if __name__ == "__main__":
    main()
