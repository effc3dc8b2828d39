"""Checks the Triton attention backend against the torch reference on CUDA, then times both.

    python -m benchmarks.attention_check

1. Correctness: random mixed batches (prefill chunks with and without cached context, short and long
   decodes, MHA and GQA, several block sizes and head dims) in bfloat16 and float32. The reference runs
   in float32 on the same (upcast) inputs; the error is ||out - ref|| / ||ref||, which must stay under
   1e-2 (bfloat16) and 1e-4 (float32). The new K/V must land in the store bit for bit.
2. Speed (triton.testing.do_bench, median), one layer's attention call including the K/V store, for
   GPT-2-small-like (12 heads, dim 64) and Llama-like (32 q / 8 kv heads, dim 128) shapes, block 16:
   256 decodes at contexts 64-768, 32 decodes at 4096, and 8 prompts of ~4096 tokens in all, half of
   them after 256 cached tokens. Also: decode time per forced split count (is the heuristic's pick
   good?) and the Triton K/V store against two index_copy_ calls.

Every case runs on its own: a failure is printed with its traceback and the run goes on; the exit
status is 1 if anything failed.
"""

from __future__ import annotations

import random
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass

import torch
import triton.testing

from gpu_worker.attention import BatchLayout, TorchAttention
from gpu_worker.attention import triton_kernels as kernels
from gpu_worker.attention.triton_backend import TritonAttention
from gpu_worker.host_copy import StagingRing

DEVICE = torch.device("cuda")
STAGING = StagingRing(DEVICE, 1 << 24)


def build_metadata(backend, layout, slots: torch.Tensor):
    STAGING.next_step()
    return backend.build_metadata(layout, slots.cpu().numpy(), STAGING.upload)


BLOCK_SIZE = 16


@dataclass(frozen=True)
class Shape:
    name: str
    heads: int
    kv_heads: int
    head_dim: int


GPT2 = Shape("gpt2-small", 12, 12, 64)
LLAMA = Shape("llama-gqa", 32, 8, 128)


@dataclass
class Batch:
    layout: BatchLayout
    slots: torch.Tensor  # [T] on the host, as the model runner passes it
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    k_cache: torch.Tensor
    v_cache: torch.Tensor

    def to(self, dtype: torch.dtype) -> Batch:
        return Batch(
            self.layout, self.slots, *(t.to(dtype) for t in (self.q, self.k, self.v, self.k_cache, self.v_cache))
        )


