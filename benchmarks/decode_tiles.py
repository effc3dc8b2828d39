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
import itertools
import json
import math
import random

import numpy as np
import torch
import triton.testing

from benchmarks.attention_check import Shape
from benchmarks.attention_libraries import DEVICE, PagedBatch, make_decode_batch, reference_decode
from benchmarks.roofline import gpu_peak
from gpu_worker.attention import triton_kernels as kernels
from gpu_worker.kv_cache import quantize

SHAPES = (Shape("llama-3-8b (32/8x128)", 32, 8, 128), Shape("llama-3.2-1b (32/8x64)", 32, 8, 64))
CASES = ((256, (64, 768)), (512, (400, 800)), (32, (4096, 4096)), (8, (32768, 32768)))
BLOCK_N = (32, 64, 128)
WARPS = (2, 4, 8)
STAGES = (2, 3, 4)


def as_fp8(batch: PagedBatch) -> PagedBatch:
    """The same batch in a float8 store of scale 1 (random normal values sit well inside e4m3's range)."""
    return PagedBatch(
        batch.q, quantize(batch.k_cache, 1.0), quantize(batch.v_cache, 1.0), batch.block_tables,
        batch.context_lens, batch.tables,
    )  # fmt: skip


def dequantized(batch: PagedBatch) -> PagedBatch:
    dtype = batch.q.dtype
    return PagedBatch(
        batch.q, batch.k_cache.to(dtype), batch.v_cache.to(dtype), batch.block_tables, batch.context_lens,
        batch.tables,
    )  # fmt: skip


def launcher(batch: PagedBatch, scale: float, tiles: kernels.DecodeTiles):
    num_sms = torch.cuda.get_device_properties(DEVICE).multi_processor_count
    slices = kernels.decode_slices(batch.context_lens, batch.k_cache.shape[2], num_sms)
    span, seqs, starts = (
        torch.tensor(values, dtype=torch.int32, device=DEVICE)
        for values in ([0, 0, len(batch.context_lens), slices.slice_len], slices.seqs, slices.starts)
    )
    context_lens = torch.tensor(batch.context_lens, dtype=torch.int32, device=DEVICE)
    out = torch.empty_like(batch.q)
    merge_counts = kernels.decode_merge_counts(len(batch.context_lens), batch.k_cache.shape[2], DEVICE)

    def run() -> torch.Tensor:
        kernels.decode_attention(
            batch.q, out, batch.k_cache, batch.v_cache, batch.block_tables, context_lens, scale, span, seqs,
            starts, merge_counts, tiles=tiles,
        )  # fmt: skip
        return out

    return run


def time_graph_ms(run) -> float:
    """Median ms of the launch's CUDA-graph replays (shorter than attention_libraries': many shapes to time)."""
    torch.cuda.synchronize()
    return triton.testing.do_bench_cudagraph(run, rep=60, return_mode="median")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", help="write every timing here")
    args = parser.parse_args(argv)
    peak = gpu_peak(torch.cuda.get_device_name())
    peak_bw = peak.hbm_bytes_per_s if peak else float("nan")
    rows: list[dict] = []
    rng = random.Random(0)
    best: dict[str, dict] = {}
    for shape, fp8 in itertools.product(SHAPES, (False, True)):
        store = "fp8" if fp8 else "bf16"
        times: dict[tuple[int, int, int], list[float]] = {}
        for num_seqs, contexts in CASES:
            batch = make_decode_batch(shape, num_seqs, contexts, rng)
            if fp8:
                batch = as_fp8(batch)
            scale = shape.head_dim**-0.5
            small = num_seqs * contexts[1] <= 600_000
            ref = reference_decode(dequantized(batch) if fp8 else batch, scale) if small else None
            kv_bytes = batch.kv_bytes
            for block_n, warps, stages in itertools.product(BLOCK_N, WARPS, STAGES):
                row = {
                    "shape": shape.name,
                    "store": store,
                    "seqs": num_seqs,
                    "contexts": f"{contexts[0]}-{contexts[1]}",
                }
                row |= {"block_n": block_n, "num_warps": warps, "num_stages": stages}
                try:
                    run = launcher(batch, scale, kernels.DecodeTiles(block_n, warps, stages))
                    out = run()
                    if ref is not None:
                        row["rel_err"] = ((out.float() - ref).norm() / ref.norm()).item()
                        if row["rel_err"] > 2e-2:
                            raise AssertionError(f"relative error {row['rel_err']:.3g}")
                    ms = time_graph_ms(run)
                    row |= {"us": 1000 * ms, "hbm_share": kv_bytes / (ms / 1000) / peak_bw}
                    times.setdefault((block_n, warps, stages), []).append(ms)
                except Exception as error:  # a shape that does not compile or fit (shared memory): skipped
                    row["error"] = (str(error).splitlines() or [repr(error)])[0][:200]
                    print(f"{shape.name} {store} {num_seqs}x{contexts} {block_n}/{warps}/{stages}: {row['error']}")
                rows.append(row)
            del batch
            torch.cuda.empty_cache()
        complete = {k: v for k, v in times.items() if len(v) == len(CASES)}
        score = {k: math.exp(np.mean(np.log(v))) for k, v in complete.items()}
        default = kernels.DecodeTiles()
        default_key = (default.block_n, default.num_warps, default.num_stages)
        winner = min(score, key=score.get)
        best[f"{shape.name} {store}"] = {
            "best": winner,
            "best_us": [round(1000 * t, 1) for t in complete[winner]],
            "default_us": [round(1000 * t, 1) for t in complete.get(default_key, [])],
            "gain": score.get(default_key, float("nan")) / score[winner],
        }
        if args.json:  # after each (shape, store): a run cut short keeps what it measured
            with open(args.json, "w") as f:
                json.dump({"device": torch.cuda.get_device_name(), "cases": CASES, "rows": rows, "best": best}, f)
    print(f"cases (seqs x context): {CASES}")
    print("| shape, store | best (block_n, warps, stages) | best us per case | default us per case | gain |")
    print("|---|---|---|---|---|")
    for name, b in best.items():
        print(f"| {name} | {b['best']} | {b['best_us']} | {b['default_us']} | {b['gain']:.3f}x |")


if __name__ == "__main__":
    main()
