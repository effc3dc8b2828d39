"""Experiment: a TMA-fed (tensor descriptors), optionally persistent and warp-specialized Triton product against
cuBLAS (F.linear, bf16) and torch._scaled_mm (fp8, row-wise), at decode row counts, the 8B's and 1B's weights.
    python tma_mm.py [--check] [--rows 128,256,512] [--json FILE]"""

import argparse
import itertools
import json

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor


@triton.jit
def _tile_of(tile, num_m, num_n, GROUP_M: tl.constexpr):
    per_group = GROUP_M * num_n
    group = tile // per_group
    first_m = group * GROUP_M
    size_m = tl.minimum(num_m - first_m, GROUP_M)
    return first_m + (tile % per_group) % size_m, (tile % per_group) // size_m


@triton.jit
def _tma_kernel(
    a_desc,
    b_desc,
    c_desc,
    a_scale_ptr,
    b_scale_ptr,
    M,
    N,
    K,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    PROGRAMS,
    SCALED: tl.constexpr,
    WS: tl.constexpr,
    FLATTEN: tl.constexpr,
):
    num_m = tl.cdiv(M, BLOCK_M)
    num_n = tl.cdiv(N, BLOCK_N)
    k_tiles = tl.cdiv(K, BLOCK_K)
    for tile in tl.range(tl.program_id(0), num_m * num_n, PROGRAMS, flatten=FLATTEN, warp_specialize=WS):
        pid_m, pid_n = _tile_of(tile, num_m, num_n, GROUP_M)
        off_m = pid_m * BLOCK_M
        off_n = pid_n * BLOCK_N
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for ki in range(k_tiles):
            a = a_desc.load([off_m, ki * BLOCK_K])
            b = b_desc.load([off_n, ki * BLOCK_K])
            acc = tl.dot(a, b.T, acc)
        if SCALED:
            rows = off_m + tl.arange(0, BLOCK_M)
            cols = off_n + tl.arange(0, BLOCK_N)
            acc = acc * tl.load(a_scale_ptr + rows, mask=rows < M, other=0.0)[:, None]
            acc = acc * tl.load(b_scale_ptr + cols, mask=cols < N, other=0.0)[None, :]
        c_desc.store([off_m, off_n], acc.to(c_desc.dtype))


def tma_matmul(a, b, cfg, a_scale=None, b_scale=None, out_dtype=torch.bfloat16, c=None):
    bm, bn, bk, warps, stages, persistent, ws = cfg
    m, k = a.shape
    n = b.shape[0]
    if c is None:
        c = torch.empty((m, n), dtype=out_dtype, device=a.device)
    tiles = triton.cdiv(m, bm) * triton.cdiv(n, bn)
    sms = torch.cuda.get_device_properties(a.device).multi_processor_count if a.is_cuda else 4
    programs = min(sms, tiles) if persistent else tiles
    a_desc = TensorDescriptor.from_tensor(a, [bm, bk])
    b_desc = TensorDescriptor.from_tensor(b, [bn, bk])
    c_desc = TensorDescriptor.from_tensor(c, [bm, bn])
    scaled = a_scale is not None
    _tma_kernel[(programs,)](
        a_desc,
        b_desc,
        c_desc,
        a_scale if scaled else a,
        b_scale if scaled else b,
        m,
        n,
        k,
        BLOCK_M=bm,
        BLOCK_N=bn,
        BLOCK_K=bk,
        GROUP_M=8,
        PROGRAMS=programs,
        SCALED=scaled,
        WS=ws,
        FLATTEN=ws,
        num_warps=warps,
        num_stages=stages,
    )
    return c


SHAPES = {
    "8b": {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)},
    "1b": {"qkv": (3072, 2048), "o": (2048, 2048), "gate_up": (16384, 2048), "down": (2048, 8192)},
}


