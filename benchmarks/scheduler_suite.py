"""The scheduler's three before/after benchmarks, each pair run here in one invocation, with a table at the end.

    python -m benchmarks.scheduler_suite                       # SmolLM2-135M-Instruct on CPU, every pair twice
    python -m benchmarks.scheduler_suite --only prefix-cache --repeats 1 --model ../shared/models/gpt2

    prefix-cache      16 prompts "Hello" × 900..915, one request at a time, 1 new token:
                      TTFT p50 without the prefix cache / with it  ≥ 3
    prompt-budget     32 unique prompts "Hello" × (1, 1, 1, 64) cycled, one every 20 ms, 32 new tokens, decode
                      batch 8: ITL p99 with no budget (the long prompt whole, no chunking) / with a small budget
                      and chunked prefill  > 1, and completion throughput with the budget no worse
    prefill-batching  32 unique short prompts at once, 8 new tokens:
                      TTFT p50 with one prefill per step / with every waiting prompt in one step  ≥ 2
    long-prompts      (GPU) 64 short prompts sent together, decoding 512 tokens each, and 16 unique long prompts
                      (4,000-7,000 tokens, 16 new tokens) arriving one every 50 ms while they decode: ITL p99
                      with no chunking (each long prompt whole in one step) / with a --long-prompt-budget (512)
                      ≥ 2, completion throughput within 10 %. Needs a context of 8k (the SmolLM2 architecture):

    python -m benchmarks.scheduler_suite --only long-prompts --model .device-cache/smollm2 \
        --server-flags "--load-format dummy"

Every arm launches its own server (`benchmarks.serve --launch`), so no arm inherits another's prefix cache.
Repetitions alternate the order of the two arms, so a slow drift of the machine does not favour one side.
"""

from __future__ import annotations

import argparse
import json
import shlex
import subprocess
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from benchmarks import serve
from benchmarks.workloads import unique_prompt


@dataclass(frozen=True, slots=True)
class Pair:
    name: str
    client_args: list[str]
    before_flags: str  # server flags of the baseline arm
    after_flags: str  # server flags of the arm with the feature
    metric: str  # a key of benchmarks.latency.LATENCY_METRICS
    stat: str  # "p50" | "p95" | "p99"
    min_ratio: float  # the target: before / after of metric.stat at least this
    throughput_no_worse: bool = False
    throughput_tolerance: float = 0.0  # "no worse" allows the arm with the feature this fraction less
    prompts_file: list[dict] | None = None  # written next to the results and passed as --prompts-file


@dataclass(slots=True)
class Outcome:
    pair: Pair
    repetition: int
    before: dict  # benchmarks.serve results
    after: dict
    commands: list[str] = field(default_factory=list)

    @property
    def before_value(self) -> float:
        return self.before["summary"]["latencies_ms"][self.pair.metric][self.pair.stat]

    @property
    def after_value(self) -> float:
        return self.after["summary"]["latencies_ms"][self.pair.metric][self.pair.stat]

    @property
    def ratio(self) -> float:
        return self.before_value / self.after_value

    @property
    def throughput_ratio(self) -> float:
        return self.after["summary"]["completion_throughput"] / self.before["summary"]["completion_throughput"]

    @property
    def met(self) -> bool:
        floor = 1.0 - self.pair.throughput_tolerance
        throughput_ok = not self.pair.throughput_no_worse or self.throughput_ratio >= floor
        return self.ratio >= self.pair.min_ratio and throughput_ok


def long_prompt_workload(
    num_short: int = 64, num_long: int = 16, first_long_ms: float = 100.0, long_every_ms: float = 50.0
) -> list[dict]:
    """Short prompts sent together that decode long, then long unique prompts arriving one by one while every
    short one decodes (at_ms: when each is sent). Each whole-prompt step holds every decode back once, so with
    512 tokens decoded each, 16 long prompts stall ~3 % of the inter-token gaps: enough for the p99 to see."""
    items: list[dict] = [
        {"prompt": unique_prompt(i, "Hello"), "max_tokens": 512, "at_ms": 0.0} for i in range(num_short)
    ]
    for k in range(num_long):
        length = 4000 + (3000 * k) // max(1, num_long - 1)
        items.append(
            {
                "prompt": unique_prompt(len(items), " Hello" * length),
                "max_tokens": 16,
                "at_ms": first_long_ms + k * long_every_ms,
            }
        )
    return items


