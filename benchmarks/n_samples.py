"""The prompt work of one completions request with n samples per prompt: the scheduler's prompt tokens computed
and prefix-cache hits over the request (GET /stats), and its wall time.

    python -m benchmarks.n_samples --launch "--model ../shared/models/gpt2 --load-format dummy --device cpu" \\
        --prompts 4 --n 8 --prompt-len 512 --echo --logprobs 5 --output-json after.json
    python -m benchmarks.n_samples ... --root /tmp/before --output-json before.json   (another checkout's server)

Prompts are seeded random token ids (one request, `prompt` a list of them), sampled with a seed (sample i of
a prompt: seed + i), so two runs' choices can be compared token for token (`same_choices` in --compare).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import time
from pathlib import Path

import httpx

from benchmarks.serve import ROOT, LaunchedServer, server_stats

COUNTERS = ("prompt_tokens_computed", "cache_hit_tokens", "prompt_tokens_admitted", "steps")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--launch", help="launch.py's arguments (without it: --url)")
    parser.add_argument("--url", default="http://127.0.0.1:8000")
    parser.add_argument("--root", type=Path, default=ROOT, help="the checkout whose launch.py --launch runs")
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--n", type=int, default=8)
    parser.add_argument("--prompt-len", type=int, default=512)
    parser.add_argument("--max-tokens", type=int, default=8)
    parser.add_argument("--echo", action="store_true")
    parser.add_argument("--logprobs", type=int, help="with --echo: the prompt's logprobs too")
    parser.add_argument("--vocab", type=int, default=50000, help="token ids are drawn below this")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--output-json")
    parser.add_argument("--compare", nargs=2, metavar=("A", "B"), help="two --output-json files")
    return parser.parse_args(argv)


def request_body(args: argparse.Namespace) -> dict:
    rng = random.Random(args.seed)
    prompts = [[rng.randrange(1, args.vocab) for _ in range(args.prompt_len)] for _ in range(args.prompts)]
    body = {"prompt": prompts, "n": args.n, "max_tokens": args.max_tokens, "temperature": 1.0, "seed": args.seed}
    body.update({"echo": args.echo} if args.echo else {})
    body.update({"logprobs": args.logprobs} if args.logprobs is not None else {})
    return body


async def measure(url: str, body: dict) -> dict:
    async with httpx.AsyncClient(base_url=url, timeout=None) as client:
        before = await server_stats(client)
        started = time.perf_counter()
        response = await client.post("/v1/completions", json=body)
        wall_s = time.perf_counter() - started
        after = await server_stats(client)
    response.raise_for_status()
    schedulers = [role for role in (after or {}) if role.startswith("scheduler")]
    assert before is not None and after is not None and schedulers, "the server gives no scheduler stats"
    counters = {key: sum(after[r][key] - before[r][key] for r in schedulers) for key in COUNTERS}
    return {"wall_s": round(wall_s, 3), **counters, "choices": response.json()["choices"]}


def main(argv: list[str] | None = None) -> dict | None:
    args = parse_args(argv)
    if args.compare:
        a, b = (json.loads(Path(path).read_text()) for path in args.compare)
        for key in ("wall_s", *COUNTERS):
            print(f"{key:24} {a[key]:>12} {b[key]:>12}")
        pairs = list(zip(a["choices"], b["choices"]))
        print("same texts", len(a["choices"]) == len(b["choices"]) and all(x["text"] == y["text"] for x, y in pairs))
        if all(x["logprobs"] and y["logprobs"] for x, y in pairs):
            print("same tokens", all(x["logprobs"]["tokens"] == y["logprobs"]["tokens"] for x, y in pairs))
            differences = [
                abs(p - q)
                for x, y in pairs
                for p, q in zip(x["logprobs"]["token_logprobs"], y["logprobs"]["token_logprobs"])
                if p is not None and q is not None
            ]
            print("largest logprob difference", max(differences, default=0.0))
        return None
    body = request_body(args)
    if args.launch:
        with LaunchedServer(args.launch, program=[str(args.root / "launch.py")], root=args.root) as server:
            result = asyncio.run(measure(server.url, body))
    else:
        result = asyncio.run(measure(args.url, body))
    result["command"] = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}
    print({k: v for k, v in result.items() if k not in ("choices", "command")})
    if args.output_json:
        Path(args.output_json).write_text(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
