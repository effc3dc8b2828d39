"""Math that Triton lacks on every target: tanh (libdevice has one on CUDA, but the interpreter that runs
the kernels on a CPU in tests has none, and one formula everywhere keeps the tested code the served code)."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def tanh(x):
    """float32 tanh: an odd series below |x| = 0.1 (1 - 2 / (e^2x + 1) loses the low bits of small values
    there, its error ~1e-7 absolute), the exponential form above (exp overflowing to inf gives exactly 1)."""
    a = tl.abs(x)
    x2 = x * x
    series = x * (1.0 + x2 * (-1.0 / 3.0 + x2 * (2.0 / 15.0 + x2 * (-17.0 / 315.0))))
    big = 1.0 - 2.0 / (tl.exp(2.0 * a) + 1.0)
    return tl.where(a < 0.1, series, tl.where(x < 0, -big, big))
