"""Paged attention: our Triton kernels against FlashInfer's, side by side on one GPU, one layer at a time.

    python -m benchmarks.attention_libraries [--json FILE]

Decode: one query per sequence over its paged KV (blocks of 16, scattered over the pool as the scheduler
leaves them), bf16, for head_dim 64 and 128, MHA and GQA, 1-512 sequences, contexts from W1's 64-768 to
32k. Each kernel is captured in a CUDA graph and timed by its replays (triton.testing.do_bench_cudagraph,
median), as the engine runs it; the figure is the KV bytes read per second and their share of the GPU's HBM
bandwidth (benchmarks/roofline.py). Both outputs are checked against a float32 reference first.
Prefill: one 4k and one 16k prompt (no cache), causal, against the FLOP floor.

FlashInfer (`flashinfer-python`) compiles its kernels on first use (nvcc); without it, only ours run.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import traceback
from dataclasses import dataclass

import numpy as np
import torch
import triton.testing

from benchmarks.attention_check import Shape  # (CUDA-only, as this benchmark: it stages on the GPU at import)
from benchmarks.roofline import gpu_peak
from gpu_worker.attention import triton_kernels as kernels
from gpu_worker.kv_cache import quantize

DEVICE = torch.device("cuda")
BLOCK_SIZE = 16
DTYPE = torch.bfloat16


SHAPES = (
    Shape("gpt2 (12/12x64)", 12, 12, 64),
    Shape("llama-3.2-1b (32/8x64)", 32, 8, 64),
    Shape("llama-3-8b (32/8x128)", 32, 8, 128),
)
# (sequences, context range): W1's decode, few long ones, many long ones, one very long.
DECODE_CASES = (
    (1, (400, 400)),
    (32, (400, 800)),
    (256, (64, 768)),
    (256, (400, 800)),
    (512, (400, 800)),
    (32, (4096, 4096)),
    (8, (32768, 32768)),
    (64, (8192, 8192)),
)


@dataclass
class PagedBatch:
    q: torch.Tensor  # [S, Hq, D]
    k_cache: torch.Tensor  # [blocks, BLOCK_SIZE, Hkv, D]
    v_cache: torch.Tensor
    block_tables: torch.Tensor  # [S, W] int32
    context_lens: np.ndarray
    tables: list[list[int]]

    @property
    def kv_bytes(self) -> int:
        per_token = 2 * self.k_cache.shape[2] * self.k_cache.shape[3] * self.k_cache.element_size()
        return int(self.context_lens.sum()) * per_token


def make_decode_batch(shape: Shape, num_seqs: int, contexts: tuple[int, int], rng: random.Random) -> PagedBatch:
    lens = np.array([rng.randint(*contexts) for _ in range(num_seqs)], dtype=np.int32)
    need = [-(-int(n) // BLOCK_SIZE) for n in lens]
    pool = list(range(sum(need)))
    rng.shuffle(pool)
    tables, used = [], 0
    for n in need:
        tables.append(pool[used : used + n])
        used += n
    width = max(need)
    padded = [t + [0] * (width - len(t)) for t in tables]
    gen = torch.Generator(DEVICE).manual_seed(rng.randrange(2**31))

    def rand(*size: int) -> torch.Tensor:
        return torch.randn(*size, generator=gen, device=DEVICE, dtype=torch.float32).to(DTYPE)

    cache = (len(pool), BLOCK_SIZE, shape.kv_heads, shape.head_dim)
    return PagedBatch(
        rand(num_seqs, shape.heads, shape.head_dim),
        rand(*cache),
        rand(*cache),
        torch.tensor(padded, dtype=torch.int32, device=DEVICE),
        lens,
        tables,
    )


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


def reference_decode(batch: PagedBatch, scale: float) -> torch.Tensor:
    outs = []
    group = batch.q.shape[1] // batch.k_cache.shape[2]
    for i, (n, table) in enumerate(zip(batch.context_lens, batch.tables)):
        k = batch.k_cache[table].flatten(0, 1)[:n].float().repeat_interleave(group, dim=1)  # [n, Hq, D]
        v = batch.v_cache[table].flatten(0, 1)[:n].float().repeat_interleave(group, dim=1)
        scores = torch.einsum("hd,nhd->hn", batch.q[i].float(), k) * scale
        outs.append(torch.einsum("hn,nhd->hd", scores.softmax(-1), v))
    return torch.stack(outs)


def ours_decode(batch: PagedBatch, scale: float, tiles: kernels.DecodeTiles | None = None):
    """Our decode launch, planned as the engine plans it (decode_slices on the host), ready to replay. tiles: a
    launch shape (None: the engine's, DECODE_TILES)."""
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
            batch.q,
            out,
            batch.k_cache,
            batch.v_cache,
            batch.block_tables,
            context_lens,
            scale,
            span,
            seqs,
            starts,
            merge_counts,
            tiles=tiles,
        )
        return out

    return run


