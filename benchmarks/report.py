"""Refresh this machine's results table in docs/benchmarks.md: run every workload, rewrite the table.

    python -m benchmarks.report                                   # CPU: the embedded SmolLM2, smaller sizes
    python -m benchmarks.report --model PATH/gpt2 --load-format dummy   # GPU: GPT-2 small, full sizes

The table sits between `<!-- report:cpu -->` / `<!-- report:gpu -->` and `<!-- /report -->` markers; only
the current machine's is replaced. Each row names the exact command that produced it. Raw JSON of every
run goes to --output-dir.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import torch

DOC = Path(__file__).resolve().parent.parent / "docs" / "benchmarks.md"


@dataclass(frozen=True)
class Sizes:
    offline: str  # benchmarks.offline workload flags
    burst: str  # benchmarks.serve: all at once
    poisson: str  # benchmarks.serve: Poisson arrivals


GPU = Sizes(
    offline="--num-requests 256 --input-len-range 64-512 --output-len 256",
    burst="--num-requests 256 --input-len-range 64-512 --max-new-tokens 256 --no-stop-on-eos",
    poisson="--num-requests 400 --input-len-range 64-512 --output-len-range 16-256 --request-rate 20",
)
CPU = Sizes(
    offline="--num-requests 16 --input-len-range 32-128 --output-len 32",
    burst="--num-requests 16 --input-len-range 32-128 --max-new-tokens 32 --no-stop-on-eos",
    poisson="--num-requests 32 --input-len-range 32-128 --output-len-range 8-32 --request-rate 1",
)


def _cpu_name() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines() if Path("/proc/cpuinfo").exists() else []:
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return "CPU"


def run(module: str, flags: str) -> None:
    cmd = [sys.executable, "-m", module, *shlex.split(flags)]
    print("$", shlex.join(cmd[1:]), flush=True)
    subprocess.run(cmd, check=True)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="default: the embedded SmolLM2-135M-Instruct")
    parser.add_argument("--load-format", default="auto")
    parser.add_argument("--output-dir", default="bench-results")
    parser.add_argument("--doc", default=str(DOC))
    args = parser.parse_args(argv)

    on_gpu = torch.cuda.is_available()
    machine = "gpu" if on_gpu else "cpu"
    sizes = GPU if on_gpu else CPU
    out = Path(args.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    engine = " ".join(
        ([f"--model {shlex.quote(args.model)}"] if args.model else [])
        + ([f"--load-format {args.load_format}"] if args.load_format != "auto" else [])
        + ([] if on_gpu else ["--device cpu"])
    )

    offline_flags = f"{engine} {sizes.offline}".strip()
    run("benchmarks.offline", f"{offline_flags} --json {out / 'offline.json'}")
    serve_runs = {}
    for name, flags in (("burst", sizes.burst), ("poisson", sizes.poisson)):
        serve_flags = f"--launch {shlex.quote(engine)} {flags}"
        run("benchmarks.serve", f"{serve_flags} --output-json {out / f'serve_{name}.json'}")
        serve_runs[name] = serve_flags

    offline = json.loads((out / "offline.json").read_text())
    device_name = offline["device"] if on_gpu else f"{_cpu_name()}, {os.cpu_count()} cores"
    rows = ["| workload | figure | value |", "|---|---|---|"]
    ours = offline["results"][0]["tokens_per_s"]
    cells = [f"ours {ours:.0f}"] + [
        f"{r['name']} {r['tokens_per_s']:.0f} (ours {ours / r['tokens_per_s']:.1f}×)" for r in offline["results"][1:]
    ]
    rows.append(f"| offline: `python -m benchmarks.offline {offline_flags}` | tokens/s | {'; '.join(cells)} |")
    for name, flags in serve_runs.items():
        s = json.loads((out / f"serve_{name}.json").read_text())["summary"]
        lat = s["latencies_ms"]
        cmd = f"`python -m benchmarks.serve {flags}`"
        rows.append(f"| serve {name}: {cmd} | completion tokens/s | {s['completion_throughput']:.0f} |")
        for key, label in (
            ("ttft", "TTFT"),
            ("tpot", "TPOT"),
            ("itl", "ITL"),
            ("e2e", "end-to-end"),
            ("queue_wait", "queue wait"),
            ("prefill_to_first_token", "prefill→first token"),
        ):
            rows.append(f"| | {label} p50 / p99 (ms) | {lat[key]['p50']:.1f} / {lat[key]['p99']:.1f} |")
    table = f"Machine: {device_name}.\n\n" + "\n".join(rows)

    doc = Path(args.doc)
    text = doc.read_text()
    pattern = re.compile(rf"(<!-- report:{machine} -->\n).*?(\n<!-- /report -->)", re.S)
    if not pattern.search(text):
        raise SystemExit(f"{doc} has no <!-- report:{machine} --> ... <!-- /report --> section")
    doc.write_text(pattern.sub(lambda m: m.group(1) + table + m.group(2), text))
    print(table)


if __name__ == "__main__":
    main()
