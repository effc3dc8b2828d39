"""The gated MLP's activation kernel (models/triton_ops.py: act_and_mul, and its fp8 form quantizing each row) at
decode and prefill sizes: µs per call, timed by CUDA-graph replays (at decode sizes the input may sit in L2).

    python -m benchmarks.act_and_mul [--inner 14336] [--rows 64,256,8192]
"""

from __future__ import annotations

import argparse

import torch
import triton.testing

from gpu_worker.models import triton_ops


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--inner", type=int, default=14336, help="the MLP's width (Llama-3-8B's)")
    parser.add_argument("--rows", default="64,256,8192", help="token counts")
    args = parser.parse_args(argv)
    for rows in (int(r) for r in args.rows.split(",")):
        x = torch.randn(rows, 2 * args.inner, device="cuda", dtype=torch.bfloat16)
        for name, kernel in (("bf16", triton_ops.act_and_mul), ("fp8", triton_ops.act_and_mul_fp8)):
            print(f"{name:<5} {rows:>6} x {args.inner:<6} {time_us(kernel, x):8.1f} µs")


def time_us(kernel, x: torch.Tensor) -> float:
    kernel(x)  # compiled outside the capture
    return 1000 * triton.testing.do_bench_cudagraph(lambda: kernel(x), rep=100, return_mode="median")


if __name__ == "__main__":
    main()
