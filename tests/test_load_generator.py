"""The serving benchmark's own parts: client processes that share a workload and report their CPU, the mock
server that measures the client's ceiling, and the null engine that measures the serving path's."""

from __future__ import annotations

import pytest

from benchmarks.load_client import run_clients
from benchmarks.serve import LaunchedServer
from benchmarks.workloads import WorkloadRequest
from common.config import EngineConfig
from common.messages import NewRequestSpec, ScheduledChunk, StepPlan
from common.model_info import ModelInfo
from common.sampling_params import SamplingParams
from gpu_worker.null_runner import NullRunner


@pytest.fixture(scope="module")
def mock_url(tmp_path_factory):
    log = tmp_path_factory.mktemp("mock") / "mock.log"
    with LaunchedServer("--processes 2", str(log), program=["-m", "benchmarks.mock_server"]) as server:
        yield server.url


def test_two_client_processes_share_the_workload_and_return_every_request_in_order(mock_url):
    workload = [WorkloadRequest(3 + i % 4, prompt=f"p{i}") for i in range(10)]
    timings, usage = run_clients(mock_url, workload, [0.0] * 10, {"temperature": 0.0}, {}, processes=2)
    assert [t.completion_tokens for t in timings] == [w.max_tokens for w in workload]
    assert all(t.error is None and len(t.token_streamed) == t.completion_tokens for t in timings)
    assert usage.processes == 2 and len(usage.cpu_s) == len(usage.peak_cpu_pct) == 2
    assert all(0 < c <= w for c, w in zip(usage.cpu_s, usage.wall_s))


def test_requests_are_sent_on_their_schedule(mock_url):
    offsets = [0.0, 0.0, 0.3, 0.3]
    workload = [WorkloadRequest(2, prompt="x") for _ in offsets]
    timings, _ = run_clients(mock_url, workload, offsets, {}, {}, processes=2)
    start = min(t.submit for t in timings)
    assert [t.submit - start >= offset - 0.01 for t, offset in zip(timings, offsets)] == [True] * 4
    assert timings[2].submit - start < 0.3 + 0.25  # and not much later


def test_the_null_engine_answers_every_sampling_chunk_with_a_token_that_is_never_eos(tiny_gpt2):
    info = ModelInfo.from_folder(tiny_gpt2)
    runner = NullRunner(EngineConfig(num_kv_blocks=64), info)
    plan = StepPlan.of(
        1,
        [NewRequestSpec(5, [1, 2, 3], SamplingParams(), 0), NewRequestSpec(6, [4, 5], SamplingParams(), 0)],
        [ScheduledChunk(5, 0, 3, [0], True), ScheduledChunk(6, 0, 1, [1], False)],
        [],
    )
    result = runner.finish(runner.launch(plan))
    assert result.rids == [5] and len(result.token_ids) == 1
    assert runner.limits.num_kv_blocks == 64
    eos = set(info.eos_token_ids)
    assert not eos & {runner.token_at(rid, pos) for rid in range(50) for pos in range(50)}
