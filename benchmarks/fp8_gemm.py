"""FP8 matrix products at a model's projection shapes: torch._scaled_mm (row-wise scales) against our Triton
kernel (gpu_worker/models/triton_matmul.py: scaled_matmul, its launch shapes swept) and the bf16 product, side by
side on one GPU, by token count (a decode step's rows through a prefill's). --plain: the bf16 products too, cuBLAS
(F.linear) against our kernel unscaled (triton_matmul.matmul), for triton_matmul.PLAIN_DECODE_ROWS.

    python -m benchmarks.fp8_gemm [--shape llama-3-8b] [--tokens 64,256,1024,8192] [--block-scales] [--plain]
        [--json FILE]

Each product is captured in a CUDA graph and timed by its replays (median), as the engine runs it; the figure
beside it is its floor, the larger of its bytes (weights, activations, output) at the HBM bandwidth and its FLOPs
at the fp8 (bf16) dense peak (benchmarks/roofline.py), and the share of it reached. Outputs are checked against
_scaled_mm first.
"""

from __future__ import annotations

import argparse
import dataclasses
import json

import torch
import torch.nn.functional as F
import triton.testing

from benchmarks.roofline import gpu_peak
from gpu_worker.models import fp8, triton_matmul
from gpu_worker.models.matmul_tiles import Tiles

# (name, N, K) of a layer's products: the fused QKV, the output projection, the fused gate-up, the down projection.
SHAPES = {
    "llama-3-8b": (("qkv", 6144, 4096), ("o", 4096, 4096), ("gate_up", 28672, 4096), ("down", 4096, 14336)),
    "llama-3.2-1b": (("qkv", 3072, 2048), ("o", 2048, 2048), ("gate_up", 16384, 2048), ("down", 2048, 8192)),
}
TILES = (
    Tiles(64, 64, 128, 4, 4, 8),
    Tiles(64, 128, 128, 4, 4, 8),
    Tiles(64, 128, 128, 4, 6, 8),
    Tiles(64, 256, 128, 8, 3, 8),
    Tiles(128, 128, 128, 8, 4, 8),
    Tiles(128, 256, 128, 8, 3, 8),
    Tiles(64, 128, 256, 4, 3, 8),
    Tiles(64, 64, 256, 4, 3, 8),
    Tiles(64, 256, 128, 4, 4, 8),
    Tiles(128, 128, 256, 8, 3, 8),
    Tiles(128, 64, 128, 4, 4, 8),
    # fed by TMA (Tiles.feed): one program a tile, or persistent and warp-specialized
    Tiles(64, 128, 128, 4, 4, 8, "tma"),
    Tiles(128, 128, 128, 4, 3, 8, "tma"),
    Tiles(64, 128, 256, 4, 3, 8, "tma"),
    Tiles(64, 64, 256, 4, 3, 8, "tma"),
    Tiles(64, 128, 128, 4, 4, 8, "tma_ws"),
    Tiles(64, 256, 128, 4, 4, 8, "tma_ws"),
    Tiles(128, 256, 128, 8, 3, 8, "tma_ws"),
)
# The plain products' launch shapes: bfloat16 entries are twice fp8's bytes, so half the inputs a tile.
PLAIN_TILES = (
    Tiles(64, 64, 64, 4, 4, 8),
    Tiles(64, 128, 64, 4, 4, 8),
    Tiles(64, 64, 128, 4, 3, 8),
    Tiles(64, 128, 128, 4, 3, 8),
    Tiles(128, 128, 64, 4, 4, 8),
    Tiles(128, 256, 64, 8, 3, 8),
    Tiles(64, 128, 64, 4, 4, 8, "tma"),
    Tiles(64, 64, 128, 4, 3, 8, "tma"),
    Tiles(64, 128, 128, 4, 3, 8, "tma"),
    Tiles(64, 256, 64, 4, 4, 8, "tma_ws"),
    Tiles(128, 128, 64, 4, 4, 8, "tma_ws"),
    Tiles(128, 256, 64, 8, 3, 8, "tma_ws"),
)


