"""benchmarks.serving_gap's parallel part: which server runs it asks for, in which order (no server runs)."""

from __future__ import annotations

import shlex

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
