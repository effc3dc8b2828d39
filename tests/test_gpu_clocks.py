"""benchmarks/gpu_clocks.py: what a benchmark reports of the clock and power the GPU held (nvidia-smi's samples)."""

import shutil

from benchmarks.gpu_clocks import GpuClockLog, _parse, describe

SAMPLES = [
    "345, 1980, 80.50, 700.00, 0x0000000000000000",  # idle before the run: left out
    "1500, 1980, 695.10, 700.00, 0x0000000000000004",  # power-capped
    "1650, 1980, 690.00, 700.00, 0x0000000000000080",  # the hardware's power brake
    "1980, 1980, 420.00, 700.00, 0x0000000000000000",
    "[N/A], 1980, 1.00, 700.00, 0x0",  # unreadable: skipped
]


def test_the_summary_is_over_the_loaded_samples_and_counts_those_power_held_down():
    log = GpuClockLog()
    log.samples = [s for s in map(_parse, SAMPLES) if s is not None]
    summary = log.summary()
    assert summary is not None and summary["samples"] == 3
    assert (summary["sm_mhz_p50"], summary["sm_mhz_min"], summary["sm_mhz_max_rated"]) == (1650, 1500, 1980)
    assert summary["power_w_p50"] == 690.0 and summary["power_limit_w"] == 700.0
    assert summary["power_capped_share"] == 2 / 3 and summary["thermal_share"] == 0
    assert "1650 MHz" in describe(summary) and "67% of 3 samples" in describe(summary)


def test_without_nvidia_smi_nothing_is_sampled_and_nothing_reported(monkeypatch):
    monkeypatch.setattr(shutil, "which", lambda name: None)
    with GpuClockLog() as log:
        pass
    assert log.summary() is None and describe(log.summary()) is None
