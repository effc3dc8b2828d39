"""Tensor parallelism on the CPU (gloo; NCCL where two GPUs are visible): two ranks give exactly the tokens
one gives (float32, tiny GPT-2, tiny grouped-query Llama and every other family), in process and through the
server; a model whose heads do not split fails at start naming the numbers; a dead rank stops the server,
naming it, with nothing left running."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import httpx
import pytest
import torch

from common.model_info import TensorParallelError
from common.sampling_params import SamplingParams
from gpu_worker.model_loader import load_model
from gpu_worker.parallel import TensorParallel
from offline import LLM
from tests.server_process import ROOT, ServerProcess, pid_alive, wait_until
from tests.tiny_models import random_prompts

NEW_TOKENS = 12
TEXT_PROMPTS = ["def main():", "import json\n", "The quick", "class Foo"]


def sampling() -> list[SamplingParams]:
    """Greedy, and seeded draws: every rank samples, so their draws must agree too."""
    greedy = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
    drawn = [SamplingParams(max_tokens=NEW_TOKENS, temperature=0.9, top_p=0.9, seed=s, ignore_eos=True) for s in (1, 2)]
    return [greedy, greedy, *drawn]


def generate(folder, tensor_parallel_size: int, prompts, device: str = "cpu") -> list[list[int]]:
    with LLM(
        str(folder),
        device=device,
        dtype="float32",
        num_kv_blocks=64,
        max_num_seqs=8,
        max_num_batched_tokens=512,
        tensor_parallel_size=tensor_parallel_size,
    ) as llm:
        llm.record_plans = True
        outputs = llm.generate(prompts, sampling(), on_step=llm.scheduler.check_integrity)
        assert len(llm.plans_executed) > NEW_TOKENS // 2, "prefill and decode steps both ran"
    return [o.token_ids for o in outputs]


def test_two_ranks_match_one_token_for_token(tiny_model):
    prompts = random_prompts(4, [5, 13, 17, 35], vocab=512, seed=3)
    assert generate(tiny_model, 2, prompts) == generate(tiny_model, 1, prompts)


def test_two_ranks_match_one_in_every_family(tiny_family):
    """Each family's own sharded parts too: OLMo 2's q/k norms over every rank's heads (an all-reduced mean
    square), the experts split by their intermediate width (one all-reduce of every expert's share)."""
    prompts = random_prompts(4, [5, 13, 30, 35], vocab=512, seed=3)
    assert generate(tiny_family, 2, prompts) == generate(tiny_family, 1, prompts)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")
def test_two_gpus_match_one_token_for_token(tiny_model):
    """NCCL, every step replaying a CUDA graph that holds the all-reduces (decodes and prompt steps alike)."""
    prompts = random_prompts(4, [5, 13, 17, 35], vocab=512, seed=3)
    assert generate(tiny_model, 2, prompts, "cuda") == generate(tiny_model, 1, prompts, "cuda")


def record_terminations(monkeypatch) -> list[str]:
    import multiprocessing.context

    terminated: list[str] = []
    real_terminate = multiprocessing.context.SpawnProcess.terminate
    monkeypatch.setattr(
        multiprocessing.context.SpawnProcess, "terminate", lambda p: terminated.append(p.name) or real_terminate(p)
    )
    return terminated


def test_closing_the_engine_lets_every_rank_leave_the_group_together(tiny_gpt2, monkeypatch):
    """NCCL's teardown waits for every rank: the followers must leave the group themselves, not be killed
    while rank 0 waits for them. They exit on their own, and a second engine can form a new group."""
    terminated = record_terminations(monkeypatch)
    prompts = random_prompts(2, [5, 9], vocab=512, seed=4)
    first = generate(tiny_gpt2, 2, prompts)
    assert terminated == []
    assert not torch.distributed.is_initialized()
    assert generate(tiny_gpt2, 2, prompts) == first


def test_an_error_in_the_engine_block_stops_the_followers_instead(tiny_gpt2, monkeypatch):
    """After an error a step may have stopped halfway, its collectives launched on some ranks only: leaving
    together could never complete, so the followers are stopped (and gloo's group left by rank 0 alone)."""
    terminated = record_terminations(monkeypatch)
    engine = dict(device="cpu", dtype="float32", num_kv_blocks=64, tensor_parallel_size=2)
    with pytest.raises(RuntimeError, match="a user's error"), LLM(str(tiny_gpt2), **engine):
        raise RuntimeError("a user's error")
    assert terminated == ["gpu_worker-rank1"]
    assert not torch.distributed.is_initialized()


def unshard(shards: list, parts: list[int]):
    """Rank tensors [part0_r | part1_r | ...] (rows) back into the whole [part0 | part1 | ...]."""
    splits = [shard.split([p // len(shards) for p in parts]) for shard in shards]
    return torch.cat([torch.cat([split[i] for split in splits]) for i in range(len(parts))])


@pytest.mark.parametrize("load_format", ["auto", "dummy"])
def test_each_rank_holds_its_slice_of_the_same_model(tiny_llama, load_format):
    """Checkpoint and dummy weights alike (dummy ones are drawn whole, then split): no process group needed."""

    def params(rank: int, size: int) -> dict:
        model = load_model(
            str(tiny_llama), load_format, torch.float32, torch.device("cpu"), tp=TensorParallel(rank, size)
        )
        return dict(model.named_parameters())

    whole, ranks = params(0, 1), [params(0, 2), params(1, 2)]
    layer = "layers.1."
    q, kv, inter = 64, 32, 128  # 4 heads and 2 KV heads of 16; intermediate_size
    qkv, gate_up = layer + "self_attn.qkv_proj.weight", layer + "mlp.gate_up_proj.weight"
    assert torch.equal(unshard([r[qkv] for r in ranks], [q, kv, kv]), whole[qkv])
    assert torch.equal(unshard([r[gate_up] for r in ranks], [inter, inter]), whole[gate_up])
    for name in (layer + "self_attn.o_proj.weight", layer + "mlp.down_proj.weight"):
        assert torch.equal(torch.cat([r[name] for r in ranks], dim=1), whole[name])
    for name in ("embed_tokens.weight", "lm_head.weight"):
        assert torch.equal(torch.cat([r[name] for r in ranks])[:512], whole[name][:512])
    assert torch.equal(ranks[1]["norm.weight"], whole["norm.weight"])


@pytest.mark.parametrize(
    ("model", "ranks", "message"),
    [
        ("tiny_gpt2", 3, "--tensor-parallel-size 3 does not divide the model's 4 attention heads"),
        ("tiny_llama", 4, "--tensor-parallel-size 4 does not divide the model's 2 KV heads"),
    ],
)
def test_heads_that_do_not_divide_fail_at_start_naming_the_numbers(request, model, ranks, message):
    with pytest.raises(TensorParallelError, match=message):
        LLM(str(request.getfixturevalue(model)), device="cpu", tensor_parallel_size=ranks)


def test_the_server_refuses_heads_that_do_not_divide_before_starting_a_rank(tiny_gpt2):
    cmd = [sys.executable, str(ROOT / "launch.py"), "--model", str(tiny_gpt2), "--device", "cpu", "--port", "0"]
    done = subprocess.run([*cmd, "-tp", "3"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2
    assert "--tensor-parallel-size 3 does not divide the model's 4 attention heads" in done.stderr
    assert "starting" not in done.stderr


@pytest.fixture(scope="module")
def server(tiny_llama, tmp_path_factory):
    """One two-rank server for the module; the last test kills one of its ranks."""
    srv = ServerProcess(
        tiny_llama,
        "--tensor-parallel-size",
        "2",
        "--num-kv-blocks",
        "64",
        "--dtype",
        "float32",
        "--watchdog-timeout",
        "5",
        "--tokenizer-workers",
        "1",
        log_path=tmp_path_factory.mktemp("log") / "server.log",
    )
    yield srv
    srv.stop(signal.SIGKILL)


def test_the_server_with_two_ranks_matches_one_rank_in_process(server, tiny_llama):
    with LLM(str(tiny_llama), device="cpu", dtype="float32") as llm:
        expected = [o.text for o in llm.generate(TEXT_PROMPTS, sampling())]
    got = []
    with server.client() as client:
        for prompt, params in zip(TEXT_PROMPTS, sampling()):
            body = {
                "prompt": prompt,
                "max_tokens": NEW_TOKENS,
                "temperature": params.temperature,
                "top_p": params.top_p,
                "seed": params.seed,
                "ignore_eos": True,
            }
            response = client.post("/v1/completions", json=body)
            assert response.status_code == 200, response.text
            got.append(response.json()["choices"][0]["text"])
    assert got == expected


def test_a_killed_rank_stops_the_server_naming_it_and_nothing_is_left(server):
    pids = server.child_pids()
    assert {"gpu_worker", "gpu_worker-rank1"} <= set(pids)
    os.kill(pids["gpu_worker-rank1"], signal.SIGKILL)
    assert server.proc.wait(timeout=30) == 1
    assert "process gpu_worker-rank1" in server.log()
    wait_until(lambda: not any(pid_alive(p) for p in pids.values()), timeout=10, what="every child to exit")
    with pytest.raises(httpx.TransportError):
        httpx.get(f"{server.url}/health", timeout=2)
