"""A tokenizer worker's memory under the soak's requests, in one process and without sockets: what
`benchmarks.soak` shows of a tokenizer worker in an hour of serving, in a minute of CPU.

    python -m benchmarks.tokenizer_memory --model /tmp/soak-model --requests 60000 --every 6000
    python -m benchmarks.tokenizer_memory --model /tmp/soak-model --replicas 2   # the router's prefix memory

Each request goes the way a tokenizer worker takes it (tokenizer_worker/process.py): drawn by the soak's
generator (completion or chat, n = 1 or 2, sometimes a stop string), tokenized, routed, detokenized one random
token at a time through its stop strings until max_tokens, or dropped after a few tokens as the soak's
cancelled streams are, then released. Every --every requests it prints the process's RSS, the requests still
tracked and the prefix hashes the router remembers; between requests the first two hold nothing.
"""

from __future__ import annotations

import argparse
import random
import time

from benchmarks.soak import make_request
from common.messages import GenerateRequest, TokenBatch, TokenizedRequest
from common.sampling_params import SamplingParams
from tokenizer_worker.background_encoder import EncodeJob
from tokenizer_worker.router import ReplicaRouter
from tokenizer_worker.tokenizer import Tokenizer
from tokenizer_worker.worker import TokenizerWorker

CANCEL_FRACTION = 0.07  # the soak drops 10% of its streams, which are 70% of its requests


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True, help="a model folder (its tokenizer is all that is loaded)")
    p.add_argument("--requests", type=int, default=60000)
    p.add_argument("--every", type=int, default=6000, help="requests between samples")
    p.add_argument("--replicas", type=int, default=1, help="engine replicas the router chooses among")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args(argv)


def rss_mib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096 / 2**20


def serve_one(worker: TokenizerWorker, router: ReplicaRouter, rng: random.Random, first_rid: int) -> int:
    """One soak request, all its choices, start to end; returns the request ids it used."""
    _, body = make_request(rng, chat=True)
    sampling = SamplingParams(max_tokens=body["max_tokens"], temperature=body["temperature"], stop=body.get("stop", []))
    live = []
    for rid in range(first_rid, first_rid + body.get("n", 1)):
        request = GenerateRequest(
            rid, sampling, time.time(), prompt=body.get("prompt"), chat_messages=body.get("messages")
        )
        reply = worker.add_request(request)
        if isinstance(reply, EncodeJob):  # a long prompt: encoded here, where the process hands it to a thread
            ids = worker.tokenizer.encode_releasing_gil(reply.text, reply.add_special_tokens)
            reply = worker.finish_encoding(rid, ids)
        if isinstance(reply, TokenizedRequest):
            router.route(rid, reply.prompt_token_ids)
            live.append(rid)
    cancel_after = rng.randint(1, 8) if rng.random() < CANCEL_FRACTION else body["max_tokens"]
    for step in range(1, min(cancel_after, body["max_tokens"]) + 1):
        if not live:
            break
        ends = {rid: "length" for rid in live} if step == body["max_tokens"] else {}
        tokens = [rng.randrange(worker.tokenizer.vocab_size) for _ in live]
        outputs, _ = worker.process_tokens(TokenBatch(time.time(), list(live), tokens, ends))
        for rid in outputs.finish_reasons:  # the length, or a stop string
            router.release(rid)
            live.remove(rid)
    for rid in live:  # the client went away
        worker.drop(rid)
        router.release(rid)
    return body.get("n", 1)


def main(argv: list[str] | None = None) -> list[dict]:
    args = parse_args(argv)
    worker = TokenizerWorker(Tokenizer.load(args.model))
    router = ReplicaRouter(args.replicas, args.block_size)
    rng = random.Random(args.seed)
    samples = [{"requests": 0, "rss_mib": rss_mib(), "tracked": 0, "remembered_blocks": 0}]
    print(f"{0:>8} requests: RSS {samples[0]['rss_mib']:.1f} MiB (tokenizer loaded)", flush=True)
    rid = 0
    for i in range(1, args.requests + 1):
        rid += serve_one(worker, router, rng, rid)
        if i % args.every == 0:
            remembered = sum(router.remembered_blocks(r) for r in range(args.replicas))
            samples.append(
                {"requests": i, "rss_mib": rss_mib(), "tracked": len(worker.requests), "remembered_blocks": remembered}
            )
            print(
                f"{i:>8} requests: RSS {samples[-1]['rss_mib']:.1f} MiB, {len(worker.requests)} tracked, "
                f"{remembered} prefix hashes remembered",
                flush=True,
            )
    return samples


if __name__ == "__main__":
    main()
