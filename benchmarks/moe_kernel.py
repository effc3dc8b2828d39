"""One mixture-of-experts layer's experts, the fused Triton kernels against the torch paths, per token count.

    python -m benchmarks.moe_kernel [--shapes qwen3-30b-a3b,mixtral-8x7b] [--tp 2] [--tokens 1,8,64,256,1024,4096]
    python -m benchmarks.moe_kernel --quantization fp8   # the experts in FP8 (weight-only), as the engine holds them
    python -m benchmarks.moe_kernel -q fp8 --block-scales  # ... as from a checkpoint with 128 x 128 block scales
    python -m benchmarks.moe_kernel --sweep-tiles     # which tiles are fastest, against the ones tiles_for picks

For each shape (benchmarks/shapes.py; one layer of it, random weights, this rank's 1/--tp of every expert's
width) and token count: a random routing through the layer's own router, then milliseconds per layer of
    fused graph   models/fused_moe.py replayed from a CUDA graph, as a captured decode step runs it
    sort          its part that sorts the pairs by expert (models/moe_sort.py), alone in a graph
    fused eager   the same, launched from Python (eager steps, prefills no graph holds)
    torch loop    the torch path: each expert on its tokens (host reads; what --enforce-eager ran before)
    every expert  every expert on every token, zero-weighted where unpicked, in a CUDA graph: what captured
                  steps ran before the fused kernels
and the fused path's reading speed: the picked experts' weights (measured from the routing; with
--quantization fp8 one byte a weight, and their scales) over the graph's time, as a share of the GPU's datasheet
bandwidth (benchmarks/roofline.py). The fused output's largest error against the torch loop's, relative to its
largest magnitude, is printed too (bf16: ~1e-2; the same numbers with FP8 weights, the torch loop then
multiplying them in float32, models/fp8.py; no every-expert path).
With --sweep-tiles, the fused graph's time under each tile size of SWEEP_DECODE or SWEEP_PREFILL instead, the
three fastest printed beside tiles_for's choice (models/fused_moe.py), to tune it from.
"""

from __future__ import annotations

import argparse

import torch
import triton.testing

from benchmarks.roofline import gpu_peak
from benchmarks.shapes import SHAPES
from gpu_worker.model_loader import default_dtype
from gpu_worker.models.fused_moe import Tiles, fused_experts, tiles_for
from gpu_worker.models.moe import MoEExperts, SparseMoE
from gpu_worker.models.moe_sort import sort_by_expert
from gpu_worker.parallel import TensorParallel

# Tile sizes to try: decode-sized steps (a few pairs per expert), then prefills.
SWEEP_DECODE = [
    Tiles(block_m, block_n, block_k, num_warps, num_stages)
    for block_m in (16, 32)
    for block_n, block_k in ((32, 128), (64, 64), (64, 128), (128, 64), (128, 128), (64, 256))  # 256: FP8 rows
    for num_warps, num_stages in ((4, 3), (8, 3), (4, 4))
]
SWEEP_PREFILL = [
    Tiles(block_m, block_n, block_k, num_warps, num_stages, group_m)
    for block_m in (64, 128)
    for block_n, block_k in ((64, 64), (128, 64), (128, 128), (256, 64))
    for num_warps, num_stages in ((4, 3), (8, 3), (8, 4))
    for group_m in (0, 8)
]


