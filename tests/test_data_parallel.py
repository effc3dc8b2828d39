"""--data-parallel-size 2 through the real server: two engine replicas (a scheduler and a GPU worker each)
behind one frontend and two tokenizer workers. A burst is answered in full and leaves both replicas' block
accounting whole, greedy outputs are those of the single in-process engine, and requests that share a long
prefix stay on the replica that cached it; last, a replica's GPU worker killed with streams open on both
replicas takes that replica out: its streams end with an error event, the other replica's run to their end,
new requests are served by it, and /health, /stats and /metrics say one replica of two serves. (A silent
replica, and --exit-on-replica-failure: tests/test_fault_injection.py.)"""

from __future__ import annotations

import json
import os
import random
import signal
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack

import httpx
import pytest

from common.sampling_params import SamplingParams
from offline import LLM
from tests.server_process import (
    ServerProcess,
    assert_nothing_left,
    open_streams,
    pid_alive,
    stream_endings,
    wait_until,
)
from tests.tiny_models import build_model

REPLICAS = ("scheduler-0", "scheduler-1")
BLOCK_SIZE = 16
KV_BLOCKS = 512
VOCAB = 500  # below the tiny tokenizer's 512 ids
LONG = 6000  # tokens of a request that keeps a replica busy for seconds (the tiny model makes a token in ~1 ms)
STREAMS_RUN_S = 60  # the longest the faulted streams may take to end: those of the surviving replica run on


@pytest.fixture(scope="module")
def long_llama(tmp_path_factory):
    """The tiny Llama with room for requests long enough to still be running when the next ones are routed."""
    return build_model("llama", tmp_path_factory.mktemp("long-llama"), max_position_embeddings=8192)


@pytest.fixture(scope="module")
def server(long_llama, tmp_path_factory):
    srv = ServerProcess(
        long_llama,
        "--data-parallel-size",
        "2",
        "--num-kv-blocks",
        str(KV_BLOCKS),
        "--block-size",
        str(BLOCK_SIZE),
        log_path=tmp_path_factory.mktemp("log") / "server.log",
    )
    yield srv
    srv.stop()


def scheduler_stats(server: ServerProcess) -> dict[str, dict]:
    replies = server.stats()
    return {role: replies[role]["payload"] for role in REPLICAS}


def assert_every_replica_idle_with_all_blocks_back(server: ServerProcess) -> None:
    def idle() -> bool:
        return all(
            s["num_running"] == 0
            and s["num_waiting"] == 0
            and s["kv_blocks_used"] == 0
            and s["kv_blocks_free"] + s["kv_blocks_cached"] == s["kv_blocks_total"] == KV_BLOCKS
            for s in scheduler_stats(server).values()
        )

    wait_until(idle, timeout=10, what="every replica to be idle with all its blocks free or cached")
    tokenizers = {role: r["payload"] for role, r in server.stats().items() if role.startswith("tokenizer-")}
    assert all(t["replicas_in_flight"] == [0, 0] for t in tokenizers.values()), tokenizers


def random_ids(rng: random.Random, length: int) -> list[int]:
    return [rng.randrange(1, VOCAB) for _ in range(length)]


def stream_completion(
    server: ServerProcess, prompt: list[int], max_tokens: int, client: httpx.Client | None = None
) -> list:
    """`client`: one shared by the caller's threads (a client of its own costs each stream ~20 ms of CPU)."""
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, "stream": True}
    events: list = []
    with (client or httpx).stream("POST", f"{server.url}/v1/completions", json=body, timeout=120) as response:
        assert response.status_code == 200, response.read()
        for line in response.iter_lines():
            if line.startswith("data: "):
                data = line[len("data: ") :]
                events.append(data if data == "[DONE]" else json.loads(data))
    return events


def test_the_startup_line_names_both_replicas_and_every_process_answers(server):
    assert f"2 engine replicas of [{KV_BLOCKS}, {KV_BLOCKS}] KV blocks" in server.log()
    roles = set(server.child_pids())
    assert roles == {"gpu_worker-0", "gpu_worker-1", *REPLICAS, "tokenizer-0", "tokenizer-1", "frontend-0"}
    with server.client() as c:
        assert c.get("/health").json() == {"status": "ok"}
        metrics = c.get("/metrics").text
    assert f"clearserve_kv_blocks_total {2 * KV_BLOCKS:.1f}" in metrics  # the replicas' schedulers, summed


def test_a_burst_of_64_streams_is_answered_in_full_by_both_replicas_and_every_block_comes_back(server):
    rng = random.Random(0)
    prompts = [random_ids(rng, rng.randrange(8, 80)) for _ in range(64)]
    before = scheduler_stats(server)
    with ThreadPoolExecutor(64) as pool, httpx.Client(limits=httpx.Limits(max_connections=64)) as client:
        results = list(pool.map(lambda p: stream_completion(server, p, 12, client), prompts))
    for events in results:
        assert events[-1] == "[DONE]"
        assert events[-2]["choices"][0]["finish_reason"] == "length"
        assert sum(1 for e in events[:-1] if e["choices"] and e["choices"][0]["text"] is not None) >= 1
    after = scheduler_stats(server)
    admitted = {role: after[role]["prompt_tokens_admitted"] - before[role]["prompt_tokens_admitted"] for role in after}
    assert all(admitted.values()), admitted  # both replicas served part of the burst
    generated = sum(after[role]["generated_tokens"] - before[role]["generated_tokens"] for role in after)
    assert generated >= 64 * 12
    assert_every_replica_idle_with_all_blocks_back(server)


