"""The clock and power the GPU held while a benchmark ran, sampled from nvidia-smi every 100 ms.

    with GpuClockLog() as clocks:      # nothing is sampled (clocks.summary() is None) without nvidia-smi
        run()
    clocks.summary()                   # {"sm_mhz_p50": ..., "power_capped_share": ..., ...}

Why a benchmark wants it: an H200 running the 8B shape's decode at 256 requests draws its whole 700 W, and the
driver lowers the SM clock to stay under it (1,300-1,650 MHz of 1,980 in W1; 2026-11-27, one H200), so the
products' FLOP rate is below the datasheet's, quoted at 1,830 MHz (GpuPeak.at_sm_clock gives the floor at the clock
held). A roofline share read without the clock blames the kernels for the power limit.
"""

from __future__ import annotations

import shutil
import statistics
import subprocess
import tempfile

# nvidia-smi's clocks_throttle_reasons bits (nvml.h: nvmlClocksEventReason*) that say power held the clock down.
POWER_CAP_BITS = 0x4 | 0x80  # SwPowerCap, HwPowerBrakeSlowdown
THERMAL_BITS = 0x20 | 0x40  # SwThermalSlowdown, HwThermalSlowdown
QUERY = "clocks.sm,clocks.max.sm,power.draw,power.limit,clocks_throttle_reasons.active"


class GpuClockLog:
    def __init__(self, index: int = 0, interval_ms: int = 100):
        self.index = index
        self.interval_ms = interval_ms
        self._proc: subprocess.Popen | None = None
        self._file = tempfile.TemporaryFile(mode="w+")  # noqa: SIM115 (closed by __exit__; a pipe could fill)
        self.samples: list[tuple[float, float, float, float, int]] = []

    def __enter__(self) -> GpuClockLog:
        smi = shutil.which("nvidia-smi")
        if smi is not None:
            self._proc = subprocess.Popen(
                [smi, f"--id={self.index}", f"--query-gpu={QUERY}", "--format=csv,noheader,nounits",
                 f"-lms={self.interval_ms}"],
                stdout=self._file,
                stderr=subprocess.DEVNULL,
            )  # fmt: skip
        return self

    def __exit__(self, *exc) -> None:
        if self._proc is not None:
            self._proc.terminate()
            self._proc.wait()
        self._file.seek(0)
        self.samples = [s for s in map(_parse, self._file) if s is not None]
        self._file.close()

    def summary(self, loaded_watts: float = 0.3) -> dict | None:
        """Over the samples drawing at least `loaded_watts` of the limit (the run, not the idle moments around it):
        the SM clock's median and least against its maximum, the power's median against the limit, and the share
        of samples the power limit (or heat) held the clock down in. None without samples."""
        loaded = [s for s in self.samples if s[2] >= loaded_watts * s[3]]
        if not loaded:
            return None
        sm = [s[0] for s in loaded]
        return {
            "samples": len(loaded),
            "sm_mhz_p50": statistics.median(sm),
            "sm_mhz_min": min(sm),
            "sm_mhz_max_rated": loaded[0][1],
            "power_w_p50": statistics.median(s[2] for s in loaded),
            "power_limit_w": loaded[0][3],
            "power_capped_share": sum(bool(s[4] & POWER_CAP_BITS) for s in loaded) / len(loaded),
            "thermal_share": sum(bool(s[4] & THERMAL_BITS) for s in loaded) / len(loaded),
        }


def _parse(line: str) -> tuple[float, float, float, float, int] | None:
    fields = [f.strip() for f in line.split(",")]
    try:
        return float(fields[0]), float(fields[1]), float(fields[2]), float(fields[3]), int(fields[4], 16)
    except (ValueError, IndexError):  # "[N/A]", a partial last line
        return None


def describe(summary: dict | None) -> str | None:
    """One line for a benchmark's report."""
    if summary is None:
        return None
    return (
        f"the GPU held its SM clock at {summary['sm_mhz_p50']:.0f} MHz (median; least {summary['sm_mhz_min']:.0f}) "
        f"of {summary['sm_mhz_max_rated']:.0f}, drawing {summary['power_w_p50']:.0f} W of its "
        f"{summary['power_limit_w']:.0f} W limit; power held the clock down in "
        f"{100 * summary['power_capped_share']:.0f}% of {summary['samples']} samples"
    )
