"""Decode attention (longest first): each KV head's slices in turn against a slice's KV heads together."""

import random
from dataclasses import replace

import torch

from benchmarks import attention_libraries as al
from benchmarks.attention_check import Shape
from gpu_worker.attention import triton_kernels as K

shapes = (Shape("8b tp1 32/8x128", 32, 8, 128), Shape("8b tp2 16/4x128", 16, 4, 128), Shape("1b 32/8x64", 32, 8, 64))
cases = (
    (256, (64, 768)),
    (256, (400, 800)),
    (512, (400, 800)),
    (64, (64, 768)),
    (128, (400, 4000)),
    (32, (4096, 4096)),
    (8, (32768, 32768)),
)
for shape in shapes:
    base = K.decode_tiles(shape.head_dim, False)
    for n, ctx in cases:
        b = al.make_decode_batch(shape, n, ctx, random.Random(0))
        eq = al.make_decode_batch(shape, n, (int(b.context_lens.mean()),) * 2, random.Random(1))
        row, ref = [], None
        for label, bb, tiles in (
            ("heads-in-turn", b, replace(base, seq_major=False)),
            ("seq-major", b, replace(base, seq_major=True)),
            ("equal", eq, replace(base, seq_major=False)),
        ):
            run = al.ours_decode(bb, shape.head_dim**-0.5, tiles)
            if label != "equal":
                o = run().float().clone()
                torch.cuda.synchronize()
                if ref is None:
                    ref = o
                assert torch.allclose(o, ref, atol=2e-2), label
            ms = min(al.time_graph_ms(run)[0] for _ in range(3))
            row.append(f"{label} {ms * 1e3:6.1f} us {bb.kv_bytes / ms / 4.8e9:4.0%}")
        print(f"{shape.name:16s} {n:4d} x {str(ctx):14s} " + " | ".join(row), flush=True)