def moe_layer(
    shape: dict,
    tp: int,
    dtype: torch.dtype,
    device: torch.device,
    quantization: str | None = None,
    block: tuple[int, int] | None = None,
) -> SparseMoE:
    """One MoE layer of `shape` as rank 0 of `tp` holds it, weights ~N(0, 0.02) as an initialised model's, loaded
    one expert's tensor at a time as a checkpoint's are (FP8 experts quantize them as they load: per block, as a
    block-scaled checkpoint's, with `block`)."""
    qwen = shape["model_type"] == "qwen3_moe"
    with default_dtype(dtype), device:
        layer = SparseMoE(
            shape["hidden_size"],
            shape["moe_intermediate_size"] if qwen else shape["intermediate_size"],
            shape["num_experts"] if qwen else shape["num_local_experts"],
            shape["num_experts_per_tok"],
            TensorParallel(0, tp),
            shape["hidden_act"],
            fused=False,
            renormalize=shape.get("norm_topk_prob", True),
            weights_in_model_dtype=qwen,
            quantization=quantization,
        )
        torch.nn.init.normal_(layer.gate.weight, std=0.02)
        e = layer.experts
        if block is not None:
            e.use_weight_blocks(block)
        for expert in range(e.num_experts):
            for which in (0, 1):  # gate, up
                e.load("gate_up_proj", torch.randn(e.intermediate, e.hidden) * 0.02, (expert, which))
            e.load("down_proj", torch.randn(e.hidden, e.intermediate) * 0.02, (expert, None))
    return layer


def run_fused(experts: MoEExperts, x, ids, weights, tiles: Tiles | None = None) -> torch.Tensor:
    """The fused path as MoEExperts.forward calls it (with these tiles, if given)."""
    return fused_experts(
        x,
        experts.gate_up_proj,
        experts.down_proj,
        ids,
        weights,
        experts.activation,
        tiles,
        gate_up_scale=experts.gate_up_proj_scale,
        down_scale=experts.down_proj_scale,
        group=experts.weight_group,
    )


def expert_bytes(experts: MoEExperts) -> int:
    """One expert's weights (one byte each in FP8) and scales (float32, if any)."""
    tensors = [experts.gate_up_proj, experts.down_proj, experts.gate_up_proj_scale, experts.down_proj_scale]
    return sum(t[0].numel() * t.element_size() for t in tensors if t is not None)


