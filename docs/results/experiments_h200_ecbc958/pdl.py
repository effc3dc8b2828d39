"""Programmatic dependent launch in a CUDA graph: a chain of small Triton kernels (and GEMM -> Triton pairs), launched
plainly and with launch_pdl=True + gdc_wait, per-kernel time from graph replays."""

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

print("triton", triton.__version__, torch.__version__, torch.cuda.get_device_name())


@triton.jit
def step(x_ptr, w_ptr, y_ptr, N: tl.constexpr, PDL: tl.constexpr, EARLY: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.arange(0, N)
    w = tl.load(w_ptr + cols)  # a weight: not written by the kernel before, read before the wait
    if PDL:
        gdc_wait()
    x = tl.load(x_ptr + row * N + cols).to(tl.float32)
    if EARLY:
        gdc_launch_dependents()
    r = tl.rsqrt(tl.sum(x * x) / N + 1e-6)
    tl.store(y_ptr + row * N + cols, (x * r * w).to(tl.bfloat16))


def run(chain, rows, pdl, early, gemm):
    N = 4096
    torch.manual_seed(0)
    xs = [torch.randn(rows, N, device="cuda", dtype=torch.bfloat16) for _ in range(2)]
    w = torch.randn(N, device="cuda", dtype=torch.bfloat16)
    W = torch.randn(N, N, device="cuda", dtype=torch.bfloat16) / 64

    def body():
        for i in range(chain):
            a, b = xs[i % 2], xs[(i + 1) % 2]
            if gemm:
                torch.mm(a, W, out=b)
                a, b = b, a
            step[(rows,)](a, w, b, N=N, PDL=pdl, EARLY=early, num_warps=4, launch_pdl=pdl)
        return xs[chain % 2]

    body()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        body()
    torch.cuda.current_stream().wait_stream(s)
    with torch.cuda.graph(g):
        out = body()
    g.replay()
    torch.cuda.synchronize()
    ref = out.clone()
    st, en = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    st.record()
    for _ in range(20):
        g.replay()
    en.record()
    torch.cuda.synchronize()
    return st.elapsed_time(en) * 1e3 / 20 / chain, ref


for gemm in (False, True):
    for rows in (256, 32):
        base, ref = run(64, rows, False, False, gemm)
        pdl, out = run(64, rows, True, False, gemm)
        early, out2 = run(64, rows, True, True, gemm)
        print(
            f"gemm {gemm!s:5s} rows {rows:4d}: per {'(gemm+norm)' if gemm else 'norm'} plain {base:6.2f} us, pdl {pdl:6.2f}, "
            f"pdl+early {early:6.2f}; same result {torch.equal(ref, out)} {torch.equal(ref, out2)}",
            flush=True,
        )