def flashinfer_decode(batch: PagedBatch, scale: float, tensor_cores: bool):
    import flashinfer

    workspace = torch.empty(256 * 2**20, dtype=torch.uint8, device=DEVICE)
    wrapper = flashinfer.BatchDecodeWithPagedKVCacheWrapper(workspace, "NHD", use_tensor_cores=tensor_cores)
    indptr = torch.tensor(
        np.concatenate([[0], np.cumsum([len(t) for t in batch.tables])]), dtype=torch.int32, device=DEVICE
    )
    indices = torch.tensor([b for t in batch.tables for b in t], dtype=torch.int32, device=DEVICE)
    last = torch.tensor((batch.context_lens - 1) % BLOCK_SIZE + 1, dtype=torch.int32, device=DEVICE)
    wrapper.plan(
        indptr,
        indices,
        last,
        batch.q.shape[1],
        batch.k_cache.shape[2],
        batch.q.shape[2],
        BLOCK_SIZE,
        q_data_type=DTYPE,
        kv_data_type=batch.k_cache.dtype,
        sm_scale=scale,
    )

    def run() -> torch.Tensor:
        return wrapper.run(batch.q, (batch.k_cache, batch.v_cache))

    return run


def time_graph_ms(run) -> tuple[float, bool]:
    """Median ms of the kernel's CUDA-graph replays, or of eager launches where it cannot be captured (then
    False: the figure includes launch overhead the engine would not pay)."""
    run()  # compile / first launch outside the capture
    torch.cuda.synchronize()
    try:
        return triton.testing.do_bench_cudagraph(run, rep=200, return_mode="median"), True
    except Exception:
        torch.cuda.synchronize()
        return triton.testing.do_bench(run, return_mode="median"), False


def decode_rows(peak_bw: float, have_flashinfer: bool, shapes: tuple[Shape, ...], fp8: bool) -> list[dict]:
    """fp8: a float8 e4m3 store (scale 1), its bytes the KV read, the reference over its dequantized values."""
    rows = []
    rng = random.Random(0)
    for shape in shapes:
        for num_seqs, contexts in DECODE_CASES:
            batch = make_decode_batch(shape, num_seqs, contexts, rng)
            if fp8:
                batch = as_fp8(batch)
            scale = shape.head_dim**-0.5
            small = num_seqs * contexts[1] <= 600_000
            ref = reference_decode(dequantized(batch) if fp8 else batch, scale) if small else None
            impls = {"ours (triton)": ours_decode(batch, scale)}
            if have_flashinfer:
                impls["flashinfer"] = lambda b=batch, s=scale: flashinfer_decode(b, s, False)
                if shape.heads != shape.kv_heads:
                    impls["flashinfer (tensor cores)"] = lambda b=batch, s=scale: flashinfer_decode(b, s, True)
            for name, impl in impls.items():
                row = {"shape": shape.name, "seqs": num_seqs, "contexts": f"{contexts[0]}-{contexts[1]}", "impl": name}
                row["store"] = "fp8" if fp8 else "bf16"
                try:
                    run = impl if name.startswith("ours") else impl()
                    out = run()
                    if ref is not None:
                        row["rel_err"] = ((out.float() - ref).norm() / ref.norm()).item()
                    ms, row["graphed"] = time_graph_ms(run)
                    row |= {
                        "us": 1000 * ms,
                        "gb_per_s": batch.kv_bytes / ms / 1e6,
                        "hbm_share": batch.kv_bytes / (ms / 1000) / peak_bw,
                    }
                except Exception:
                    row["error"] = traceback.format_exc(limit=3).strip().splitlines()[-1]
                rows.append(row)
            del batch
            torch.cuda.empty_cache()
    return rows