def check():
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    torch.manual_seed(0)
    for m, n, k in [(40, 96, 128), (200, 256, 384)]:
        a = torch.randn(m, k, device=dev)
        b = torch.randn(n, k, device=dev)
        ref = a @ b.T
        dt = torch.float16 if dev == "cpu" else torch.bfloat16
        got = tma_matmul(a.to(dt), b.to(dt), (64, 64, 64, 4, 3, True, False), out_dtype=torch.float32)
        print("plain", m, n, k, ((got - ref).norm() / ref.norm()).item())
        sa = torch.rand(m, 1, device=dev) + 0.5
        sb = torch.rand(1, n, device=dev) + 0.5
        got = tma_matmul(a.to(dt), b.to(dt), (64, 64, 64, 4, 3, False, False), sa, sb, out_dtype=torch.float32)
        print("scaled", ((got - ref * sa * sb).norm() / (ref * sa * sb).norm()).item())


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--check", action="store_true")
    p.add_argument("--rows", default="128,256,512")
    p.add_argument("--models", default="8b,1b")
    p.add_argument("--dtypes", default="fp8,bf16")
    p.add_argument("--json")
    args = p.parse_args()
    if args.check:
        return check()
    check()
    from triton.testing import do_bench_cudagraph

    def bench(fn):
        return 1000 * do_bench_cudagraph(fn, rep=40, return_mode="median")

    results = []
    for dtype in args.dtypes.split(","):
        fp8 = dtype == "fp8"
        bk = 128 if fp8 else 64
        cfgs = [
            (bm, bn, bk, w, s, pers, ws)
            for bm, bn, w, s in itertools.product((64, 128), (128, 256), (4, 8), (3, 4))
            for pers, ws in ((False, False), (True, False), (True, True))
        ]
        for model in args.models.split(","):
            for name, (n, k) in SHAPES[model].items():
                w = torch.randn(n, k, device="cuda") / k**0.5
                for m in (int(r) for r in args.rows.split(",")):
                    x = torch.randn(m, k, device="cuda")
                    if fp8:
                        wq, xq = w.to(torch.float8_e4m3fn), x.to(torch.float8_e4m3fn)
                        sa = torch.ones(m, 1, device="cuda")
                        sb = torch.ones(1, n, device="cuda")

                        def base(xq=xq, wq=wq, sa=sa, sb=sb):
                            return torch._scaled_mm(xq, wq.t(), scale_a=sa, scale_b=sb, out_dtype=torch.bfloat16)

                        ref = base().float()
                    else:
                        wq, xq = w.bfloat16(), x.bfloat16()

                        def base(xq=xq, wq=wq):
                            return torch.nn.functional.linear(xq, wq)

                        ref = base().float()
                    base_us = bench(base)
                    flops = 2 * m * n * k
                    row = {"dtype": dtype, "model": model, "proj": name, "rows": m, "base_us": base_us, "tried": {}}
                    c = torch.empty(m, n, dtype=torch.bfloat16, device="cuda")
                    for cfg in cfgs:
                        try:
                            f = (
                                (lambda cfg=cfg: tma_matmul(xq, wq, cfg, sa, sb, c=c))
                                if fp8
                                else (lambda cfg=cfg: tma_matmul(xq, wq, cfg, c=c))
                            )
                            out = f().float()
                            err = ((out - ref).norm() / ref.norm()).item()
                            if err > 1e-2:
                                raise AssertionError(f"rel err {err:.3g}")
                            row["tried"][str(cfg)] = bench(f)
                        except Exception as e:
                            row["tried"][str(cfg)] = (str(e).splitlines() or [repr(e)])[0][:160]
                    timed = {kk: v for kk, v in row["tried"].items() if isinstance(v, float)}
                    best = min(timed, key=timed.get) if timed else None
                    row["best"], row["best_us"] = best, timed.get(best)
                    results.append(row)
                    print(
                        f"{dtype:5} {model} {name:8} {m:4}  base {base_us:7.1f}  best {row['best_us'] or float('nan'):7.1f} {best}"
                        f"  ({flops / (row['best_us'] or 1e9) / 1e6:.0f} TFLOP/s)",
                        flush=True,
                    )
                    if args.json:
                        with open(args.json, "w") as f:
                            json.dump(results, f)
    errs = {v for r in results for v in r["tried"].values() if isinstance(v, str)}
    print("errors:", list(errs)[:6])


if __name__ == "__main__":
    main()
