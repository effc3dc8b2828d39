"""benchmarks.serving_gap without a server: which servers the parallel part asks for, in which order; the sweep's
goodput verdict from its points."""

from __future__ import annotations

import json
import shlex

import pytest

import benchmarks.serving_gap as serving_gap


def launched(monkeypatch, tmp_path, *args: str) -> list[tuple[str, list[str]]]:
    runs: list[tuple[str, list[str]]] = []

    def fake_serve(label, flags, out, log, rows):
        launch = shlex.split(flags)[shlex.split(flags).index("--launch") + 1]
        runs.append((label, shlex.split(launch)))

    monkeypatch.setattr(serving_gap, "serve", fake_serve)
    serving_gap.main(["--model", str(tmp_path), "--out", str(tmp_path / "out"), "--parts", "parallel", *args])
    return runs


def test_the_parallel_part_interleaves_the_sizes_and_gives_every_replica_256_seats(monkeypatch, tmp_path):
    runs = launched(monkeypatch, tmp_path, "--repeats", "2", "--api-server-counts", "6")
    assert [label for label, _ in runs] == [
        *("w1_tp1_1", "w1_tp2_1", "burst_dp1_1", "burst_dp2_1"),
        *("w1_tp1_2", "w1_tp2_2", "burst_dp1_2", "burst_dp2_2"),
    ]
    for label, launch in runs:
        assert launch[launch.index("--api-server-count") + 1] == "6"
        if label.startswith("burst"):
            assert launch[launch.index("--max-num-seqs") + 1] == "256"
            assert launch[launch.index("-dp") + 1] == label[len("burst_dp")]
        else:
            assert launch[launch.index("-tp") + 1] == label[len("w1_tp")]


def point(rate: float, ttft_p99_ms: float, itl_p99_ms: float = 5.0, failed: int = 0) -> dict:
    return {
        "rate": rate,
        "req_s": rate,
        "tok_s": 100.0 * rate,
        "ttft_p99_ms": ttft_p99_ms,
        "itl_p99_ms": itl_p99_ms,
        "failed": failed,
    }


SLO = serving_gap.Slo(ttft_ms=200.0, itl_ms=50.0)
FAST_CLIENT = [point(r, 10.0) for r in (100, 200, 400, 800)]


def test_goodput_is_the_highest_rate_within_both_slos_with_its_throughput():
    points = [point(100, 50.0), point(200, 120.0), point(400, 150.0, itl_p99_ms=60.0), point(800, 900.0)]
    verdict = serving_gap.goodput(points, FAST_CLIENT, burst_tok_s=100_000.0, slo=SLO)
    assert verdict["goodput_req_s"] == 200 and verdict["goodput_point"]["tok_s"] == 20_000.0
    assert not verdict["client_limited"]
    assert verdict["saturation_tok_s"] == 80_000.0 and verdict["saturation_of_burst"] == 0.8


def test_a_rate_with_a_failed_request_does_not_count():
    verdict = serving_gap.goodput([point(100, 50.0), point(200, 60.0, failed=1)], FAST_CLIENT, None, SLO)
    assert verdict["goodput_req_s"] == 100


def test_a_client_that_misses_the_slos_where_the_server_did_makes_the_verdict_the_clients():
    points = [point(100, 50.0), point(200, 300.0)]
    client = [point(100, 10.0), point(200, 250.0)]
    assert serving_gap.goodput(points, client, None, SLO)["client_limited"]


def serve_result(rate: float | None, ttft_p99_ms: float) -> dict:
    """What serving_gap.serve returns for one run of `rate` requests/s (None: the burst)."""
    latencies = {"ttft": {"p99": ttft_p99_ms}, "itl": {"p99": 5.0}}
    summary = {"request_throughput": rate or 0, "completion_throughput": 100.0 * (rate or 1000), "failed": 0}
    return {"summary": {**summary, "latencies_ms": latencies}, "client": {"peak_cpu_pct": [20.0]}}


@pytest.fixture
def server_roots(monkeypatch) -> list[object]:
    """benchmarks.serve.LaunchedServer replaced by a stand-in that starts nothing; the list gets each one's root."""
    import benchmarks.serve

    roots: list[object] = []

    class NoServer:
        url = "http://127.0.0.1:1"

        def __init__(self, launch, log, root=benchmarks.serve.ROOT):
            roots.append(root)

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            pass

    monkeypatch.setattr(benchmarks.serve, "LaunchedServer", NoServer)
    return roots


def test_the_sweep_runs_the_client_alone_before_the_server_at_each_rate_and_stops_past_saturation(
    monkeypatch, tmp_path, server_roots
):
    ttft_by_rate = {100.0: 50.0, 200.0: 300.0, 400.0: 900.0, 800.0: 50.0}
    labels: list[str] = []

    def fake_serve(label, flags, out, log, rows):
        labels.append(label)
        args = shlex.split(flags)
        rate = float(args[args.index("--request-rate") + 1]) if "--request-rate" in args else None
        return serve_result(rate, 10.0 if "--mock-server" in args or rate is None else ttft_by_rate[rate])

    monkeypatch.setattr(serving_gap, "serve", fake_serve)
    out = tmp_path / "out"
    serving_gap.main(
        ["--model", str(tmp_path), "--out", str(out), "--parts", "sweep", "--sweep-rates", "100,200,400,800"]
    )
    assert labels == [
        *("sweep_client_100", "sweep_100", "sweep_client_200", "sweep_200", "sweep_client_400", "sweep_400"),
        "sweep_burst",
    ], "two rates in a row past the SLOs end the sweep; the burst runs on the same server"
    verdict = json.loads((out / "sweep.json").read_text())
    assert verdict["goodput_req_s"] == 100 and not verdict["client_limited"]
    assert verdict["burst_tok_s"] == 100_000.0
    assert (out / "sweep.png").exists()


def test_with_a_base_root_the_same_rates_run_against_that_checkouts_server_after_ours(
    monkeypatch, tmp_path, server_roots
):
    import benchmarks.serve

    labels: list[str] = []

    def fake_serve(label, flags, out, log, rows):
        labels.append(label)
        return serve_result(1.0, 10.0)

    monkeypatch.setattr(serving_gap, "serve", fake_serve)
    out, before = tmp_path / "out", tmp_path / "before"
    argv = ["--model", str(tmp_path), "--out", str(out), "--parts", "sweep", "--sweep-rates", "100,200"]
    serving_gap.main([*argv, "--base-root", str(before)])
    assert labels == [
        *("sweep_client_100", "sweep_100", "sweep_client_200", "sweep_200", "sweep_burst"),
        *("base_sweep_100", "base_sweep_200", "base_sweep_burst"),
    ], "the base server reuses the client's points: no second mock-server run"
    assert server_roots == [benchmarks.serve.ROOT, before.resolve()]
    base = json.loads((out / "base_sweep.json").read_text())
    assert base["root"] == str(before.resolve()) and [p["rate"] for p in base["client_points"]] == [100.0, 200.0]
    assert (out / "sweep.json").exists() and (out / "base_sweep.png").exists()