def pairs(budget: int, long_prompt_budget: int = 512) -> list[Pair]:
    return [
        Pair(
            "prefix-cache",
            [
                "--num-requests",
                "16",
                "--prompt",
                "Hello",
                "--prompt-repeats",
                "900-915",
                "--max-concurrency",
                "1",
                "--max-new-tokens",
                "1",
            ],
            before_flags="--no-prefix-cache",
            after_flags="",
            metric="ttft",
            stat="p50",
            min_ratio=3.0,
        ),
        Pair(
            "prompt-budget",
            # Unique prompts: the eight long prompts would otherwise share their blocks through the prefix
            # cache and there would be almost nothing left to chunk.
            [
                "--num-requests",
                "32",
                "--prompt",
                "Hello",
                "--prompt-repeats",
                "1,1,1,64",
                "--unique-prompts",
                "--submit-interval-ms",
                "20",
                "--max-new-tokens",
                "32",
                "--no-stop-on-eos",
            ],
            before_flags="--max-num-seqs 8 --max-num-batched-tokens 4096 --no-chunked-prefill",
            after_flags=f"--max-num-seqs 8 --max-num-batched-tokens {budget}",
            metric="itl",
            stat="p99",
            min_ratio=1.0,
            throughput_no_worse=True,
        ),
        Pair(
            "prefill-batching",
            [
                "--num-requests",
                "32",
                "--prompt",
                "Hello",
                "--unique-prompts",
                "--max-new-tokens",
                "8",
                "--no-stop-on-eos",
            ],
            before_flags="--max-prefill-requests 1",
            after_flags="",
            metric="ttft",
            stat="p50",
            min_ratio=2.0,
        ),
        Pair(
            "long-prompts",
            ["--no-stop-on-eos"],
            before_flags="--max-num-batched-tokens 8192 --no-chunked-prefill",
            after_flags=f"--max-num-batched-tokens {long_prompt_budget}",
            metric="itl",
            stat="p99",
            min_ratio=2.0,
            throughput_no_worse=True,
            throughput_tolerance=0.10,
            prompts_file=long_prompt_workload(),
        ),
    ]


def run_arm(pair: Pair, arm: str, flags: str, base_flags: str, repetition: int, out: Path) -> tuple[dict, str]:
    stem = f"{pair.name}-{arm}-{repetition}"
    client_args = list(pair.client_args)
    if pair.prompts_file is not None:
        prompts = out / f"{pair.name}-prompts.json"
        prompts.write_text(json.dumps(pair.prompts_file))
        client_args += ["--prompts-file", str(prompts), "--num-requests", str(len(pair.prompts_file))]
    argv = [
        "--launch",
        f"{base_flags} {flags}".strip(),
        *client_args,
        "--label",
        stem,
        "--output-json",
        str(out / f"{stem}.json"),
        "--plot-dir",
        str(out / stem),
        "--server-log",
        str(out / f"{stem}.server.log"),
    ]
    command = shlex.join(["python", "-m", "benchmarks.serve", *argv])
    print(f"\n$ {command}", flush=True)
    result = serve.main(argv)
    assert result is not None
    return result, command


def run_pair(pair: Pair, base_flags: str, repetition: int, out: Path) -> Outcome:
    arms = [("before", pair.before_flags), ("after", pair.after_flags)]
    if repetition % 2 == 0:
        arms.reverse()
    results: dict[str, dict] = {}
    commands = []
    for arm, flags in arms:
        results[arm], command = run_arm(pair, arm, flags, base_flags, repetition, out)
        commands.append(command)
    return Outcome(pair, repetition, results["before"], results["after"], commands)


