"""The engine once per attention backend on one workload, in one command: tokens/s and a full decode step's time.

    python -m benchmarks.attention_backends --model FOLDER --load-format dummy [--backends triton,flashinfer]

Each backend runs `benchmarks.offline` (W1 by default: 256 requests, prompts of 64-512 tokens, 256 new tokens,
greedy, EOS ignored; warmed up first) in a process of its own, so that neither inherits the other's memory;
every argument other than --backends and --json goes to it. Prints, per backend, tokens/s, the median wall time
of the fullest decode steps (every running request one token) and TTFT p50.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path


def run_backend(backend: str, offline_args: list[str], out: Path) -> dict:
    command = [sys.executable, "-m", "benchmarks.offline", *offline_args]
    command += ["--attention-backend", backend, "--baselines", "none", "--profile-steps", "0", "--json", str(out)]
    print(f"\n== {backend}: {' '.join(command[1:])}", flush=True)
    subprocess.run(command, check=True)
    return json.loads(out.read_text())


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--backends", default="triton,flashinfer", help="comma-separated --attention-backend values")
    parser.add_argument("--json", help="write every backend's benchmarks.offline results here")
    args, offline_args = parser.parse_known_args(argv)
    runs = {}
    with tempfile.TemporaryDirectory() as tmp:
        for backend in args.backends.split(","):
            runs[backend] = run_backend(backend, offline_args, Path(tmp) / f"{backend}.json")
    device = next(iter(runs.values()))["device"]
    print(f"\nattention backends on {device} ({' '.join(offline_args)})")
    print(f"{'backend':<12}{'class':<22}{'tokens/s':>10}{'decode step':>14}{'batch':>7}{'TTFT p50':>11}")
    for backend, run in runs.items():
        ours = run["results"][0]
        decode = ours["decode_step_host_ms"]
        step = f"{decode['step_wall']:.2f} ms" if decode else "-"
        batch = str(decode["batch"]) if decode else "-"
        print(
            f"{backend:<12}{ours['attention_backend']:<22}{ours['tokens_per_s']:>10.0f}{step:>14}{batch:>7}"
            f"{1000 * ours['ttft_p50_s']:>8.0f} ms"
        )
    if args.json:
        Path(args.json).write_text(json.dumps(runs, indent=2))


if __name__ == "__main__":
    main()
