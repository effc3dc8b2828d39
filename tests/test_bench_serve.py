"""`python -m benchmarks.serve` end to end: it launches a real server on a tiny model, streams a few
requests through /generate, and writes the per-request JSON and the PNG plots; --compare reads them back."""

from __future__ import annotations

import json

import pytest

from benchmarks import serve

NUM_REQUESTS = 6
NEW_TOKENS = 5


@pytest.fixture(scope="module")
def run(tiny_llama, tmp_path_factory):
    out = tmp_path_factory.mktemp("bench")
    result = serve.main(
        [
            "--launch",
            f"--model {tiny_llama} --device cpu --num-kv-blocks 128 --tokenizer-workers 1",
            "--num-requests",
            str(NUM_REQUESTS),
            "--prompt",
            "Hello ",
            "--prompt-repeats",
            "1,4",
            "--unique-prompts",
            "--max-new-tokens",
            str(NEW_TOKENS),
            "--no-stop-on-eos",
            "--max-concurrency",
            "4",
            "--output-json",
            str(out / "run.json"),
            "--plot-dir",
            str(out / "plots"),
            "--label",
            "tiny",
            "--bursts",
            "2",
        ]
    )
    return result, out


def test_the_json_holds_every_request_with_its_stage_and_token_times(run):
    _, out = run
    saved = json.loads((out / "run.json").read_text())
    assert saved["command"].startswith("python -m benchmarks.serve --launch")
    requests = saved["requests"]
    assert [r["index"] for r in requests] == list(range(NUM_REQUESTS))
    for r in requests:
        assert r["error"] is None
        assert r["completion_tokens"] == NEW_TOKENS and r["finish_reason"] == "length"
        assert len(r["token_streamed"]) == len(r["token_sampled"]) == NEW_TOKENS
        assert r["submit"] < r["arrival"] <= r["tokenized"] <= r["queued"] <= r["first_scheduled"]
        assert r["first_scheduled"] < r["token_sampled"][0] <= r["token_streamed"][0] <= r["finished"]
        assert set(r["latencies_s"]) >= {
            "submit_latency",
            "tokenize",
            "queue_wait",
            "prefill_to_first_token",
            "ttft",
            "tpot",
            "e2e",
        }
        assert len(r["itl_s"]) == NEW_TOKENS - 1


def test_the_summary_counts_every_request_and_token(run):
    result, _ = run
    s = result["summary"]
    assert (s["completed"], s["failed"]) == (NUM_REQUESTS, 0)
    assert s["completion_tokens"] == NUM_REQUESTS * NEW_TOKENS
    assert s["latencies_ms"]["ttft"]["count"] == NUM_REQUESTS
    assert s["latencies_ms"]["itl"]["count"] == NUM_REQUESTS * (NEW_TOKENS - 1)
    assert s["completion_throughput"] > 0


def test_the_server_view_covers_the_run_and_not_the_warm_up(run):
    result, _ = run
    view = result["server"]
    # Greedy with EOS ignored: every token is sampled exactly once and nothing is preempted.
    assert view["generated_tokens"] >= NUM_REQUESTS * NEW_TOKENS
    assert view["prompt_tokens_admitted"] == result["summary"]["prompt_tokens"]
    assert view["preemptions"] == 0
    assert view["cache_hit_tokens"] == 0  # unique prompts share no block


def test_every_server_process_reports_its_cpu_per_completion_token(run, capsys):
    result, _ = run
    processes = result["processes"]
    assert {"frontend-0", "tokenizer-0", "scheduler", "gpu_worker"} <= set(processes)
    tokens = result["summary"]["completion_tokens"]
    for role, p in processes.items():
        assert p["cpu_s"] >= 0, role
        assert p["cpu_us_per_token"] == pytest.approx(1e6 * p["cpu_s"] / tokens), role
    assert sum(p["cpu_s"] for p in processes.values()) > 0, "serving the run took some CPU somewhere"
    assert len(result["load_average"]) == 2


