"""The serving benchmark's load generator: streamed POST /generate requests from one or more client processes.

    parent (benchmarks.serve)                           client process ×P  (python -m benchmarks.load_client)
      ├─ share i: requests i, i+P, i+2P … ─stdin JSON─▶   opens its aiohttp session, prints "ready"
      ├─ when all are ready: "go START" ──────stdin───▶   sends each request at START + its offset
      └─ merges ◀─────────────────────────a JSON file──   per-request timings, its own CPU and wall seconds

One asyncio process parses a few tens of thousands of NDJSON lines a second; past that it, and not the
server, would set the pace. Several processes (`--client-processes`) keep the client out of the way, and
each one reports its CPU use so a run can show it was not the limit (`ClientUsage.busiest_cpu_pct`).
Processes talk JSON over pipes: nothing is pickled.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from benchmarks.latency import RequestTimings
from benchmarks.workloads import WorkloadRequest

ROOT = Path(__file__).resolve().parent.parent
REQUEST_TIMEOUT_S = 600.0  # the longest silence on one stream (a request can queue behind many others)
START_MARGIN_S = 0.2  # between "go" and the first send, so every process is waiting when the run starts
# A client process this busy (CPU time over wall time, %) may itself be the limit of the run.
CLIENT_SATURATED_PCT = 80.0


def default_client_processes() -> int:
    """A quarter of the machine's cores, 1 to 8: the server's own processes need the rest."""
    return max(1, min(8, (os.cpu_count() or 1) // 4))


@dataclass(slots=True)
class ClientUsage:
    """What the load generator itself cost: CPU seconds over wall seconds, per client process."""

    processes: int
    cpu_s: list[float]
    wall_s: list[float]
    peak_cpu_pct: list[float]  # each process's busiest half second
    event_loop: str  # "uvloop" or "asyncio"

    @property
    def cpu_pct(self) -> list[float]:
        return [100 * c / w if w > 0 else 0.0 for c, w in zip(self.cpu_s, self.wall_s)]

    @property
    def busiest_cpu_pct(self) -> float:
        return max(self.cpu_pct, default=0.0)

    @property
    def saturated(self) -> bool:
        return max(self.peak_cpu_pct, default=0.0) >= CLIENT_SATURATED_PCT

    def to_dict(self) -> dict:
        return {**asdict(self), "cpu_pct": self.cpu_pct, "busiest_cpu_pct": self.busiest_cpu_pct}


def run_clients(
    url: str,
    workload: list[WorkloadRequest],
    offsets: list[float],
    sampling: dict,
    headers: dict,
    processes: int,
    max_concurrency: int | None = None,
) -> tuple[list[RequestTimings], ClientUsage]:
    """Send the workload from `processes` client processes; timings in workload order, and the clients' cost.
    `max_concurrency` is split evenly between the processes (rounded up)."""
    processes = max(1, min(processes, len(workload)))
    per_process_cap = -(-max_concurrency // processes) if max_concurrency else None
    children = []
    report_dir = Path(tempfile.mkdtemp(prefix="clearserve-client-"))
    for p in range(processes):
        indices = list(range(p, len(workload), processes))
        share = {
            "url": url,
            "headers": headers,
            "sampling": sampling,
            "max_concurrency": per_process_cap,
            # A file, not stdout: a report is megabytes, and the parent waits on one child at a time.
            "report_path": str(report_dir / f"client-{p}.json"),
            "requests": [{"index": i, "offset": offsets[i], **asdict(workload[i])} for i in indices],
        }
        child = subprocess.Popen(
            [sys.executable, "-m", "benchmarks.load_client"],
            cwd=ROOT,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        child.stdin.write(json.dumps(share) + "\n")
        child.stdin.flush()
        children.append(child)
    try:
        for child in children:
            line = child.stdout.readline()
            if line.strip() != "ready":
                raise RuntimeError(f"a client process did not start (said {line!r}, exit code {child.poll()})")
        start = time.time() + START_MARGIN_S
        for child in children:
            child.stdin.write(f"go {start}\n")
            child.stdin.close()
        reports = []
        for p, child in enumerate(children):
            if child.wait() != 0:
                raise RuntimeError(f"a client process exited with code {child.returncode}")
            reports.append(json.loads((report_dir / f"client-{p}.json").read_text()))
    finally:
        for child in children:
            if child.poll() is None:
                child.kill()
        shutil.rmtree(report_dir, ignore_errors=True)
    timings: list[RequestTimings | None] = [None] * len(workload)
    for report in reports:
        for index, raw in report["timings"]:
            timings[index] = RequestTimings(**raw)
    usage = ClientUsage(
        processes,
        [r["cpu_s"] for r in reports],
        [r["wall_s"] for r in reports],
        [r["peak_cpu_pct"] for r in reports],
        reports[0]["event_loop"],
    )
    return [t for t in timings if t is not None], usage


# ---------------------------------------------------------------------------------------------- one process


async def send_request(session, request: WorkloadRequest, sampling: dict) -> RequestTimings:
    """One streamed /generate request, timed. Failures are recorded, not raised."""
    import aiohttp

    body: dict = {"stream": True, "sampling_params": {**sampling, "max_tokens": request.max_tokens}}
    if request.input_ids is not None:
        body["input_ids"] = request.input_ids
    else:
        body["prompt"] = request.prompt
    content = json.dumps(body).encode()  # encoded before the submit stamp: our own work is not the server's
    timings = RequestTimings(submit=time.time())
    try:
        async with session.post("/generate", data=content, headers={"Content-Type": "application/json"}) as response:
            if response.status != 200:
                body_text = (await response.read()).decode(errors="replace")
                timings.error = f"HTTP {response.status}: {body_text[:300]}"
            else:
                async for line in response.content:
                    if line.strip():
                        record_line(timings, json.loads(line))
    except (aiohttp.ClientError, asyncio.TimeoutError, ValueError, KeyError) as exc:
        timings.error = f"{type(exc).__name__}: {exc}"
    timings.done = time.time()
    if timings.error is None and timings.finish_reason is None:
        timings.error = "the stream ended without a summary line"
    return timings


def record_line(timings: RequestTimings, event: dict) -> None:
    token_ids = event.get("token_ids")
    if token_ids is not None:  # an output
        n = len(token_ids)
        timings.token_sampled.extend([event["sampled_time"]] * n)
        timings.token_streamed.extend([event["streamed_time"]] * n)
        if event["finish_reason"] is not None:
            timings.finished = event["streamed_time"]
        return
    # The summary line closes the stream.
    times = event["times"]
    timings.prompt_tokens = event["prompt_tokens"]
    timings.completion_tokens = event["completion_tokens"]
    timings.num_cached_tokens = event["num_cached_tokens"]
    timings.finish_reason = event["finish_reason"]
    timings.arrival, timings.tokenized = times["arrival"], times["tokenized"]
    timings.queued, timings.first_scheduled = times["queued"], times["first_scheduled"]


def make_session(url: str, headers: dict):
    """One connection per request in flight (no pool limit): a request waiting for a pooled connection
    would count as the server's submit latency."""
    import aiohttp

    return aiohttp.ClientSession(
        base_url=url,
        headers=headers,
        connector=aiohttp.TCPConnector(limit=0, force_close=False),
        timeout=aiohttp.ClientTimeout(total=None, sock_read=REQUEST_TIMEOUT_S),
        read_bufsize=2**18,
    )


