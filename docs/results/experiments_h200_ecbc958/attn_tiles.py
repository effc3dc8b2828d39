"""Decode attention, 8B head shape at TP=1 (32/8) and TP=2 (16/4): launch shapes and the contexts' spread."""

import random

from benchmarks import attention_libraries as al
from benchmarks.attention_check import Shape
from gpu_worker.attention import triton_kernels as K

TILES = [
    (64, 4, 4),
    (64, 4, 2),
    (64, 4, 3),
    (32, 4, 2),
    (32, 4, 4),
    (64, 8, 2),
    (64, 8, 4),
    (128, 4, 2),
    (128, 8, 3),
    (32, 2, 3),
    (16, 2, 4),
]
for shape in (Shape("tp2 16/4x128", 16, 4, 128), Shape("tp1 32/8x128", 32, 8, 128)):
    for n, ctx in ((256, (64, 768)), (256, (416, 416)), (1024, (64, 768)), (64, (64, 768))):
        batch = al.make_decode_batch(shape, n, ctx, random.Random(0))
        res = []
        for t in TILES:
            try:
                ms, _ = al.time_graph_ms(al.ours_decode(batch, 128**-0.5, K.DecodeTiles(*t)))
            except Exception as e:  # out of shared memory, etc.
                print(shape.name, n, ctx, t, "failed", type(e).__name__)
                continue
            res.append((ms, t))
        res.sort()
        base = [ms for ms, t in res if t == TILES[0]][0]
        print(
            f"{shape.name:13s} {n:5d}x{str(ctx):11s} {batch.kv_bytes / 1e6:7.1f} MB  default {base * 1e3:6.1f} us "
            f"({batch.kv_bytes / base / 4.8e9:4.0%})  best {res[0][1]} {res[0][0] * 1e3:6.1f} us ({batch.kv_bytes / res[0][0] / 4.8e9:4.0%})  "
            + " ".join(f"{t[0]}/{t[1]}/{t[2]}:{ms * 1e3:.0f}" for ms, t in res[1:6]),
            flush=True,
        )
