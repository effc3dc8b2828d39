"""How long large request bodies hold up everyone else on a frontend: /health's latency while big bodies are
posted at once, the frontend's peak RSS meanwhile, and a small request's latency at rest.

    python -m benchmarks.body_stall                       # 8 × the 500,000-part chat body, a null-engine server
    python -m benchmarks.body_stall --shape token_ids --bodies 4
    python -m benchmarks.body_stall --url http://127.0.0.1:8000 --shape all

Shapes (the first four just under 16 MiB, the default --max-request-body-bytes):
    chat_parts   {"messages": [{"role": "user", "content": [{"type": "text", "text": "a"}] * 500,000}]}
    messages     {"messages": [{"role": "user", "content": "a"}] * 400,000}
    token_ids    {"prompt": [1] * 5,000,000}
    prompts_at_bound, messages_at_bound: 32,760 prompts of "a", 10,920 messages: the costliest bodies (per JSON
                 value) within --max-request-json-values' default, which reach the parser (a few hundred KiB)
    schema       {"prompt": "a", "response_format": {"type": "json_schema",
                                                     "json_schema": {"schema": {"x": [{}] * 3,000,000}}}}

/health is polled on its own connection every --poll-ms from just before the bodies are sent until every one
is answered; the reported stall is the slowest /health in that window. RSS is the frontend process's VmRSS
(its pid from /stats), sampled as often; over the window, its minor page faults and its event loop's CPU time
(its main thread's), which a shared machine's load does not inflate as it does the stall.

Each shape's body is also read in this process as the frontend's parsing thread reads it (body_parse.validated,
at the default --max-request-json-values): `parse_ms`, and `longest_gil_hold_ms`, its longest stretch without
running Python bytecode (the only points where the interpreter hands the GIL to another thread, the event
loop), each the best of a few.
"""

from __future__ import annotations

import argparse
import http.client
import json
import statistics
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx

from benchmarks.serve import LaunchedServer
from common.garbage import freeze_startup_objects
from frontend.body_parse import validated
from frontend.errors import ApiError
from frontend.limits import HttpLimits
from frontend.protocol import ChatCompletionRequest, CompletionRequest

DEFAULT_LAUNCH = "--model ../shared/models/gpt2 --load-format null --device cpu --tokenizer-workers 1"

SHAPES = {
    "chat_parts": (
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": [{"type": "text", "text": "a"}] * 500_000}]},
    ),
    "messages": ("/v1/chat/completions", {"messages": [{"role": "user", "content": "a"}] * 400_000}),
    "token_ids": ("/v1/completions", {"prompt": [1] * 5_000_000}),
    # The costliest bodies per value that --max-request-json-values' default (32,768) lets through to the parser.
    "prompts_at_bound": ("/v1/completions", {"prompt": ["a"] * 32_760, "max_tokens": 1}),
    "messages_at_bound": ("/v1/chat/completions", {"messages": [{"role": "user", "content": "a"}] * 10_920}),
    "schema": (
        "/v1/completions",
        {"prompt": "a", "response_format": {"type": "json_schema", "json_schema": {"schema": {"x": [{}] * 3_000_000}}}},
    ),
}
SMALL_BODY = {"prompt": "hi", "max_tokens": 1}
MODELS = {"/v1/chat/completions": ChatCompletionRequest, "/v1/completions": CompletionRequest}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--launch", default=DEFAULT_LAUNCH, help="launch.py arguments (ignored with --url)")
    p.add_argument("--url", default=None, help="a running server instead of launching one")
    p.add_argument("--shape", default="chat_parts", choices=[*SHAPES, "all"])
    p.add_argument("--bodies", type=int, default=8, help="big bodies posted at once")
    p.add_argument("--poll-ms", type=float, default=20.0)
    p.add_argument("--small-requests", type=int, default=300, help="sequential small completions timed at rest")
    p.add_argument("--output-json", default=None)
    return p.parse_args(argv)


def frontend_pid(client: httpx.Client) -> int | None:
    replies = client.get("/stats").json()["replies"]
    pids = [reply["pid"] for role, reply in replies.items() if role.startswith("frontend")]
    return pids[0] if len(pids) == 1 else None  # with several frontends, which one a body reaches is the kernel's


