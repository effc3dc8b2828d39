"""Compile our decode kernel for sm_90 on a CPU (no GPU: Triton's bundled ptxas) and count its main loop's SASS
by opcode, as docs/benchmarks.md's "16-bit pairs" counted it. Use the device's Triton for its code (3.6 there):

    pip install --no-deps --target /tmp/t36site triton==3.6.0
    PYTHONPATH=/tmp/t36site:. python docs/results/fp8_kv_pairs_h200/sass_count.py fp8 [BLOCK_N WARPS STAGES PRODUCTS]

Prints the registers and shared memory (cuobjdump), the loop's instruction count and its opcodes by count (the
loop: the longest backward branch). Shapes: the 8B's heads (GROUP 4, head dim 128), block size 16."""

from __future__ import annotations

import collections
import os
import re
import subprocess
import sys
import tempfile

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from gpu_worker.attention import triton_kernels as kernels

POINTERS = {
    "q_ptr": "*bf16",
    "out_ptr": "*bf16",
    "part_out_ptr": "*fp32",
    "part_lse_ptr": "*fp32",
    **{name: "*i32" for name in ("block_tables_ptr", "context_lens_ptr", "decode_span_ptr")},
    **{name: "*i32" for name in ("slice_seqs_ptr", "slice_starts_ptr", "merge_counts_ptr")},
}
ALIGNED = ("stride_qt", "stride_qh", "stride_ot", "stride_oh", "stride_cb", "stride_cs", "stride_ch")


def compile_decode(fp8: bool, tiles: kernels.DecodeTiles):
    fn = kernels._decode_kernel
    cache = "*fp8e4nv" if fp8 else "*bf16"
    signature = {name: "i32" for name in fn.arg_names} | POINTERS
    signature |= {"k_cache_ptr": cache, "v_cache_ptr": cache, "qk_scale": "fp32", "softcap": "fp32", "v_scale": "fp32"}
    constants = dict(
        GROUP=4, GROUP_PAD=16, BLOCK_SIZE=16, HEAD_DIM=128, HEAD_DIM_PAD=128, BLOCK_N=tiles.block_n, SLIDING=False,
        SOFTCAP=False, FP8=fp8, FP8_PAIRS=fp8 and tiles.fp8_products == "pairs", FP8_ASM=True, SEQ_MAJOR=True,
    )  # fmt: skip
    signature |= {name: "constexpr" for name in constants}
    signature = {name: signature[name] for name in fn.arg_names}
    attrs = {
        (i,): [["tt.divisibility", 16]]
        for i, name in enumerate(fn.arg_names)
        if signature[name].startswith("*") or name in ALIGNED
    }
    options = dict(num_warps=tiles.num_warps, num_stages=tiles.num_stages)
    return triton.compile(ASTSource(fn, signature, constants, attrs), target=GPUTarget("cuda", 90, 32), options=options)


def main() -> None:
    fp8 = sys.argv[1] == "fp8"
    tiles = kernels.decode_tiles(128, fp8)
    if len(sys.argv) > 2:
        block_n, warps, stages, products = sys.argv[2:6]
        tiles = kernels.DecodeTiles(int(block_n), int(warps), int(stages), products)
    compiled = compile_decode(fp8, tiles)
    tools = os.path.join(os.path.dirname(triton.__file__), "backends/nvidia/bin")
    with tempfile.TemporaryDirectory() as folder:
        cubin = os.path.join(folder, "kernel.cubin")
        with open(cubin, "wb") as f:
            f.write(compiled.asm["cubin"])
        sass = subprocess.run([f"{tools}/nvdisasm", "-c", cubin], capture_output=True, text=True).stdout
        usage = subprocess.run([f"{tools}/cuobjdump", "-res-usage", cubin], capture_output=True, text=True).stdout
    print(tiles, re.findall(r"REG:\d+", usage), "dynamic shared", compiled.metadata.shared)
    labels, pending, instructions = {}, [], []
    for line in sass.splitlines():
        label = re.match(r"\s*(\.L_x_\d+):", line)
        if label:
            pending.append(label.group(1))
            continue
        found = re.search(r"/\*([0-9a-f]{4,})\*/\s+(@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]+)", line)
        if found:
            address = int(found.group(1), 16)
            labels.update({name: address for name in pending})
            pending = []
            instructions.append((address, found.group(3), line))
    branches = [
        (address - labels[target.group(1)], labels[target.group(1)], address)
        for address, op, line in instructions
        if op.startswith("BRA")
        and (target := re.search(r"`\((\.L_x_\d+)\)", line))
        and labels[target.group(1)] < address
    ]
    _, first, last = max(branches)
    loop = collections.Counter(op for address, op, _ in instructions if first <= address <= last)
    print("loop instructions", sum(loop.values()), sorted(loop.items(), key=lambda item: -item[1])[:30])


if __name__ == "__main__":
    main()