def test_a_process_of_another_role_or_machine_has_no_cpu_reading():
    import os

    from benchmarks.process_cpu import process_cpu_s

    own = process_cpu_s(os.getpid(), "not-this-process")
    assert own is None, "a pid whose name is not the role's is someone else's"
    assert process_cpu_s(2**22 + 1, "scheduler") is None  # no such pid here


def test_the_plots_are_written(run):
    _, out = run
    for name in ("latency_cdf.png", "tokens_over_time.png"):
        png = (out / "plots" / name).read_bytes()
        assert png.startswith(b"\x89PNG") and len(png) > 1000


def test_compare_prints_two_runs_side_by_side_with_ratios(run, capsys):
    _, out = run
    serve.main(["--compare", str(out / "run.json"), str(out / "run.json")])
    lines = capsys.readouterr().out.splitlines()
    ttft = next(line for line in lines if line.startswith("TTFT p50"))
    assert ttft.split()[-1] == "1.00"


def test_a_repeated_burst_is_reported_apart_from_the_first(run):
    result, _ = run
    assert result["summary"]["completed"] == NUM_REQUESTS, "the first burst is the run's own figures"
    [repeat] = result["repeats"]
    assert repeat["round"] == 1
    assert repeat["summary"]["completed"] == NUM_REQUESTS
    assert repeat["summary"]["completion_tokens"] == NUM_REQUESTS * NEW_TOKENS


def test_each_repeated_burst_has_prompts_of_its_own(tiny_llama):
    texts = serve.parse_args(["--num-requests", "3", "--prompt", "Hi", "--unique-prompts"])
    ids = serve.parse_args(["--model", str(tiny_llama), "--num-requests", "3", "--input-len-range", "5-9"])
    for args in (texts, ids):
        first, again = serve.build_workload(args), serve.build_workload(args, round_index=1)
        assert len(again) == len(first)
        assert not {(r.prompt, str(r.input_ids)) for r in first} & {(r.prompt, str(r.input_ids)) for r in again}


def test_random_id_workload_draws_seeded_lengths_from_the_models_vocabulary(tiny_llama):
    argv = [
        "--model",
        str(tiny_llama),
        "--num-requests",
        "40",
        "--input-len-range",
        "5-9",
        "--output-len-range",
        "2-4",
        "--seed",
        "3",
    ]
    workload = serve.build_workload(serve.parse_args(argv))
    assert workload == serve.build_workload(serve.parse_args(argv))
    vocab = json.loads((tiny_llama / "config.json").read_text())["vocab_size"]
    assert all(5 <= len(r.input_ids) <= 9 and r.prompt is None for r in workload)
    assert all(0 < t < vocab for r in workload for t in r.input_ids)  # 0 is the tiny model's EOS
    assert {r.max_tokens for r in workload} == {2, 3, 4}


def test_prompts_file_workload_cycles_the_file_and_keeps_each_prompts_max_tokens(tmp_path):
    path = tmp_path / "prompts.json"
    path.write_text(json.dumps(["a", {"prompt": "b", "max_tokens": 3}]))
    workload = serve.build_workload(
        serve.parse_args(["--prompts-file", str(path), "--num-requests", "4", "--max-new-tokens", "9"])
    )
    assert [(r.prompt, r.max_tokens) for r in workload] == [("a", 9), ("b", 3), ("a", 9), ("b", 3)]


def test_a_timed_prompts_file_sets_each_requests_send_time_and_refuses_other_arrivals(tmp_path):
    path = tmp_path / "prompts.json"
    path.write_text(json.dumps([{"prompt": "a", "at_ms": 0}, {"prompt": "b", "at_ms": 250}]))
    args = ["--prompts-file", str(path), "--num-requests", "2"]
    assert [r.send_at_s for r in serve.build_workload(serve.parse_args(args))] == [0.0, 0.25]
    for other in (["--submit-interval-ms", "20"], ["--num-requests", "3"]):
        with pytest.raises(ValueError, match="at_ms"):
            serve.build_workload(serve.parse_args(args + other))
