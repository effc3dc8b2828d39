"""bf16 products of a decode step: cuBLAS (F.linear) against a plain Triton kernel over launch shapes, and split-K."""

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from gpu_worker.models.matmul_tiles import program_tile


@triton.jit
def mm(
    a_ptr,
    b_ptr,
    c_ptr,
    M,
    N,
    K,
    sam,
    sbn,
    scm,
    BM: tl.constexpr,
    BN: tl.constexpr,
    BK: tl.constexpr,
    GM: tl.constexpr,
    SPLIT: tl.constexpr,
):
    pid_m, pid_n = program_tile(tl.program_id(0), tl.cdiv(M, BM), tl.cdiv(N, BN), GM)
    split = tl.program_id(1)
    rows = pid_m * BM + tl.arange(0, BM)
    cols = pid_n * BN + tl.arange(0, BN)
    ks = tl.arange(0, BK)
    k_len = K // SPLIT
    k0 = split * k_len
    a_ptrs = a_ptr + rows.to(tl.int64)[:, None] * sam + (k0 + ks)[None, :]
    b_ptrs = b_ptr + cols.to(tl.int64)[:, None] * sbn + (k0 + ks)[None, :]
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for k in range(0, k_len, BK):
        a = tl.load(a_ptrs, mask=(rows < M)[:, None], other=0.0)
        b = tl.load(b_ptrs, mask=(cols < N)[:, None], other=0.0)
        acc = tl.dot(a, tl.trans(b), acc)
        a_ptrs += BK
        b_ptrs += BK
    c_ptrs = c_ptr + rows.to(tl.int64)[:, None] * scm + cols[None, :]
    m = (rows < M)[:, None] & (cols < N)[None, :]
    if SPLIT == 1:
        tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=m)
    else:
        tl.atomic_add(c_ptrs, acc, mask=m, sem="relaxed")


def triton_mm(a, b, cfg):
    BM, BN, BK, W, S, GM, SPLIT = cfg
    M, K = a.shape
    N = b.shape[0]
    c = torch.empty((M, N), dtype=torch.bfloat16 if SPLIT == 1 else torch.float32, device=a.device)
    if SPLIT > 1:
        c.zero_()
    mm[(triton.cdiv(M, BM) * triton.cdiv(N, BN), SPLIT)](
        a,
        b,
        c,
        M,
        N,
        K,
        a.stride(0),
        b.stride(0),
        c.stride(0),
        BM=BM,
        BN=BN,
        BK=BK,
        GM=GM,
        SPLIT=SPLIT,
        num_warps=W,
        num_stages=S,
    )
    return c if SPLIT == 1 else c.to(torch.bfloat16)


def bench(fn):
    fn()
    torch.cuda.synchronize()
    return triton.testing.do_bench_cudagraph(fn, rep=100, return_mode="median") * 1e3


SHAPES = {
    "1b": {"qkv": (3072, 2048), "o": (2048, 2048), "gate_up": (16384, 2048), "down": (2048, 8192)},
    "8b": {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)},
}
BASE = [
    (64, 64, 128, 4, 4, 8),
    (64, 128, 64, 4, 4, 8),
    (64, 128, 128, 4, 3, 8),
    (128, 64, 128, 4, 4, 8),
    (128, 128, 64, 8, 4, 8),
    (128, 128, 128, 8, 3, 8),
    (64, 256, 64, 8, 3, 8),
    (128, 256, 64, 8, 3, 8),
    (32, 64, 128, 4, 4, 8),
    (16, 64, 128, 4, 4, 0),
    (16, 128, 128, 4, 4, 0),
    (32, 128, 128, 4, 4, 0),
]
CFGS = [b + (s,) for b in BASE for s in (1, 2, 4)]


def main():
    print(len(CFGS), "configs")
    for model, prods in SHAPES.items():
        for rows in (256, 64):
            tot_cub = tot_best = 0.0
            for name, (N, K) in prods.items():
                a = torch.randn(rows, K, device="cuda", dtype=torch.bfloat16)
                b = torch.randn(N, K, device="cuda", dtype=torch.bfloat16) / 32
                cub = bench(lambda: F.linear(a, b))
                ref = F.linear(a, b).float()
                res = []
                for cfg in CFGS:
                    if cfg[0] > rows * 2 or K % (cfg[2] * cfg[6]):
                        continue
                    try:
                        out = triton_mm(a, b, cfg)
                        err = (out.float() - ref).abs().max().item()
                        if err > 0.05 * ref.abs().max().item():
                            continue
                        res.append((bench(lambda: triton_mm(a, b, cfg)), cfg))
                    except Exception:
                        pass
                res.sort()
                floor = max(N * K * 2 / 4.8e12, 2 * rows * N * K / 989e12) * 1e6
                tot_cub += cub
                tot_best += res[0][0]
                print(
                    f"{model} {rows:4d} rows {name:8s} N {N:6d} K {K:6d}: floor {floor:6.1f} us  cuBLAS {cub:6.1f}  "
                    f"best {res[0][0]:6.1f} {res[0][1]}  next {res[1][0]:6.1f} {res[1][1]}",
                    flush=True,
                )
            print(
                f"{model} {rows} rows: cuBLAS {tot_cub:.1f} us, best Triton per product {tot_best:.1f} us", flush=True
            )


if __name__ == "__main__":
    main()
