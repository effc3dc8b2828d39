"""Our decode kernel's launch shapes (keys per tile, warps, pipeline stages) swept on one GPU, bf16 and float8
KV stores, W1's short contexts through long ones; prints the fastest per (head dim, store) against the default.

    python -m benchmarks.decode_tiles [--json FILE]

Each launch is captured in a CUDA graph and timed by its replays (as benchmarks.attention_libraries times it);
the figure is KV bytes read per second as a share of the GPU's HBM bandwidth. A shape's score is its geometric
mean time over the cases; the chosen shapes go into DECODE_TILES (gpu_worker/attention/triton_kernels.py).
Every output is checked against the float32 reference first (a float8 store's against the dequantized cache).
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import math
import random

import numpy as np
import torch
import triton.testing

from benchmarks.attention_check import Shape
from benchmarks.attention_libraries import as_fp8, dequantized, make_decode_batch, ours_decode, reference_decode
from benchmarks.roofline import gpu_peak
from gpu_worker.attention import triton_kernels as kernels

SHAPES = (Shape("llama-3-8b (32/8x128)", 32, 8, 128), Shape("llama-3.2-1b (32/8x64)", 32, 8, 64))
CASES = ((256, (64, 768)), (512, (400, 800)), (32, (4096, 4096)), (8, (32768, 32768)))
BLOCK_N = (32, 64, 128)
WARPS = (2, 4, 8)
# Triton 3.6 gives the K/V loads (indirect: through the block table) one shared-memory buffer up to 4 stages, two at
# 5-6, three at 7 (the kernel's TTGIR, docs/results/fp8_kv_pairs_h200/sass_count.py); 3 and 4 prefetch the table.
STAGES = (2, 3, 4, 5, 7)


def time_graph_ms(run) -> float:
    """Median ms of the launch's CUDA-graph replays (shorter than attention_libraries': many shapes to time)."""
    torch.cuda.synchronize()
    return triton.testing.do_bench_cudagraph(run, rep=60, return_mode="median")


def ints(text: str) -> tuple[int, ...]:
    return tuple(int(x) for x in text.split(","))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", help="write every timing here")
    parser.add_argument("--head-dims", type=ints, default=(128, 64), help="of the shapes above")
    parser.add_argument("--stores", default="bf16,fp8")
    parser.add_argument("--block-n", type=ints, default=BLOCK_N)
    parser.add_argument("--warps", type=ints, default=WARPS)
    parser.add_argument("--stages", type=ints, default=STAGES)
    parser.add_argument(
        "--fp8-products", type=lambda text: tuple(text.split(",")), default=kernels.FP8_PRODUCTS,
        help=f"a float8 store's ways to its products, of {kernels.FP8_PRODUCTS} (DecodeTiles.fp8_products)",
    )  # fmt: skip
    args = parser.parse_args(argv)
    peak = gpu_peak(torch.cuda.get_device_name())
    peak_bw = peak.hbm_bytes_per_s if peak else float("nan")
    rows: list[dict] = []
    rng = random.Random(0)
    best: dict[str, dict] = {}
    shapes = [shape for shape in SHAPES if shape.head_dim in args.head_dims]
    for shape, store in itertools.product(shapes, args.stores.split(",")):
        fp8 = store == "fp8"
        default = kernels.decode_tiles(shape.head_dim, fp8)
        # (no float8 store: the products' choice is moot, so the default's, and the default compares equal)
        launches = [
            kernels.DecodeTiles(block_n, warps, stages, products)
            for block_n, warps, stages in itertools.product(args.block_n, args.warps, args.stages)
            for products in (args.fp8_products if fp8 else (default.fp8_products,))
        ]
        times: dict[kernels.DecodeTiles, list[float]] = {}
        for num_seqs, contexts in CASES:
            batch = make_decode_batch(shape, num_seqs, contexts, rng)
            if fp8:
                batch = as_fp8(batch)
            scale = shape.head_dim**-0.5
            small = num_seqs * contexts[1] <= 600_000
            ref = reference_decode(dequantized(batch) if fp8 else batch, scale) if small else None
            kv_bytes = batch.kv_bytes
            for tiles in launches:
                row = {"shape": shape.name, "store": store, "seqs": num_seqs, "contexts": "-".join(map(str, contexts))}
                row |= dataclasses.asdict(tiles)
                try:
                    run = ours_decode(batch, scale, tiles)
                    out = run()
                    if ref is not None:
                        row["rel_err"] = ((out.float() - ref).norm() / ref.norm()).item()
                        if row["rel_err"] > 2e-2:
                            raise AssertionError(f"relative error {row['rel_err']:.3g}")
                    ms = time_graph_ms(run)
                    row |= {"us": 1000 * ms, "hbm_share": kv_bytes / (ms / 1000) / peak_bw}
                    times.setdefault(tiles, []).append(ms)
                except Exception as error:  # a shape that does not compile or fit (shared memory): skipped
                    row["error"] = (str(error).splitlines() or [repr(error)])[0][:200]
                    print(f"{shape.name} {store} {num_seqs}x{contexts} {tiles}: {row['error']}")
                rows.append(row)
            del batch
            torch.cuda.empty_cache()
        complete = {k: v for k, v in times.items() if len(v) == len(CASES)}
        score = {k: math.exp(np.mean(np.log(v))) for k, v in complete.items()}
        winner = min(score, key=score.__getitem__)
        best[f"{shape.name} {store}"] = {
            "best": dataclasses.asdict(winner),
            "best_us": [round(1000 * t, 1) for t in complete[winner]],
            "current": dataclasses.asdict(default),
            "current_us": [round(1000 * t, 1) for t in complete.get(default, [])],
            "gain": score.get(default, float("nan")) / score[winner],
        }
        if args.json:  # after each (shape, store): a run cut short keeps what it measured
            with open(args.json, "w") as f:
                json.dump({"device": torch.cuda.get_device_name(), "cases": CASES, "rows": rows, "best": best}, f)
    print(f"cases (seqs x context): {CASES}")
    print("| shape, store | best | its us per case | current (DECODE_TILES) us per case | gain |")
    print("|---|---|---|---|---|")
    for name, b in best.items():
        print(f"| {name} | {tuple(b['best'].values())} | {b['best_us']} | {b['current_us']} | {b['gain']:.3f}x |")


if __name__ == "__main__":
    main()
