"""Data parallelism across hosts, as two launchers on this machine play two nodes over loopback TCP: the frontend
node serves replica 0 and waits for replica 1, which a headless node serves (--headless). A burst is answered in
full by both replicas; a node with another cluster secret is refused and the server serves on; a node killed
with streams open takes only its replica out (its streams end with an error event, the others run to their
end, /health, /stats and /metrics count one replica of two); a new start of it joins again and is used."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from common.cluster_secret import SECRET_ENV, ClusterSecretError, derive_curve_keys, read_cluster_secret
from common.node_messages import NodeHello
from node_link.terms import ClusterTerms
from tests.server_process import (
    ROOT,
    LauncherProcess,
    ServerProcess,
    free_port,
    open_streams,
    stream_endings,
    wait_until,
)
from tests.test_data_parallel import random_ids, stream_completion
from tests.tiny_models import build_model

SECRET = "a-test-secret-of-more-than-16-bytes"
HEARTBEAT_TIMEOUT_S = 5  # --watchdog-timeout: a node silent this long is lost
STREAMS_RUN_S = 90
KV_BLOCKS = 512
# Two servers' processes start at once (each imports torch): on a small shared CI machine that can take minutes.
NODES_START_S = 600


# ---------------------------------------------------------------- the secret and the terms, without a server


def test_every_node_derives_the_same_keys_from_the_secret_and_another_secret_other_keys():
    keys = derive_curve_keys(SECRET.encode())
    assert keys == derive_curve_keys(SECRET.encode())
    other = derive_curve_keys(b"another secret, also long enough")
    assert {keys.server_public, keys.node_public}.isdisjoint({other.server_public, other.node_public})
    assert len(keys.server_public) == len(keys.node_secret) == 40  # Z85, as zmq.curve_keypair() makes them


def test_the_secret_comes_from_the_file_else_the_environment_and_a_short_one_is_refused(tmp_path, monkeypatch):
    path = tmp_path / "secret"
    path.write_text(SECRET + "\n")
    assert read_cluster_secret(str(path)) == SECRET.encode()
    monkeypatch.setenv(SECRET_ENV, SECRET)
    assert read_cluster_secret(None) == SECRET.encode()
    monkeypatch.setenv(SECRET_ENV, "short")
    with pytest.raises(ClusterSecretError, match="at least 16 bytes"):
        read_cluster_secret(None)


def test_a_headless_node_without_a_secret_refuses_to_start_in_one_line(tiny_llama):
    env = {key: value for key, value in os.environ.items() if key != SECRET_ENV}
    done = subprocess.run(
        [sys.executable, str(ROOT / "launch.py"), "--model", str(tiny_llama), "-dp", "2", "-dpr", "1", "--headless"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 2
    lines = done.stderr.strip().splitlines()
    assert (
        len(lines) == 1
        and "needs a shared secret: --cluster-secret-file FILE or $CLEARSERVE_CLUSTER_SECRET" in lines[0]
    )


def test_a_node_is_refused_unless_it_serves_the_same_model_in_the_same_blocks_and_replicas_left_to_it():
    terms = ClusterTerms("llama, vocabulary 512, context 8192", 16, 2, 1, (1,))
    hello = NodeHello("node", "1", [1], "llama, vocabulary 512, context 8192", 16, 2, 1)
    assert terms.refusal(hello) is None
    assert "--block-size is 32" in (terms.refusal(NodeHello("n", "1", [1], hello.model, 32, 2, 1)) or "")
    assert "serves 'gpt2" in (
        terms.refusal(NodeHello("n", "1", [1], "gpt2, vocabulary 512, context 8192", 16, 2, 1)) or ""
    )
    assert "offers replicas [0]" in (terms.refusal(NodeHello("n", "1", [0], hello.model, 16, 2, 1)) or "")


# ---------------------------------------------------------------- two nodes


class HeadlessNode(LauncherProcess):
    """`python launch.py --headless` serving replicas from `start_rank`, joined to the frontend node at `rpc_port`."""

    def __init__(self, model: Path, rpc_port: int, secret_file: Path, log_path: Path, start_rank: int = 1):
        args = [
            "--model",
            str(model),
            "--device",
            "cpu",
            "-dp",
            "2",
            "--data-parallel-start-rank",
            str(start_rank),
            "--data-parallel-rpc-port",
            str(rpc_port),
            "--cluster-secret-file",
            str(secret_file),
            "--headless",
            "--num-kv-blocks",
            str(KV_BLOCKS),
            "--watchdog-timeout",
            str(HEARTBEAT_TIMEOUT_S),
        ]
        super().__init__(args, log_path)

    def wait_ready(self) -> None:
        self.wait_for_line("headless node ready", NODES_START_S)
        assert self.proc.poll() is None, self.log()

    def stop(self, sig: int = signal.SIGTERM, timeout_s: float = 30) -> int:
        return super().stop(sig, timeout_s)


@pytest.fixture(scope="module")
def long_llama(tmp_path_factory):
    return build_model("llama", tmp_path_factory.mktemp("long-llama"), max_position_embeddings=8192)


@pytest.fixture(scope="module")
def nodes(long_llama, tmp_path_factory):
    """The frontend node (replica 0, tokenizer workers, the HTTP frontend) and a headless node (replica 1), each
    started at once: the headless node waits for the frontend node to welcome it."""
    logs = tmp_path_factory.mktemp("logs")
    secret_file = logs / "secret"
    secret_file.write_text(SECRET)
    rpc_port = free_port()
    node = HeadlessNode(long_llama, rpc_port, secret_file, logs / "node.log")
    head = ServerProcess(
        long_llama,
        "-dp",
        "2",
        "--data-parallel-size-local",
        "1",
        "--data-parallel-rpc-port",
        str(rpc_port),
        "--cluster-secret-file",
        str(secret_file),
        "--num-kv-blocks",
        str(KV_BLOCKS),
        "--watchdog-timeout",
        str(HEARTBEAT_TIMEOUT_S),
        "--tokenizer-workers",
        "1",
        log_path=logs / "head.log",
        start_timeout_s=NODES_START_S,
    )
    cluster = Cluster(head, node, long_llama, rpc_port, secret_file, logs)
    yield cluster
    cluster.node.stop()
    head.stop()


class Cluster:
    def __init__(self, head: ServerProcess, node: HeadlessNode, model: Path, rpc_port: int, secret: Path, logs: Path):
        self.head, self.node, self.model, self.rpc_port, self.secret, self.logs = (
            head,
            node,
            model,
            rpc_port,
            secret,
            logs,
        )

    def joins(self) -> int:
        return self.head.log().count("engine replica 1 joined")

    def admitted(self) -> dict[str, int]:
        replies = self.head.stats()
        return {role: replies[role]["payload"]["prompt_tokens_admitted"] for role in ("scheduler-0", "scheduler-1")}


def test_the_headless_nodes_replica_joins_and_every_process_of_both_nodes_answers(nodes):
    nodes.node.wait_ready()
    wait_until(lambda: nodes.joins() == 1, timeout=30, what="replica 1 to join", interval=0.2)
    with nodes.head.client() as c:
        assert c.get("/health").json() == {"status": "ok"}
        stats = c.get("/stats").json()
        metrics = c.get("/metrics").text
    assert {"scheduler-0", "scheduler-1", "gpu_worker-0", "gpu_worker-1", "node_link"} <= set(stats["replies"])
    assert stats["engine_replicas"] == {"total": 2, "alive": 2, "failed": {}}
    assert "clearserve_engine_replicas_alive 2.0" in metrics
    assert f"clearserve_kv_blocks_total {2 * KV_BLOCKS:.1f}" in metrics  # the remote scheduler's, summed in


def test_a_burst_of_64_streams_is_answered_in_full_by_both_nodes_replicas(nodes):
    rng = random.Random(0)
    prompts = [random_ids(rng, rng.randrange(8, 80)) for _ in range(64)]
    before = nodes.admitted()
    with ThreadPoolExecutor(64) as pool, httpx.Client(limits=httpx.Limits(max_connections=64)) as client:
        results = list(pool.map(lambda p: stream_completion(nodes.head, p, 12, client), prompts))
    assert [events[-2]["choices"][0]["finish_reason"] for events in results] == ["length"] * 64
    assert all(events[-1] == "[DONE]" for events in results)
    after = nodes.admitted()
    assert all(after[role] > before[role] for role in after), (before, after)  # both replicas served part of it


def test_a_node_with_another_secret_is_refused_and_the_server_serves_on(nodes):
    other = nodes.logs / "other-secret"
    other.write_text("another secret, as long as the first one")
    stranger = HeadlessNode(nodes.model, nodes.rpc_port, other, nodes.logs / "stranger.log")
    assert stranger.proc.wait(NODES_START_S) == 2
    assert "refused this node's key" in stranger.log()
    stranger.stop()
    assert "refused a connection: its CurveZMQ handshake failed" in nodes.head.log()
    assert stream_completion(nodes.head, [5, 6, 7], 4)[-2]["choices"][0]["finish_reason"] == "length"
    with nodes.head.client() as c:
        assert c.get("/health").json() == {"status": "ok"}


def test_a_node_killed_mid_stream_ends_its_streams_with_an_error_and_the_other_serves_on(nodes):
    def running() -> list[int]:
        replies = nodes.head.stats()
        return [replies[role]["payload"]["num_running"] for role in ("scheduler-0", "scheduler-1")]

    futures = open_streams(nodes.head, 4, max_tokens=2000)
    wait_until(lambda: all(n >= 1 for n in running()), timeout=30, what="streams running on both replicas")
    tokenizers = [r["payload"] for role, r in nodes.head.stats().items() if role.startswith("tokenizer-")]
    on_replica_1 = sum(t["replicas_in_flight"][1] for t in tokenizers)
    nodes.node.stop(signal.SIGKILL)  # its processes die with it (PR_SET_PDEATHSIG): no goodbye, only silence
    endings = stream_endings(futures, STREAMS_RUN_S)
    assert on_replica_1 >= 1
    assert sorted(endings) == ["error replica_failed"] * on_replica_1 + ["length"] * (4 - on_replica_1)
    assert (
        "sent no heartbeat for" in nodes.head.log()
        and "engine replica 1 is out, 1 of 2 still serve" in nodes.head.log()
    )
    assert nodes.head.proc.poll() is None

    assert stream_completion(nodes.head, [9, 8, 7], 4)[-2]["choices"][0]["finish_reason"] == "length"
    with nodes.head.client() as c:
        health = c.get("/health")
        metrics = c.get("/metrics").text
        stats = c.get("/stats").json()
    assert health.status_code == 200
    assert health.json() == {"status": "degraded", "engine_replicas": 2, "engine_replicas_alive": 1}
    assert "clearserve_engine_replicas_alive 1.0" in metrics
    assert stats["engine_replicas"]["alive"] == 1 and "heartbeat" in stats["engine_replicas"]["failed"]["1"]
    assert stats["silent"] == [] and "scheduler-1" not in stats["replies"]


def test_a_restarted_headless_node_joins_again_and_is_used(nodes):
    nodes.node = HeadlessNode(nodes.model, nodes.rpc_port, nodes.secret, nodes.logs / "node-again.log")
    nodes.node.wait_ready()
    wait_until(lambda: nodes.joins() == 2, timeout=30, what="replica 1 to join again", interval=0.2)
    with nodes.head.client() as c:
        assert c.get("/health").json() == {"status": "ok"}
    before = nodes.admitted()
    rng = random.Random(1)
    with ThreadPoolExecutor(16) as pool, httpx.Client(limits=httpx.Limits(max_connections=16)) as client:
        results = list(
            pool.map(lambda p: stream_completion(nodes.head, p, 4, client), [random_ids(rng, 20) for _ in range(16)])
        )
    assert all(events[-2]["choices"][0]["finish_reason"] == "length" for events in results)
    assert nodes.admitted()["scheduler-1"] > before["scheduler-1"]