def test_greedy_outputs_equal_the_single_engines(server, long_llama):
    rng = random.Random(1)
    prompts = [random_ids(rng, rng.randrange(4, 40)) for _ in range(16)]
    single = LLM(str(long_llama), device="cpu", block_size=BLOCK_SIZE)
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    expected = [output.token_ids for output in single.generate(prompts, params)]

    with ThreadPoolExecutor(16) as pool, server.client() as c:

        def generate(prompt: list[int]) -> list[int]:
            body = {"input_ids": prompt, "sampling_params": {"max_tokens": 16, "temperature": 0, "ignore_eos": True}}
            return c.post("/generate", json=body).json()["token_ids"]

        assert list(pool.map(generate, prompts)) == expected


def test_requests_sharing_a_long_prefix_stay_on_the_replica_that_cached_it(server):
    rng = random.Random(2)
    prefix = random_ids(rng, 8 * BLOCK_SIZE)
    assert_every_replica_idle_with_all_blocks_back(server)
    before = scheduler_stats(server)
    # Four in a row: consecutive request ids, so each tokenizer worker's router sees the prefix go to replica 0
    # (both idle: the lower index).
    for i in range(4):
        stream_completion(server, [*prefix, i + 1], 2)
    # Two long requests without it, one per tokenizer worker, keep replica 0 busy (idle routers: replica 0) ...
    body = {"max_tokens": LONG, "temperature": 0, "ignore_eos": True, "stream": True}
    kept_lines = []  # each stream's line iterator, kept: a dropped one would close its connection (an abort)
    with httpx.Client(base_url=server.url, timeout=60) as c, ExitStack() as long_streams:
        for length in (20, 21):
            response = long_streams.enter_context(
                c.stream("POST", "/v1/completions", json={**body, "prompt": random_ids(rng, length)})
            )
            kept_lines.append(response.iter_lines())
            assert next(line for line in kept_lines[-1] if line.startswith("data:"))
        # ... yet the prefix's requests still go there, not to the idle replica 1.
        for i in range(4):
            stream_completion(server, [*prefix, 100 + i], 2)
        assert scheduler_stats(server)["scheduler-0"]["num_running"] == 2  # the long ones, still running
    # Closing the long streams aborted them: the aborts reached replica 0 too (every block comes back below).
    after = scheduler_stats(server)
    hits = {role: after[role]["cache_hit_tokens"] - before[role]["cache_hit_tokens"] for role in after}
    assert hits["scheduler-0"] >= 7 * len(prefix), hits
    assert after["scheduler-1"]["prompt_tokens_admitted"] == before["scheduler-1"]["prompt_tokens_admitted"]
    assert_every_replica_idle_with_all_blocks_back(server)


def tokenizer_stats(server: ServerProcess) -> list[dict]:
    return [r["payload"] for role, r in server.stats().items() if role.startswith("tokenizer-")]


# Last: it takes a replica out of the module's server, then stops the server.
def test_a_dead_replica_ends_its_streams_with_an_error_and_the_other_keeps_serving(server):
    pids = server.child_pids()
    # Four streams with consecutive request ids: each tokenizer worker routes its first to replica 0 and its
    # second, replica 0 being busier, to replica 1.
    futures = open_streams(server, 4, max_tokens=2000)
    wait_until(
        lambda: all(s["num_running"] >= 1 for s in scheduler_stats(server).values()),
        timeout=10,
        what="streams running on both replicas",
    )
    on_replica_1 = sum(t["replicas_in_flight"][1] for t in tokenizer_stats(server))
    os.kill(pids["gpu_worker-1"], signal.SIGKILL)
    endings = stream_endings(futures, STREAMS_RUN_S)
    assert sorted(endings) == ["error replica_failed"] * on_replica_1 + ["length"] * (4 - on_replica_1)
    assert on_replica_1 >= 1
    assert f"process gpu_worker-1 (pid {pids['gpu_worker-1']}) died with exit code -9" in server.log()
    assert "engine replica 1 is out, 1 of 2 still serve" in server.log()
    assert server.proc.poll() is None
    wait_until(lambda: not pid_alive(pids["scheduler-1"]), timeout=5, what="replica 1's scheduler to be stopped")

    rng = random.Random(3)
    for _ in range(4):  # each tokenizer worker routes two: both to replica 0
        assert stream_completion(server, random_ids(rng, 10), 4)[-2]["choices"][0]["finish_reason"] == "length"
    with server.client() as c:
        health = c.get("/health")
        metrics = c.get("/metrics").text
        stats = c.get("/stats").json()
    assert health.status_code == 200
    assert health.json() == {"status": "degraded", "engine_replicas": 2, "engine_replicas_alive": 1}
    assert "clearserve_engine_replicas 2.0" in metrics and "clearserve_engine_replicas_alive 1.0" in metrics
    assert f"clearserve_kv_blocks_total {KV_BLOCKS:.1f}" in metrics  # replica 0's alone
    assert stats["engine_replicas"]["alive"] == 1 and "gpu_worker-1" in stats["engine_replicas"]["failed"]["1"]
    assert stats["silent"] == [] and not {"scheduler-1", "gpu_worker-1"} & set(stats["replies"])
    assert all(t["replicas_in_flight"] == [0, 0] for t in tokenizer_stats(server))

    assert server.stop() == 0
    assert_nothing_left(server, pids)
