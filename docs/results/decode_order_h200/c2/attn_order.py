"""Decode attention: does the order programs launch in (longest contexts first) recover the spread contexts' loss?"""

import random

import numpy as np
import torch

from benchmarks import attention_libraries as al
from benchmarks.attention_check import Shape


def permuted(b, order):
    return al.PagedBatch(
        b.q[order].contiguous(),
        b.k_cache,
        b.v_cache,
        b.block_tables[order].contiguous(),
        b.context_lens[order],
        [b.tables[i] for i in order],
    )


shapes = (Shape("8b tp1 32/8x128", 32, 8, 128), Shape("8b tp2 16/4x128", 16, 4, 128), Shape("1b 32/8x64", 32, 8, 64))
cases = ((256, (64, 768)), (256, (400, 800)), (512, (400, 800)), (64, (64, 768)), (128, (400, 4000)))
for shape in shapes:
    for n, ctx in cases:
        b = al.make_decode_batch(shape, n, ctx, random.Random(0))
        lens = b.context_lens
        desc = list(np.argsort(-lens, kind="stable"))
        asc = desc[::-1]
        eq = al.make_decode_batch(shape, n, (int(lens.mean()),) * 2, random.Random(1))
        row = []
        ref = None
        for label, bb in (
            ("random", b),
            ("longest-first", permuted(b, desc)),
            ("shortest-first", permuted(b, asc)),
            ("equal", eq),
        ):
            run = al.ours_decode(bb, shape.head_dim**-0.5)
            if label != "equal":
                o = run().float()
                torch.cuda.synchronize()
                o = (
                    o[np.argsort(desc)]
                    if label == "longest-first"
                    else (o[np.argsort(asc)] if label == "shortest-first" else o)
                )
                if ref is None:
                    ref = o
                assert torch.allclose(o, ref, atol=2e-2), label
            ms = min(al.time_graph_ms(run)[0] for _ in range(3))
            row.append(f"{label} {ms * 1e3:6.1f} us {bb.kv_bytes / ms / 4.8e9:4.0%}")
        print(f"{shape.name:16s} {n:4d} x {str(ctx):12s} " + " | ".join(row), flush=True)
