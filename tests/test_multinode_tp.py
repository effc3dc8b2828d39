"""Tensor parallelism across nodes, on one CPU: two launchers as two nodes over loopback TCP (--nnodes 2, one
rank each: TP=2) give exactly the tokens one rank gives (float32, tiny Llama); a headless node started first
waits for the server; either node's death stops the other, non-zero, naming it, with nothing left running; node
flags that do not fit fail at once, exit 2, naming the flag."""

from __future__ import annotations

import signal
from pathlib import Path

import pytest

from common.sampling_params import SamplingParams
from launch import parse_args
from offline import LLM
from tests.server_process import LauncherProcess, ServerProcess, free_port, pid_alive, wait_until
from tests.tiny_models import random_prompts

NEW_TOKENS = 12
START_TIMEOUT_S = 180
ENGINE_FLAGS = ["--device", "cpu", "--dtype", "float32", "--num-kv-blocks", "64", "--watchdog-timeout", "5"]


class HeadlessNode(LauncherProcess):
    """`python launch.py MODEL --headless --node-rank 1 ...`: node 1 of two, one tensor-parallel rank."""

    def __init__(self, model: Path, master_port: int, log_path: Path):
        args = [str(model), *ENGINE_FLAGS, *node_flags(master_port), "--headless", "--node-rank", "1"]
        super().__init__(args, log_path)

    def wait_for(self, text: str) -> None:
        self.wait_for_line(text, START_TIMEOUT_S)
        assert text in self.log(), self.log()


def node_flags(master_port: int) -> list[str]:
    return ["-tp", "2", "--nnodes", "2", "--master-addr", "127.0.0.1", "--master-port", str(master_port)]


def start_two_nodes(model: Path, log_dir: Path) -> tuple[ServerProcess, HeadlessNode]:
    """The headless node first: it waits for node 0, which is ready once both nodes' ranks have joined."""
    port = free_port()
    headless = HeadlessNode(model, port, log_dir / "node1.log")
    headless.wait_for("joining node 0")
    flags = [*ENGINE_FLAGS, *node_flags(port), "--tokenizer-workers", "1"]
    server = ServerProcess(model, *flags, log_path=log_dir / "node0.log")
    headless.wait_for("clearserve node 1 ready")
    return server, headless


@pytest.fixture(scope="module")
def two_nodes(tiny_llama, tmp_path_factory):
    """Node 0 (the server) and node 1 (headless) for the module; the last test kills node 1."""
    server, headless = start_two_nodes(tiny_llama, tmp_path_factory.mktemp("nodes"))
    yield server, headless
    headless.stop()
    server.stop(signal.SIGKILL)


def test_two_nodes_of_one_rank_match_one_rank_token_for_token(two_nodes, tiny_llama):
    server, _ = two_nodes
    prompts = random_prompts(4, [5, 13, 17, 35], vocab=512, seed=3)
    greedy = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
    with LLM(str(tiny_llama), device="cpu", dtype="float32") as llm:
        expected = [o.token_ids for o in llm.generate(prompts, greedy)]
    with server.client() as client:
        sampling = {"max_tokens": NEW_TOKENS, "temperature": 0.0, "ignore_eos": True}
        replies = [client.post("/generate", json={"input_ids": p, "sampling_params": sampling}) for p in prompts]
    assert [reply.json()["token_ids"] for reply in replies] == expected


def test_killing_the_headless_node_stops_the_server_naming_it(two_nodes):
    server, headless = two_nodes
    pids = [*server.child_pids().values(), *headless.child_pids()]
    headless.proc.kill()  # its ranks die with it (PR_SET_PDEATHSIG)
    assert server.proc.wait(timeout=60) == 1
    assert "node 1 (tensor-parallel rank 1)" in server.log()
    wait_until(lambda: not any(pid_alive(p) for p in pids), timeout=10, what="every child of both nodes to exit")


def test_killing_the_server_stops_the_headless_node_naming_it(tiny_llama, tmp_path):
    server, headless = start_two_nodes(tiny_llama, tmp_path)
    try:
        pids = [*server.child_pids().values(), *headless.child_pids()]
        server.proc.kill()
        assert headless.proc.wait(timeout=60) not in (0, None)
        assert "lost node 0 at 127.0.0.1:" in headless.log()
        wait_until(lambda: not any(pid_alive(p) for p in pids), timeout=10, what="every child of both nodes to exit")
    finally:
        headless.stop()
        server.stop(signal.SIGKILL)


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["-tp", "2", "--nnodes", "2", "--node-rank", "2", "--headless"], "--node-rank 2 must be below --nnodes 2"),
        (["-tp", "3", "--nnodes", "2"], "--tensor-parallel-size 3 must be divisible by --nnodes 2"),
        (["-tp", "2", "--nnodes", "2", "--node-rank", "1"], "--node-rank 1 needs --headless"),
        (["-tp", "2", "--nnodes", "2", "-dp", "2"], "--data-parallel-size must be 1"),
    ],
)
def test_node_flags_that_do_not_fit_exit_2_in_one_line(flags, message, capsys):
    with pytest.raises(SystemExit) as exit:
        parse_args(flags)
    assert exit.value.code == 2
    last_line = capsys.readouterr().err.strip().splitlines()[-1]
    assert "error: " in last_line and message in last_line
