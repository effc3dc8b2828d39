"""Where a served process spends its time, from py-spy's raw (collapsed-stack) output: each frame's self and
inclusive share of the samples, and optionally what runs beneath one frame.

    py-spy record --pid PID --rate 400 --gil --duration 10 --format raw --output sched.raw
    python -m benchmarks.pyspy_top sched.raw [--top 40] [--under "RequestMirrors.step_inputs"]

py-spy samples a running process from outside (no restart, no tracing overhead in it); `--gil` keeps only the
samples where a thread holds the GIL, i.e. the work, not the waits. The pids are in `GET /stats`
(`replies[role].pid`). On the lent GPU machine py-spy travels as a wheel (benchmarks/device_wheels.sh) installed
with `--target DIR`; the binary is DIR/bin/py-spy.
"""

from __future__ import annotations

import argparse
from collections import Counter
from pathlib import Path


def read_raw(path: Path) -> list[tuple[list[str], int]]:
    """Each line: frames from the outermost, separated by ';', then a space and the sample count."""
    stacks = []
    for line in path.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        if stack and count.isdigit():
            stacks.append((stack.split(";"), int(count)))
    return stacks


def shares(stacks: list[tuple[list[str], int]], under: str | None = None) -> tuple[int, Counter, Counter]:
    """(samples, self counts, inclusive counts); with `under`, only what runs below the first frame containing it
    (the frame itself excluded), as shares of all samples."""
    total = sum(count for _, count in stacks)
    own: Counter = Counter()
    inclusive: Counter = Counter()
    for frames, count in stacks:
        if under is not None:
            at = next((i for i, frame in enumerate(frames) if under in frame), None)
            if at is None or at + 1 == len(frames):
                continue
            frames = frames[at + 1 :]
        own[frames[-1]] += count
        for frame in set(frames):
            inclusive[frame] += count
    return total, own, inclusive


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("raw", type=Path)
    parser.add_argument("--top", type=int, default=40)
    parser.add_argument("--under", help="only what runs beneath the first frame containing this text")
    args = parser.parse_args(argv)
    total, own, inclusive = shares(read_raw(args.raw), args.under)
    print(f"{total} samples" + (f"; beneath {args.under!r}" if args.under else ""))
    for title, counts in (("self", own), ("inclusive", inclusive)):
        print(f"--- {title}, % of all samples")
        for frame, count in counts.most_common(args.top):
            print(f"{100 * count / max(1, total):5.1f}  {frame}")
    return {"samples": total, "self": dict(own), "inclusive": dict(inclusive)}


if __name__ == "__main__":
    main()