async def _run_share(share: dict, start: asyncio.Future, cpu: CpuMeter) -> list[tuple[int, RequestTimings]]:
    async with make_session(share["url"], share["headers"]) as session:
        print("ready", flush=True)
        start_at = await start
        cpu.start()
        loop = asyncio.get_running_loop()
        gate = asyncio.Semaphore(share["max_concurrency"] or len(share["requests"]) or 1)
        wall_start = loop.time() + (start_at - time.time())

        async def scheduled(item: dict) -> tuple[int, RequestTimings]:
            await asyncio.sleep(max(0.0, wall_start + item["offset"] - loop.time()))  # the arrival schedule
            request = WorkloadRequest(item["max_tokens"], item["prompt"], item["input_ids"])
            async with gate:
                return item["index"], await send_request(session, request, share["sampling"])

        results = list(await asyncio.gather(*(scheduled(item) for item in share["requests"])))
        cpu.stop()
        return results


class CpuMeter:
    """This process's CPU time over the run, and its busiest window (an average over a run with an idle
    tail would hide a client that was saturated while the load was high)."""

    WINDOW_S = 0.5

    def __init__(self) -> None:
        self.cpu_s = self.wall_s = self.peak_pct = 0.0
        self._task: asyncio.Task | None = None

    def start(self) -> None:
        self._cpu0, self._wall0 = time.process_time(), time.time()
        self._task = asyncio.create_task(self._sample())

    async def _sample(self) -> None:
        cpu, wall = self._cpu0, self._wall0
        while True:
            await asyncio.sleep(self.WINDOW_S)
            now_cpu, now_wall = time.process_time(), time.time()
            self.peak_pct = max(self.peak_pct, 100 * (now_cpu - cpu) / (now_wall - wall))
            cpu, wall = now_cpu, now_wall

    def stop(self) -> None:
        self.cpu_s, self.wall_s = time.process_time() - self._cpu0, time.time() - self._wall0
        if self.wall_s > 0:  # a run shorter than a window has one window: the run
            self.peak_pct = max(self.peak_pct, 100 * self.cpu_s / self.wall_s)
        if self._task is not None:
            self._task.cancel()


async def _read_go(start: asyncio.Future) -> None:
    line = await asyncio.to_thread(sys.stdin.readline)
    word, _, value = line.partition(" ")
    if word != "go":
        raise RuntimeError(f"expected 'go START', got {line!r}")
    start.set_result(float(value))


async def _child_main() -> None:
    share = json.loads(sys.stdin.readline())
    start: asyncio.Future = asyncio.get_running_loop().create_future()
    reader = asyncio.create_task(_read_go(start))
    cpu = CpuMeter()
    results = await _run_share(share, start, cpu)
    await reader
    report = {
        "event_loop": type(asyncio.get_running_loop()).__module__.split(".")[0],
        "timings": [(i, asdict(t)) for i, t in results],
        "cpu_s": cpu.cpu_s,
        "wall_s": cpu.wall_s,
        "peak_cpu_pct": cpu.peak_pct,
    }
    Path(share["report_path"]).write_text(json.dumps(report))


def run_event_loop(main):
    """uvloop where it is installed: a client reading hundreds of streams pays the event loop once per chunk,
    and uvloop's is a few times cheaper than asyncio's; asyncio otherwise."""
    try:
        import uvloop
    except ImportError:
        return asyncio.run(main)
    return uvloop.run(main)


if __name__ == "__main__":
    run_event_loop(_child_main())
