"""Data parallelism across nodes against one replica: the burst through a frontend node whose second replica a
headless node serves (two launchers on one 2-GPU host, one GPU each, joined over TCP as two hosts would be),
against one launcher with one replica on one GPU. The arms alternate, `--repeats` rounds.

    python -m benchmarks.multinode_dp --model .device-cache/gpt2 --out /tmp/mndp --client-processes 12

Every node starts with launch.py's default flags (`--api-server-count`, `--server-flags` to change them), so the
ratio is what a user gets without tuning.

Each arm starts its launcher(s) with CUDA_VISIBLE_DEVICES naming one GPU each, waits until /health says every
replica serves ({"status": "ok"}: the headless node has joined), runs `benchmarks.serve --url` with the burst
(1,024 requests, 64-512 random prompt ids, 256 new tokens, EOS ignored), then stops them. Prints completion
tokens/s per arm and the DP=2 / DP=1 ratio; summary.json keeps every run's numbers and command.
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx

from benchmarks.load_client import default_client_processes
from benchmarks.serving_gap import BURST, run

ROOT = Path(__file__).resolve().parent.parent
START_TIMEOUT_S = 600.0


def start(flags: list[str], gpu: str, env: dict[str, str], log: Path) -> subprocess.Popen:
    command = [sys.executable, str(ROOT / "launch.py"), *flags]
    with open(log, "a") as f:
        f.write(f"$ CUDA_VISIBLE_DEVICES={gpu} {' '.join(command)}\n")
    out = open(log, "ab")  # noqa: SIM115 (the child keeps it)
    return subprocess.Popen(
        command, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT, env={**env, "CUDA_VISIBLE_DEVICES": gpu}
    )


def wait_serving(url: str, processes: list[subprocess.Popen]) -> None:
    """Until /health says every replica serves (a headless node's included)."""
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        if any(p.poll() is not None for p in processes):
            raise RuntimeError("a launcher exited while starting: see the log")
        try:
            if httpx.get(f"{url}/health", timeout=5).json() == {"status": "ok"}:
                return
        except httpx.HTTPError:
            pass
        time.sleep(1)  # a poll with a deadline
    raise TimeoutError(f"{url} did not serve every replica within {START_TIMEOUT_S} s")


def stop(processes: list[subprocess.Popen]) -> None:
    for p in processes:  # the frontend node first: a headless node stopping first would fail its replica
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
            try:
                p.wait(60)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()


def arm(label: str, dp: int, args: argparse.Namespace, out: Path, log: Path) -> dict:
    port, rpc_port = 8100, 29550
    url = f"http://127.0.0.1:{port}"
    env = {**os.environ, "CLEARSERVE_CLUSTER_SECRET": secrets.token_hex(32)}
    common = ["--model", args.model, "--load-format", "dummy", *shlex.split(args.server_flags)]
    head = [*common, "--port", str(port)]
    if args.api_server_count is not None:
        head += ["--api-server-count", str(args.api_server_count)]
    processes = []
    try:
        if dp == 1:
            processes.append(start(head, "0", env, log))
        else:
            nodes = ["-dp", "2", "--data-parallel-rpc-port", str(rpc_port)]
            processes.append(start([*head, *nodes, "--data-parallel-size-local", "1"], "0", env, log))
            processes.append(start([*common, *nodes, "--data-parallel-start-rank", "1", "--headless"], "1", env, log))
        wait_serving(url, processes)
        path = out / f"{label}.json"
        flags = ["--url", url, "--model", args.model, *BURST.split(), "--client-processes", str(args.client_processes)]
        run(["benchmarks.serve", *flags, "--label", label, "--output-json", str(path)], log)
        result = json.loads(path.read_text())
    finally:
        stop(processes)
    s = result["summary"]
    return {"label": label, "dp": dp, "tok_s": s["completion_throughput"], "failed": s["failed"], "command": flags}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True, help="a model folder (random weights are used)")
    parser.add_argument("--out", required=True)
    parser.add_argument("--repeats", type=int, default=2, help="rounds of the two arms, alternated")
    parser.add_argument(
        "--api-server-count", type=int, default=None, help="the frontend node's HTTP processes (default: launch.py's)"
    )
    parser.add_argument("--server-flags", default="", help="more launch.py flags for every node (default: none)")
    parser.add_argument("--client-processes", type=int, default=default_client_processes())
    args = parser.parse_args(argv)
    args.model = str(Path(args.model).resolve())
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    log = out / "commands.log"
    rows = []
    for rep in range(1, args.repeats + 1):
        rows.append(arm(f"burst_dp1_{rep}", 1, args, out, log))
        rows.append(arm(f"burst_dp2_two_nodes_{rep}", 2, args, out, log))
    (out / "summary.json").write_text(json.dumps(rows, indent=1))
    for row in rows:
        print(f"{row['label']:<24} {row['tok_s']:>10,.0f} tok/s   failed {row['failed']}")
    one = [r["tok_s"] for r in rows if r["dp"] == 1]
    two = [r["tok_s"] for r in rows if r["dp"] == 2]
    ratios = " / ".join(f"{b / a:.2f}x" for a, b in zip(one, two))
    print(f"DP=2 across two nodes against DP=1, round by round: {ratios} (target: 1.8x or more)")


if __name__ == "__main__":
    main()
