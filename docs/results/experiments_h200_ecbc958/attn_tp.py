"""Decode attention on a TP=2 rank of the 8B (16 q / 4 KV heads) against TP=1's (32 / 8): the slice policy's knobs."""

import random

import torch

from benchmarks import attention_libraries as al
from benchmarks.attention_check import Shape
from benchmarks.roofline import gpu_peak
from gpu_worker.attention import triton_kernels as K

print("peak", gpu_peak(torch.cuda.get_device_name()))
for shape in (Shape("tp2 16/4x128", 16, 4, 128), Shape("tp1 32/8x128", 32, 8, 128)):
    for n, ctx in ((256, (64, 768)), (512, (400, 800)), (64, (8192, 8192))):
        batch = al.make_decode_batch(shape, n, ctx, random.Random(0))
        scale = 128**-0.5
        for target, min_split in ((8, 256), (4, 256), (16, 256), (32, 256), (8, 10**6), (16, 128)):
            K.TARGET_PROGRAMS_PER_SM, K.MIN_SPLIT_TOKENS = target, min_split
            sl = K.decode_slices(
                batch.context_lens, shape.kv_heads, torch.cuda.get_device_properties(0).multi_processor_count
            )
            ms, _ = al.time_graph_ms(al.ours_decode(batch, scale))
            gbs = batch.kv_bytes / ms / 1e6
            print(
                f"{shape.name:14s} {n:4d}x{ctx} target {target:2d} min_split {min_split:7d}: slice_len {sl.slice_len:5d} "
                f"slices {len(sl.seqs):5d}  {ms * 1e3:7.1f} us  {gbs:6.0f} GB/s",
                flush=True,
            )
