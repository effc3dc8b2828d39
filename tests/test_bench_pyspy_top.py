"""benchmarks.pyspy_top reads py-spy's collapsed stacks: a frame's self share is the samples it was on top of the
stack, its inclusive share every sample it was in, and --under keeps what ran beneath one frame."""

from __future__ import annotations

from benchmarks.pyspy_top import main

RAW = """\
main (a.py:1);loop (a.py:5);plan (a.py:9) 6
main (a.py:1);loop (a.py:5);plan (a.py:9);encode (b.py:3) 3
main (a.py:1);loop (a.py:5);poll (c.py:2) 1
"""


def test_self_and_inclusive_shares(tmp_path, capsys):
    raw = tmp_path / "sched.raw"
    raw.write_text(RAW)
    summary = main([str(raw)])
    assert summary["samples"] == 10
    assert summary["self"] == {"plan (a.py:9)": 6, "encode (b.py:3)": 3, "poll (c.py:2)": 1}
    assert summary["inclusive"]["loop (a.py:5)"] == 10 and summary["inclusive"]["plan (a.py:9)"] == 9
    assert "60.0  plan (a.py:9)" in capsys.readouterr().out


def test_under_keeps_only_what_runs_beneath_a_frame(tmp_path):
    raw = tmp_path / "sched.raw"
    raw.write_text(RAW)
    summary = main([str(raw), "--under", "plan (a.py"])
    assert summary["samples"] == 10  # shares stay of all samples
    assert summary["self"] == {"encode (b.py:3)": 3}