def ints(text: str) -> tuple[int, ...]:
    return tuple(int(x) for x in text.split(","))


def time_us(run) -> float:
    run()
    torch.cuda.synchronize()
    return 1000 * triton.testing.do_bench_cudagraph(run, rep=100, return_mode="median")


def measure(m: int, weight, weight_scale, weight_bf16, gen, rows: list[dict], row: dict, blocks=None) -> tuple:
    """One token count against one weight: bf16, _scaled_mm, and the Triton kernel at each launch shape (its rows
    appended to `rows`). Returns (bf16 µs, _scaled_mm µs, (best Triton µs, its tiles) or None). blocks: the same
    weight quantized per block instead (fp8.quantize_blocks: values, scales [N, groups], inputs per group), which
    ours multiplies with its block scales, the activations quantized per token and group; _scaled_mm keeps the
    row-wise ones, the speed to compare with."""
    x = torch.randn(m, weight.shape[1], generator=gen, device=weight.device, dtype=torch.bfloat16)
    xq, xs = fp8.quantize_rows(x)

    def scaled_mm(xq=xq, xs=xs, weight=weight, weight_scale=weight_scale) -> torch.Tensor:  # row-wise, bound here
        return torch._scaled_mm(xq, weight.t(), scale_a=xs, scale_b=weight_scale, out_dtype=torch.bfloat16)

    want = scaled_mm().float()
    group = 0
    if blocks is not None:  # the activations per token and group too, as fp8.linear quantizes them for these
        weight, weight_scale, group = blocks
        grouped = fp8.quantize_activation(x, group)
        xq, xs = grouped.values, grouped.scales
        want = fp8.dequantize_groups(xq, xs, group) @ fp8.dequantize_groups(weight, weight_scale, group).t()
    bf16_us = time_us(lambda: F.linear(x, weight_bf16))
    mm_us = time_us(scaled_mm)

    def ours(t: Tiles) -> torch.Tensor:
        return triton_matmul.scaled_matmul(xq, xs, weight, weight_scale, t, group=group)

    best = fastest_tiles(ours, want, "the reference", rows, row | {"bf16_us": bf16_us, "mm_us": mm_us})
    return bf16_us, mm_us, best


def measure_plain(m: int, weight_bf16, gen, rows: list[dict], row: dict) -> tuple | None:
    """Our kernel unscaled at each launch shape on one bf16 weight (its rows appended to `rows`, checked against
    F.linear first). Returns (best µs, its tiles) or None."""
    x = torch.randn(m, weight_bf16.shape[1], generator=gen, device=weight_bf16.device, dtype=torch.bfloat16)
    return fastest_tiles(
        lambda t: triton_matmul.matmul(x, weight_bf16, t),
        F.linear(x, weight_bf16).float(),
        "F.linear",
        rows,
        row,
        PLAIN_TILES,
    )