def every_expert(layer: SparseMoE, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """The captured path before the fused kernels: all E experts on all T tokens, weighted by a [T, E] matrix."""
    experts = layer.experts
    dense = torch.zeros(x.shape[0], experts.num_experts, dtype=weights.dtype, device=x.device)
    dense.scatter_(1, ids, weights)
    out = torch.zeros_like(x)
    for e in range(experts.num_experts):
        gate, up = torch.nn.functional.linear(x, experts.gate_up_proj[e]).chunk(2, dim=-1)
        y = torch.nn.functional.linear(torch.nn.functional.silu(gate) * up, experts.down_proj[e])
        out += (y * dense[:, e, None]).to(out.dtype)
    return out


def graph_ms(fn) -> float:
    fn()  # compile and warm up outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return triton.testing.do_bench(graph.replay, return_mode="median")


def measure(layer: SparseMoE, num_tokens: int, every: bool) -> dict:
    experts = layer.experts
    block_m = tiles_for(num_tokens * layer.top_k, experts.num_experts).block_m
    x = torch.randn(num_tokens, experts.hidden, device=experts.gate_up_proj.device).to(experts.dtype)
    ids, weights = layer.route(x)

    def fused() -> torch.Tensor:
        return run_fused(experts, x, ids, weights)

    reference = experts(x, ids, weights)
    error = (fused() - reference).abs().max().item() / reference.abs().max().item()
    graph = graph_ms(fused)
    return {
        "tokens": num_tokens,
        "experts_hit": ids.unique().numel(),
        "fused_graph_ms": graph,
        "sort_ms": graph_ms(lambda: sort_by_expert(ids, experts.num_experts, block_m)),
        "fused_eager_ms": triton.testing.do_bench(fused, return_mode="median"),
        "torch_loop_ms": triton.testing.do_bench(lambda: experts(x, ids, weights), return_mode="median"),
        "every_expert_ms": graph_ms(lambda: every_expert(layer, x, ids, weights)) if every else None,
        "read_bytes_per_s": ids.unique().numel() * expert_bytes(experts) / (graph / 1000),
        "error": error,
    }


def sweep(layer: SparseMoE, num_tokens: int) -> tuple[Tiles, float, list[tuple[float, Tiles]]]:
    """tiles_for's choice and its time, and the three fastest of the sweep for its regime (fastest first)."""
    experts = layer.experts
    x = torch.randn(num_tokens, experts.hidden, device=experts.gate_up_proj.device).to(experts.dtype)
    ids, weights = layer.route(x)

    def timed(tiles: Tiles) -> float:
        return graph_ms(lambda: run_fused(experts, x, ids, weights, tiles))

    chosen = tiles_for(ids.numel(), experts.num_experts)
    times = []
    for tiles in SWEEP_DECODE if chosen.block_m <= 32 else SWEEP_PREFILL:
        try:
            times.append((timed(tiles), tiles))
        except Exception as error:  # a tile too large for shared memory: skipped, named
            print(f"  {tiles}: {type(error).__name__}")
    return chosen, timed(chosen), sorted(times, key=lambda t: t[0])[:3]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", default="qwen3-30b-a3b,mixtral-8x7b")
    parser.add_argument("--tp", type=int, default=1, help="time rank 0's share of each expert (1/--tp of its width)")
    parser.add_argument("--tokens", default="1,8,64,256,1024,4096")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    parser.add_argument(
        "--quantization", "-q", choices=["fp8"], default=None, help="the experts' weights in FP8 (weight-only)"
    )
    parser.add_argument(
        "--block-scales", action="store_true", help="FP8 experts scaled per 128 x 128 block (a checkpoint saved so)"
    )
    parser.add_argument("--sweep-tiles", action="store_true", help="time the fused graph under each tile size")
    parser.add_argument(
        "--every-expert-up-to", type=int, default=4096, help="time the every-expert path up to this many tokens"
    )
    args = parser.parse_args(argv)
    if args.block_scales and args.quantization is None:
        parser.error("--block-scales scales FP8 experts: add --quantization fp8")
    if not torch.cuda.is_available():
        parser.error("the kernels are timed on CUDA")
    device, dtype = torch.device("cuda"), getattr(torch, args.dtype)
    peak = gpu_peak(torch.cuda.get_device_name())
    weights = "fp8 experts" if args.quantization else "experts in the dtype"
    weights += ", 128 x 128 block scales" if args.block_scales else ""
    print(f"{torch.cuda.get_device_name()}, {args.dtype}, {weights}, TP={args.tp} (rank 0's share); ms per layer")
    for name in args.shapes.split(","):
        block = (128, 128) if args.block_scales else None
        layer = moe_layer(SHAPES[name], args.tp, dtype, device, args.quantization, block)
        e = layer.experts
        print(f"\n{name}: {e.num_experts} experts, top-{layer.top_k}, hidden {e.hidden}, width {e.local} per rank")
        if args.sweep_tiles:
            for num_tokens in (int(t) for t in args.tokens.split(",")):
                chosen, chosen_ms, best = sweep(layer, num_tokens)
                fastest = "; ".join(f"{ms:.3f} ms {tiles}" for ms, tiles in best)
                print(f"{num_tokens:>7} tokens: tiles_for {chosen_ms:.3f} ms {chosen}; fastest {fastest}")
            continue
        print(
            f"{'tokens':>7}{'experts hit':>12}{'fused graph':>13}{'sort':>8}{'fused eager':>13}{'torch loop':>12}"
            f"{'every expert':>14}{'fused reads':>13}{'of peak':>9}{'rel err':>9}"
        )
        for num_tokens in (int(t) for t in args.tokens.split(",")):
            every_expert_too = num_tokens <= args.every_expert_up_to and args.quantization is None
            r = measure(layer, num_tokens, every_expert_too)
            every = f"{r['every_expert_ms']:.3f}" if r["every_expert_ms"] is not None else "-"
            share = f"{100 * r['read_bytes_per_s'] / peak.hbm_bytes_per_s:.0f}%" if peak else "-"
            print(
                f"{r['tokens']:>7}{r['experts_hit']:>12}{r['fused_graph_ms']:>13.3f}{r['sort_ms']:>8.3f}"
                f"{r['fused_eager_ms']:>13.3f}"
                f"{r['torch_loop_ms']:>12.3f}{every:>14}{r['read_bytes_per_s'] / 1e9:>9.0f} GB/s{share:>9}"
                f"{r['error']:>9.1e}"
            )
        del layer
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