def make_batch(
    seqs: list[tuple[int, int]], shape: Shape, block_size: int, dtype: torch.dtype, rng: random.Random
) -> Batch:
    """seqs: (cached tokens, new tokens) per sequence, multi-token first; blocks scattered over the pool."""
    context_lens = [cached + new for cached, new in seqs]
    need = [-(-n // block_size) for n in context_lens]
    pool = list(range(sum(need) + 8))
    rng.shuffle(pool)
    tables, slots, used = [], [], 0
    for (cached, new), n in zip(seqs, need):
        table = pool[used : used + n]
        used += n
        tables.append(table)
        slots += [table[p // block_size] * block_size + p % block_size for p in range(cached, cached + new)]
    query_lens = [new for _, new in seqs]
    layout = BatchLayout.build(query_lens, context_lens, tables, block_size)
    gen = torch.Generator(DEVICE).manual_seed(rng.randrange(2**31))

    def rand(*size: int) -> torch.Tensor:
        return torch.randn(*size, generator=gen, device=DEVICE, dtype=torch.float32).to(dtype)

    t = len(slots)
    cache_shape = (len(pool), block_size, shape.kv_heads, shape.head_dim)
    return Batch(
        layout,
        torch.tensor(slots),
        rand(t, shape.heads, shape.head_dim),
        rand(t, shape.kv_heads, shape.head_dim),
        rand(t, shape.kv_heads, shape.head_dim),
        rand(*cache_shape),
        rand(*cache_shape),
    )


def run(backend, batch: Batch, scale: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    k_cache, v_cache = batch.k_cache.clone(), batch.v_cache.clone()
    metadata = build_metadata(backend, batch.layout, batch.slots)
    out = backend.forward(batch.q, batch.k, batch.v, k_cache, v_cache, metadata, scale)
    return out, k_cache, v_cache


# ------------------------------------------------------------------------------------- correctness


def random_mixed(rng: random.Random) -> list[tuple[int, int]]:
    prefill = [(rng.choice([0, 0, rng.randint(1, 600)]), rng.randint(2, 400)) for _ in range(rng.randint(1, 5))]
    decode = [(rng.randint(0, 2500), 1) for _ in range(rng.randint(1, 40))]
    return prefill + decode


def check_cases() -> list[tuple[str, Shape, int, list[tuple[int, int]]]]:
    rng = random.Random(0)
    cases = []
    # Each (shape, block size, dtype) compiles its own kernels: few combinations keep the run short.
    for shape, block_size in (
        (GPT2, 16),
        (LLAMA, 16),
        (Shape("gqa-dim80", 8, 2, 80), 1),
        (Shape("mqa-dim32", 8, 1, 32), 64),
    ):
        cases.append((f"mixed bs={block_size}", shape, block_size, random_mixed(rng)))
    # Few long decodes: the split-KV path (with empty slices for the shorter context).
    cases.append(("long decodes", LLAMA, 16, [(4000, 1), (3000, 1), (100, 1)]))
    cases.append(("long decodes", GPT2, 32, [(8191, 1), (2047, 1)]))
    cases.append(("prefill only", LLAMA, 16, [(0, 1000), (256, 700), (5, 2)]))
    return cases


def check_one(
    seqs: list[tuple[int, int]], shape: Shape, block_size: int, dtype: torch.dtype, rng: random.Random
) -> float:
    batch = make_batch(seqs, shape, block_size, dtype, rng)
    scale = shape.head_dim**-0.5
    out, k_cache, v_cache = run(TritonAttention(block_size, shape.kv_heads, DEVICE), batch, scale)
    ref, ref_k, ref_v = run(TorchAttention(block_size), batch.to(torch.float32), scale)
    if not (torch.equal(k_cache.float(), ref_k) and torch.equal(v_cache.float(), ref_v)):
        raise AssertionError("the KV store differs from the reference's after writing the new tokens")
    return ((out.float() - ref).norm() / ref.norm()).item()


def run_checks(failures: list[str]) -> None:
    limits = {torch.bfloat16: 1e-2, torch.float32: 1e-4}
    print(f"{'case':<16}{'shape':<12}{'seqs':>5}{'tokens':>7}{'dtype':>10}{'rel err':>11}")
    rng = random.Random(1)
    for name, shape, block_size, seqs in check_cases():
        for dtype, limit in limits.items():
            label = f"{name} / {shape.name} / {dtype}"
            try:
                err = check_one(seqs, shape, block_size, dtype, rng)
            except Exception:
                failures.append(label)
                print(f"ERROR {label}:\n{traceback.format_exc()}")
                continue
            verdict = "" if err <= limit else f"  FAIL (limit {limit:g})"
            if verdict:
                failures.append(label)
            print(
                f"{name:<16}{shape.name:<12}{len(seqs):>5}{sum(n for _, n in seqs):>7}"
                f"{str(dtype).removeprefix('torch.'):>10}{err:>11.2e}{verdict}"
            )


# ------------------------------------------------------------------------------------------- speed

SPLIT_SWEEP = "decode 32 x 4096"  # few sequences, long contexts: where splitting the context matters


def workloads(rng: random.Random) -> dict[str, list[tuple[int, int]]]:
    prompt_lens = [rng.randint(256, 768) for _ in range(8)]
    prompt_lens[-1] += 4096 - sum(prompt_lens)
    return {
        "decode 256 x 64-768": [(rng.randint(64, 768) - 1, 1) for _ in range(256)],
        SPLIT_SWEEP: [(4095, 1)] * 32,
        "prefill 8 x ~512": [(256 if i % 2 else 0, n) for i, n in enumerate(prompt_lens)],
    }


def bench_ms(fn: Callable[[], object]) -> float:
    return triton.testing.do_bench(fn, return_mode="median")


def throughput(seqs: list[tuple[int, int]], shape: Shape, dtype: torch.dtype, ms: float) -> str:
    """Decode: KV bytes read per second; prefill: attention FLOP/s (causal part counted once)."""
    if all(new == 1 for _, new in seqs):
        size = torch.tensor([], dtype=dtype).element_size()
        read = sum(c + n for c, n in seqs) * 2 * shape.kv_heads * shape.head_dim * size
        return f"{read / ms / 1e6:8.0f} GB/s"
    pairs = sum(new * cached + new * (new + 1) / 2 for cached, new in seqs)
    return f"{4 * pairs * shape.heads * shape.head_dim / ms / 1e9:6.1f} TFLOP/s"


def time_backend(backend, batch: Batch, scale: float) -> tuple[float, float]:
    """(forward ms on the GPU, build_metadata ms on the host, copy queued)."""
    metadata = build_metadata(backend, batch.layout, batch.slots)
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(20):
        build_metadata(backend, batch.layout, batch.slots)
    host_ms = (time.perf_counter() - start) / 20 * 1e3
    ms = bench_ms(lambda: backend.forward(batch.q, batch.k, batch.v, batch.k_cache, batch.v_cache, metadata, scale))
    return ms, host_ms


def run_speed(failures: list[str]) -> list[str]:
    rows = []
    rng = random.Random(2)
    dtype = torch.bfloat16
    for shape in (GPT2, LLAMA):
        for name, seqs in workloads(rng).items():
            label = f"{name} / {shape.name}"
            try:
                batch = make_batch(seqs, shape, BLOCK_SIZE, dtype, rng)
                scale = shape.head_dim**-0.5
                torch_ms, torch_host = time_backend(TorchAttention(BLOCK_SIZE), batch, scale)
                triton_ms, triton_host = time_backend(TritonAttention(BLOCK_SIZE, shape.kv_heads, DEVICE), batch, scale)
            except Exception:
                failures.append(label)
                print(f"ERROR timing {label}:\n{traceback.format_exc()}")
                continue
            rows.append(
                f"{name:<22}{shape.name:<12}{torch_ms:>10.3f}{triton_ms:>10.3f}{torch_ms / triton_ms:>9.1f}x"
                f"{torch_host:>9.2f}{triton_host:>9.2f}   {throughput(seqs, shape, dtype, triton_ms)}"
            )
            if name == SPLIT_SWEEP:
                sweep_splits(batch, shape, failures)
    return rows


def sweep_splits(batch: Batch, shape: Shape, failures: list[str]) -> None:
    """Decode time per forced slice length, next to the length decode_slices picks."""
    try:
        backend = TritonAttention(BLOCK_SIZE, shape.kv_heads, DEVICE)
        metadata = build_metadata(backend, batch.layout, batch.slots)
        contexts = batch.layout.context_lens
        picked = backend.decode_slices(contexts).slice_len
        out = torch.empty_like(batch.q)
        times = []
        for slice_len in (64, 128, 256, 512, 1024, 4096, 1 << 20):
            slices = kernels.decode_slices(contexts, shape.kv_heads, backend.num_sms, slice_len=slice_len)
            span, seqs, starts = (
                torch.tensor(values, dtype=torch.int32, device=DEVICE)
                for values in ([0, 0, len(contexts), slice_len], slices.seqs, slices.starts)
            )
            ms = bench_ms(
                lambda: kernels.decode_attention(
                    batch.q,
                    out,
                    batch.k_cache,
                    batch.v_cache,
                    metadata.block_tables,
                    metadata.context_lens,
                    0.1,
                    span,
                    seqs,
                    starts,
                    metadata.decode_merge_counts,
                )
            )
            times.append(f"{slice_len}:{ms * 1e3:.0f}us")
        print(
            f"slice sweep {shape.name}, {len(contexts)} x {int(contexts.max())} "
            f"(decode_slices picks {picked}): " + "  ".join(times)
        )
    except Exception:
        failures.append(f"split sweep / {shape.name}")
        print(f"ERROR split sweep {shape.name}:\n{traceback.format_exc()}")


def compare_kv_store(failures: list[str]) -> None:
    for shape in (GPT2, LLAMA):
        for tokens in (256, 4096):
            try:
                batch = make_batch([(0, 1)] * tokens, shape, BLOCK_SIZE, torch.bfloat16, random.Random(3))
                slots = batch.slots.to(DEVICE)
                k_flat = batch.k_cache.view(-1, shape.kv_heads, shape.head_dim)
                v_flat = batch.v_cache.view(-1, shape.kv_heads, shape.head_dim)

                def index_copy() -> None:
                    k_flat.index_copy_(0, slots, batch.k)
                    v_flat.index_copy_(0, slots, batch.v)

                ours = bench_ms(lambda: kernels.store_kv(batch.k, batch.v, batch.k_cache, batch.v_cache, slots))
                theirs = bench_ms(index_copy)
                print(
                    f"K/V store {shape.name}, {tokens} tokens: triton {ours * 1e3:.1f}us, "
                    f"2x index_copy_ {theirs * 1e3:.1f}us"
                )
            except Exception:
                failures.append(f"kv store / {shape.name}")
                print(f"ERROR K/V store {shape.name}:\n{traceback.format_exc()}")


def main() -> None:
    if not torch.cuda.is_available():
        sys.exit("attention_check needs a CUDA device")
    torch.backends.cuda.matmul.allow_tf32 = False  # the float32 reference must be float32
    print(f"{torch.cuda.get_device_name(DEVICE)}, torch {torch.__version__}\n\n== correctness")
    failures: list[str] = []
    run_checks(failures)
    print("\n== speed (bfloat16, one layer, median)")
    rows = run_speed(failures)
    compare_kv_store(failures)
    print(
        f"\n{'workload':<22}{'shape':<12}{'torch ms':>10}{'triton ms':>10}{'speedup':>10}"
        f"{'host ms':>9}{'host ms':>9}   triton throughput"
    )
    print(f"{'':<64}{'torch':>9}{'triton':>9}")
    print("\n".join(rows))
    if failures:
        print(f"\n{len(failures)} FAILED: " + "; ".join(failures))
        sys.exit(1)
    print("\nall checks passed")


if __name__ == "__main__":
    main()