def rss_mib(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return 0.0


def minor_faults(pid: int) -> int:
    """The process's minor page faults so far, every thread's (/proc/PID/stat's tenth field)."""
    with open(f"/proc/{pid}/stat") as f:
        return int(f.read().rsplit(")", 1)[1].split()[7])


def loop_cpu_s(pid: int) -> float:
    """CPU time so far of the process's main thread, the frontend's event loop (its schedstat's first field)."""
    with open(f"/proc/{pid}/task/{pid}/schedstat") as f:
        return int(f.read().split()[0]) / 1e9


def small_request_latency_ms(client: httpx.Client, count: int) -> dict:
    for _ in range(20):  # warm the connection and the server's paths
        client.post("/v1/completions", json=SMALL_BODY)
    times = []
    for _ in range(count):
        started = time.perf_counter()
        response = client.post("/v1/completions", json=SMALL_BODY)
        times.append((time.perf_counter() - started) * 1000)
        assert response.status_code == 200, response.text
    times.sort()
    return {"p50": statistics.median(times), "p90": times[int(0.9 * len(times))], "count": count}


def stall(url: str, shape: str, bodies: int, poll_s: float) -> dict:
    path, body = SHAPES[shape]
    payload = json.dumps(body).encode()
    with httpx.Client(base_url=url, timeout=120) as client:
        pid = frontend_pid(client)
        rss_before = rss_mib(pid) if pid else None
        faults_before = minor_faults(pid) if pid else None
        loop_cpu_before = loop_cpu_s(pid) if pid else None
        done = threading.Event()
        health: list[float] = []
        rss: list[float] = []

        def poll() -> None:
            with httpx.Client(base_url=url, timeout=120) as poller:
                while not done.is_set():
                    started = time.perf_counter()
                    poller.get("/health")
                    health.append(time.perf_counter() - started)
                    if pid:
                        rss.append(rss_mib(pid))
                    time.sleep(poll_s)  # the polling period itself

        # The posters' connections are opened before the polls are timed, and a body is sent in one sendall, in C
        # without the GIL: an httpx client is ~0.1 s of Python to make, and httpx sends a large body in pieces,
        # copying what is left after each, all holding this process's GIL, which the poller's thread then waits
        # for (making 8 at once held it up to 34 ms).
        host, port = httpx.URL(url).host, httpx.URL(url).port
        posters = [http.client.HTTPConnection(host, port, timeout=120) for _ in range(bodies)]
        for poster in posters:
            poster.connect()

        def post(i: int) -> tuple[int | str, float, str]:
            started = time.perf_counter()
            try:
                posters[i].request("POST", path, body=payload, headers={"Content-Type": "application/json"})
                response = posters[i].getresponse()
                reply = response.read()
            except OSError as exc:  # the connection cut (a body read past --timeout-body, say)
                return type(exc).__name__, time.perf_counter() - started, ""
            finally:
                posters[i].close()
            error = json.loads(reply).get("error", {}) if response.status != 200 else {}
            return response.status, time.perf_counter() - started, str(error.get("param"))

        poller = threading.Thread(target=poll)
        poller.start()
        while len(health) < 5:  # a few polls at rest first
            time.sleep(poll_s)
        at_rest = max(health)
        with ThreadPoolExecutor(bodies) as pool:
            results = list(pool.map(post, range(bodies)))
        done.set()
        poller.join()
        faults = minor_faults(pid) - faults_before if pid and faults_before is not None else None
        loop_cpu = loop_cpu_s(pid) - loop_cpu_before if pid and loop_cpu_before is not None else None
    return {
        "shape": shape,
        "body_mib": round(len(payload) / 2**20, 2),
        "bodies": bodies,
        "statuses": sorted({str(status) for status, _, _ in results}),
        "params": sorted({param for _, _, param in results}),
        "body_seconds_max": round(max(seconds for _, seconds, _ in results), 3),
        "health_ms_at_rest_max": round(at_rest * 1000, 1),
        "health_ms_max": round(max(health) * 1000, 1),
        "health_polls": len(health),
        "frontend_rss_mib_before": rss_before and round(rss_before, 1),
        "frontend_rss_mib_peak": rss and round(max(rss), 1),
        "frontend_minor_faults": faults,
        "frontend_loop_cpu_ms": loop_cpu and round(loop_cpu * 1000, 1),
    }


def parse_holds(shape: str, repeats: int = 5) -> dict:
    """The shape's body read as the parsing thread reads it, in this process: its time, and its longest stretch
    of CPU time between two profiler events (a Python call or return, a C call from Python), in which no other
    thread can take the GIL; each the best of `repeats` (CPU time: a stretch the OS took the core away counts
    only the work)."""
    path, body = SHAPES[shape]
    payload = json.dumps(body).encode()
    max_values = HttpLimits().max_request_json_values
    # As in the frontend, what is alive before the parse is frozen: a full collection that the parse's objects
    # set off traverses them only, not this process's heap (the shapes' lists hold millions of references).
    freeze_startup_objects()

    def parse() -> None:
        try:
            validated(payload, MODELS[path], max_values)
        except ApiError:  # past the bound: the count's 400
            pass

    stamps: list[float] = []
    best_ms = best_hold_ms = float("inf")
    for _ in range(repeats):
        started = time.perf_counter()
        parse()
        best_ms = min(best_ms, (time.perf_counter() - started) * 1000)
        stamps.clear()
        stamps.append(time.thread_time())
        sys.setprofile(lambda frame, event, arg: stamps.append(time.thread_time()))
        try:
            parse()
        finally:
            sys.setprofile(None)
        stamps.append(time.thread_time())
        best_hold_ms = min(best_hold_ms, max(b - a for a, b in zip(stamps, stamps[1:])) * 1000)
    return {"parse_ms": round(best_ms, 1), "longest_gil_hold_ms": round(best_hold_ms, 2)}


def run(url: str, args: argparse.Namespace) -> dict:
    with httpx.Client(base_url=url, timeout=60) as client:
        small = small_request_latency_ms(client, args.small_requests)
    shapes = list(SHAPES) if args.shape == "all" else [args.shape]
    stalls = [{**stall(url, s, args.bodies, args.poll_ms / 1000), **parse_holds(s)} for s in shapes]
    return {"small_request_ms": small, "stalls": stalls}


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    if args.url is not None:
        result = run(args.url, args)
    else:
        with LaunchedServer(args.launch) as server:
            result = run(server.url, args)
    print(json.dumps(result, indent=2))
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump(result, f, indent=2)
    return result


if __name__ == "__main__":
    main()