def prefill_rows(peak_flops: float, have_flashinfer: bool) -> list[dict]:
    """One prompt of n tokens, no cache: ours (the engine's prefill kernel through TritonAttention) against
    FlashInfer's single-prefill and torch's SDPA (flash) as further references."""
    from benchmarks.attention_check import BLOCK_SIZE as CHECK_BLOCK
    from benchmarks.attention_check import build_metadata, make_batch
    from gpu_worker.attention.triton_backend import TritonAttention

    rows = []
    for shape in SHAPES[1:]:
        for n in (4096, 16384):
            batch = make_batch([(0, n)], shape, CHECK_BLOCK, DTYPE, random.Random(n))
            backend = TritonAttention(CHECK_BLOCK, shape.kv_heads, DEVICE)
            metadata = build_metadata(backend, batch.layout, batch.slots)
            scale = shape.head_dim**-0.5
            flops = 4 * shape.heads * shape.head_dim * n * (n + 1) / 2
            group = shape.heads // shape.kv_heads
            q = batch.q.transpose(0, 1).unsqueeze(0)
            k = batch.k.repeat_interleave(group, dim=1).transpose(0, 1).unsqueeze(0)
            v = batch.v.repeat_interleave(group, dim=1).transpose(0, 1).unsqueeze(0)
            impls = {
                "ours (triton)": lambda: backend.forward(
                    batch.q, batch.k, batch.v, batch.k_cache, batch.v_cache, metadata, scale
                ),
                "torch sdpa": lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True),
            }
            if have_flashinfer:
                import flashinfer

                impls["flashinfer"] = lambda: flashinfer.single_prefill_with_kv_cache(
                    batch.q, batch.k, batch.v, causal=True, sm_scale=scale
                )
            for name, run in impls.items():
                row = {"shape": shape.name, "prompt": n, "impl": name}
                try:
                    run()
                    torch.cuda.synchronize()
                    ms = triton.testing.do_bench(run, return_mode="median")
                    row |= {"ms": ms, "tflops": flops / ms / 1e9, "peak_share": flops / (ms / 1000) / peak_flops}
                except Exception:
                    row["error"] = traceback.format_exc(limit=3).strip().splitlines()[-1]
                rows.append(row)
    return rows


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", help="write the rows here")
    parser.add_argument("--parts", default="decode,prefill", help="which comparisons to run: decode, prefill")
    parser.add_argument("--shapes", default="", help="only the shapes whose names hold one of these (comma-separated)")
    parser.add_argument("--kv-store", choices=("bf16", "fp8"), default="bf16", help="decode: the KV store's dtype")
    args = parser.parse_args(argv)
    parts = set(args.parts.split(","))
    wanted = [part for part in args.shapes.split(",") if part]
    shapes = tuple(shape for shape in SHAPES if not wanted or any(part in shape.name for part in wanted))
    name = torch.cuda.get_device_name()
    peak = gpu_peak(name)
    if peak is None:
        sys.exit(f"no peak figures for {name!r} in benchmarks/roofline.py")
    try:
        import flashinfer

        have_flashinfer, version = True, flashinfer.__version__
    except Exception as exc:  # not installed, or its import fails on this machine
        have_flashinfer, version = False, f"unavailable ({type(exc).__name__}: {exc})"
    print(f"{name}; flashinfer {version}")
    fp8 = args.kv_store == "fp8"
    decode = decode_rows(peak.hbm_bytes_per_s, have_flashinfer, shapes, fp8) if "decode" in parts else []
    prefill = prefill_rows(peak.bf16_flops_per_s, have_flashinfer) if "prefill" in parts else []
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": name, "flashinfer": version, "decode": decode, "prefill": prefill}, f, indent=2)
    share = f"share of {peak.hbm_bytes_per_s / 1e12:.2f} TB/s"
    print(f"\ndecode, {args.kv_store} store (CUDA graph replays; KV read / time; {share})")
    print(f"{'shape':<24}{'seqs':>5}{'contexts':>12}  {'impl':<28}{'us':>9}{'GB/s':>8}{'HBM':>6}{'err':>9}")
    for r in decode:
        if "error" in r:
            print(f"{r['shape']:<24}{r['seqs']:>5}{r['contexts']:>12}  {r['impl']:<28}ERROR {r['error'][:60]}")
            continue
        err = f"{r['rel_err']:.1e}" if "rel_err" in r else "-"
        print(
            f"{r['shape']:<24}{r['seqs']:>5}{r['contexts']:>12}  {r['impl']:<28}{r['us']:>9.1f}"
            f"{r['gb_per_s']:>8.0f}{100 * r['hbm_share']:>5.0f}%{err:>9}"
        )
    print(f"\nprefill, one prompt (attention FLOPs / time; share of {peak.bf16_flops_per_s / 1e12:.0f} TFLOP/s)")
    for r in prefill:
        if "error" in r:
            print(f"{r['shape']:<24}{r['prompt']:>7}  {r['impl']:<16}ERROR {r['error'][:60]}")
            continue
        print(
            f"{r['shape']:<24}{r['prompt']:>7}  {r['impl']:<16}{r['ms']:>8.2f} ms{r['tflops']:>7.0f} TFLOP/s"
            f"{100 * r['peak_share']:>5.0f}%"
        )


if __name__ == "__main__":
    main()
