"""bf16 products with the weights cold in L2, as in a decode step (each layer its own weights): cuBLAS (F.linear)
against the plain Triton kernel's best shapes from gemm_bf16.py, µs per product over 16 layers' weights in one graph."""

import torch
import torch.nn.functional as F
import triton
from gemm_bf16 import triton_mm  # noqa: E402  (same folder)

SHAPES = {
    "1b": {"qkv": (3072, 2048), "o": (2048, 2048), "gate_up": (16384, 2048), "down": (2048, 8192)},
    "8b": {"qkv": (6144, 4096), "o": (4096, 4096), "down": (4096, 14336)},
}
CFGS = [
    (64, 128, 128, 4, 3, 8, 1),
    (64, 64, 128, 4, 4, 8, 1),
    (128, 128, 64, 8, 4, 8, 1),
    (128, 64, 128, 4, 4, 8, 2),
    (64, 128, 64, 4, 4, 8, 2),
    (16, 64, 128, 4, 4, 0, 1),
    (64, 64, 128, 4, 4, 8, 2),
]
LAYERS = 16


def per_product_us(fn, weights, x):
    def step():
        for w in weights:
            fn(x, w)

    step()
    torch.cuda.synchronize()
    return triton.testing.do_bench_cudagraph(step, rep=100, return_mode="median") * 1e3 / len(weights)


for model, prods in SHAPES.items():
    for rows in (256, 128, 32):
        for name, (n, k) in prods.items():
            x = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16)
            ws = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / 32 for _ in range(LAYERS)]
            cub = per_product_us(F.linear, ws, x)
            res = sorted(
                (per_product_us(lambda a, b, c=c: triton_mm(a, b, c), ws, x), c) for c in CFGS if k % (c[2] * c[6]) == 0
            )
            floor = max(n * k * 2 / 4.8e12, 2 * rows * n * k / 989e12) * 1e6
            print(
                f"{model} {rows:4d} rows {name:8s}: floor {floor:5.1f} us  cuBLAS cold {cub:6.1f}  Triton best {res[0][0]:6.1f} "
                f"{res[0][1]}  next {res[1][0]:6.1f} {res[1][1]}",
                flush=True,
            )