def print_table(outcomes: list[Outcome]) -> None:
    print(
        f"\n{'workload':<18}{'run':>4}  {'figure':<26}{'before':>10}{'after':>10}{'before/after':>14}  {'target':<10}"
        f"{'met':>5}"
    )
    for o in outcomes:
        p = o.pair
        target = f"≥ {p.min_ratio:g}"
        print(
            f"{p.name:<18}{o.repetition:>4}  {p.metric.upper() + ' ' + p.stat + ' (ms)':<26}{o.before_value:>10.1f}"
            f"{o.after_value:>10.1f}{o.ratio:>14.2f}  {target:<10}{'yes' if o.met else 'NO':>5}"
        )
        if p.metric == "itl":  # the engine's own gaps beside them: what the serving path added is the difference
            b, a = (r["summary"]["latencies_ms"]["itl_sampled"][p.stat] for r in (o.before, o.after))
            print(f"{'':<22}  {'ITL as sampled ' + p.stat + ' (ms)':<26}{b:>10.1f}{a:>10.1f}{b / a:>14.2f}")
        if p.throughput_no_worse:
            b, a = (r["summary"]["completion_throughput"] for r in (o.before, o.after))
            floor = f"after/before ≥ {1 - p.throughput_tolerance:g}"
            print(f"{'':<22}  {'completion tokens/s':<26}{b:>10.1f}{a:>10.1f}{a / b:>14.2f}  {floor:<10}")


def engine_version() -> str:
    """The commit the servers run, marked dirty when engine files differ from it: every arm starts a
    server from the working tree, so an edit during the suite would change what is measured."""

    def git(*args: str) -> str:
        return subprocess.run(["git", *args], cwd=serve.ROOT, capture_output=True, text=True).stdout

    if not git("rev-parse", "--is-inside-work-tree").strip():
        return f"{serve.ROOT} (not a git checkout)"

    changed = [
        line[3:]
        for line in git("status", "--porcelain").splitlines()
        if not line[3:].startswith(("benchmarks/", "docs/", "tests/"))
    ]
    head = git("rev-parse", "--short", "HEAD").strip()
    return f"{head} + uncommitted changes in {', '.join(changed)}" if changed else head


def main(argv: list[str] | None = None) -> list[Outcome]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", help="served model (default: the embedded SmolLM2-135M-Instruct)")
    parser.add_argument("--server-flags", default="--device cpu", help="flags every arm's server gets")
    parser.add_argument(
        "--budget", type=int, default=32, help="prompt-budget: --max-num-batched-tokens of the arm with a budget"
    )
    parser.add_argument(
        "--long-prompt-budget", type=int, default=512, help="long-prompts: --max-num-batched-tokens of the chunked arm"
    )
    parser.add_argument("--repeats", type=int, default=2, help="runs of each pair")
    parser.add_argument("--only", action="append", help="run only this pair (repeatable)")
    parser.add_argument(
        "--output-dir",
        default=str(Path(tempfile.gettempdir()) / "clearserve-scheduler-suite"),
        help="each run's JSON, plots and server log",
    )
    args = parser.parse_args(argv)

    base_flags = args.server_flags + (f" --model {shlex.quote(args.model)}" if args.model else "")
    # long-prompts needs a GPU and an 8k context: run it when asked for by name.
    chosen = [
        p
        for p in pairs(args.budget, args.long_prompt_budget)
        if (p.name in args.only if args.only else p.name != "long-prompts")
    ]
    out = Path(args.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    version = engine_version()
    outcomes = [
        run_pair(pair, base_flags, repetition, out) for pair in chosen for repetition in range(1, args.repeats + 1)
    ]
    print_table(outcomes)
    print(f"engine: {version}")
    if engine_version() != version:
        print(f"WARNING: the engine changed during the suite (now {engine_version()}): the arms may differ in code")
    (out / "suite.json").write_text(
        json.dumps(
            {
                "engine": version,
                "outcomes": [
                    {
                        "pair": o.pair.name,
                        "repetition": o.repetition,
                        "metric": f"{o.pair.metric} {o.pair.stat}",
                        "before_ms": o.before_value,
                        "after_ms": o.after_value,
                        "ratio": o.ratio,
                        "met": o.met,
                        "completion_throughput": [
                            o.before["summary"]["completion_throughput"],
                            o.after["summary"]["completion_throughput"],
                        ],
                        "commands": o.commands,
                    }
                    for o in outcomes
                ],
            },
            indent=1,
        )
    )
    return outcomes


if __name__ == "__main__":
    main()