def fastest_tiles(
    product, want: torch.Tensor, reference: str, rows: list[dict], row: dict, candidates: tuple[Tiles, ...] = TILES
) -> tuple | None:
    """product(tiles) at each launch shape of `candidates`, checked against `want` (named `reference`) first, then
    timed; each shape's row (`row` and its tiles, its µs or why it was skipped) appended to `rows`. Returns (best
    µs, its tiles) or None."""
    best = None
    for tiles in candidates:
        try:
            err = ((product(tiles).float() - want).norm() / want.norm()).item()
            if err > 1e-2:
                raise AssertionError(f"relative error {err:.3g} against {reference}")
            us = time_us(lambda t=tiles: product(t))
        except Exception as error:  # a launch shape that does not fit (shared memory): skipped
            rows.append(row | {"tiles": dataclasses.asdict(tiles), "error": str(error).splitlines()[0][:200]})
            continue
        rows.append(row | {"tiles": dataclasses.asdict(tiles), "triton_us": us})
        if best is None or us < best[0]:
            best = (us, tiles)
    return best


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", choices=sorted(SHAPES), default="llama-3-8b")
    parser.add_argument("--tokens", type=ints, default=(16, 64, 256, 512, 2048, 8192))
    parser.add_argument("--json", help="write every timing here")
    parser.add_argument(
        "--block-scales",
        action="store_true",
        help="ours with the weights quantized per 128 x 128 block (a block-scaled checkpoint's: quantize_blocks)",
    )
    parser.add_argument(
        "--plain", action="store_true", help="also the bf16 products: F.linear against our kernel unscaled"
    )
    args = parser.parse_args(argv)
    device = torch.device("cuda")
    peak = gpu_peak(torch.cuda.get_device_name())
    if peak is None:
        raise SystemExit(f"no peak figures for {torch.cuda.get_device_name()!r} in benchmarks/roofline.py")
    gen = torch.Generator(device).manual_seed(0)
    rows: list[dict] = []
    table = []
    plain: list[tuple] = []
    for name, n, k in SHAPES[args.shape]:
        weight, weight_scale = fp8.quantize_rows(torch.randn(n, k, generator=gen, device=device) * 0.02)
        weight_scale = weight_scale.t().contiguous()  # [1, N], as models/fp8.py keeps it
        weight_bf16 = torch.randn(n, k, generator=gen, device=device, dtype=torch.bfloat16)
        blocks = (
            (*fp8.quantize_blocks(weight.float() * weight_scale.t(), (128, 128)), 128) if args.block_scales else None
        )
        for m in args.tokens:
            fp8_bytes = n * k + m * k + 2 * m * n
            floor_us = 1e6 * max(fp8_bytes / peak.hbm_bytes_per_s, 2 * m * n * k / peak.fp8_flops_per_s)
            row = {"product": name, "n": n, "k": k, "tokens": m, "floor_us": floor_us}
            bf16_us, mm_us, best = measure(m, weight, weight_scale, weight_bf16, gen, rows, row, blocks)
            table.append((name, m, floor_us, bf16_us, mm_us, best))
            if args.plain:
                bf16_bytes = 2 * (n * k + m * k + m * n)
                bf16_floor_us = 1e6 * max(bf16_bytes / peak.hbm_bytes_per_s, 2 * m * n * k / peak.bf16_flops_per_s)
                plain_row = row | {"product": f"{name} (bf16)", "floor_us": bf16_floor_us, "f_linear_us": bf16_us}
                plain.append((name, m, bf16_floor_us, bf16_us, measure_plain(m, weight_bf16, gen, rows, plain_row)))
            ours = f"{best[0]:7.1f} {best[1]}" if best else "-"
            print(
                f"{name:<8}{m:>6}  floor {floor_us:7.1f} µs  bf16 {bf16_us:7.1f}  _scaled_mm {mm_us:7.1f}  ours {ours}"
            )
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "shape": args.shape, "rows": rows}, f)
    print("\n| product | tokens | floor µs | bf16 | _scaled_mm (share of floor) | best Triton (share) | its tiles |")
    print("|---|---|---|---|---|---|---|")
    for name, m, floor_us, bf16_us, mm_us, best in table:
        ours = f"{best[0]:.1f} ({100 * floor_us / best[0]:.0f} %)" if best else "-"
        tiles = dataclasses.astuple(best[1]) if best else "-"
        mm = f"{mm_us:.1f} ({100 * floor_us / mm_us:.0f} %)"
        print(f"| {name} | {m} | {floor_us:.1f} | {bf16_us:.1f} | {mm} | {ours} | {tiles} |")
    if plain:
        print("\n| bf16 product | tokens | floor µs | F.linear (share of floor) | best Triton (share) | its tiles |")
        print("|---|---|---|---|---|---|")
        for name, m, floor_us, bf16_us, best in plain:
            ours = f"{best[0]:.1f} ({100 * floor_us / best[0]:.0f} %)" if best else "-"
            tiles = dataclasses.astuple(best[1]) if best else "-"
            cublas = f"{bf16_us:.1f} ({100 * floor_us / bf16_us:.0f} %)"
            print(f"| {name} | {m} | {floor_us:.1f} | {cublas} | {ours} | {tiles} |")


if __name__ == "__main__":
    main()
