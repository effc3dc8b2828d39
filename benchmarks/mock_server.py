"""A stand-in for the server that answers POST /generate as fast as it can write: the load generator's ceiling.

    python -m benchmarks.mock_server --port 8100 --processes 8
    python -m benchmarks.serve --mock-server 8 --num-requests 256 --input-len-range 64-512 --max-new-tokens 256

Each streamed request gets `max_tokens` NDJSON lines of one token each (the shape of the real /generate,
one write per line: the client's worst case, since the real server puts several outputs in one write when
it falls behind), then the summary line. Several processes share the port (SO_REUSEPORT), so the mock
is not the limit; what `benchmarks.serve` measures against it is what its client processes can take in.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import signal
import sys
import time

from aiohttp import web

MODEL = "mock"
TOKEN_ID = 42


async def generate(request: web.Request) -> web.StreamResponse:
    arrival = time.time()
    body = await request.json()
    max_tokens = int(body.get("sampling_params", {}).get("max_tokens") or 16)
    prompt_tokens = len(body.get("input_ids") or []) or len(body.get("prompt", "").split())
    response = web.StreamResponse(headers={"Content-Type": "application/x-ndjson"})
    await response.prepare(request)
    for i in range(max_tokens):
        now = time.time()
        finish = "length" if i == max_tokens - 1 else None
        line = {
            "token_ids": [TOKEN_ID],
            "text": " x",
            "sampled_time": now,
            "detokenized_time": now,
            "streamed_time": now,
            "finish_reason": finish,
        }
        await response.write(json.dumps(line, separators=(",", ":")).encode() + b"\n")
    times = {"arrival": arrival, "tokenized": arrival, "queued": arrival, "first_scheduled": arrival}
    summary = {
        "rid": 0,
        "prompt_tokens": prompt_tokens,
        "num_cached_tokens": 0,
        "completion_tokens": max_tokens,
        "finish_reason": "length",
        "times": times,
    }
    await response.write(json.dumps(summary).encode() + b"\n")
    await response.write_eof()
    return response


async def health(_: web.Request) -> web.Response:
    return web.json_response({"status": "ok"})


async def models(_: web.Request) -> web.Response:
    return web.json_response({"object": "list", "data": [{"id": MODEL, "object": "model"}]})


async def stats(_: web.Request) -> web.Response:
    return web.json_response({"replies": {}, "silent": []})


def serve(host: str, port: int) -> None:
    app = web.Application()
    app.add_routes(
        [web.post("/generate", generate), web.get("/health", health), web.get("/v1/models", models)]
        + [web.get("/stats", stats)]
    )
    try:
        import uvloop

        loop_factory = uvloop.new_event_loop
    except ImportError:
        loop_factory = None
    web.run_app(
        app, host=host, port=port, reuse_port=True, print=None, access_log=None, loop=loop_factory and loop_factory()
    )


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8100)
    parser.add_argument("--processes", type=int, default=4)
    args = parser.parse_args(argv)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))  # so the children are stopped below
    spawn = mp.get_context("spawn")
    children = [spawn.Process(target=serve, args=(args.host, args.port)) for _ in range(args.processes)]
    for child in children:
        child.start()
    print(f"mock server ready on http://{args.host}:{args.port} ({args.processes} processes)", flush=True)
    try:
        for child in children:
            child.join()
    except KeyboardInterrupt:
        pass
    finally:
        for child in children:
            child.terminate()
            child.join()


if __name__ == "__main__":
    main()
