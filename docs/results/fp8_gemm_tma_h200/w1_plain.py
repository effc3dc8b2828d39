"""benchmarks.offline with triton_matmul.PLAIN_DECODE_ROWS built from an fp8_gemm --plain JSON (argv[1]): per weight
shape and row count, the fastest plain launch shape where it beat F.linear by > 3 %, else None; 'none': as committed."""

import json
import sys

from gpu_worker.models import triton_matmul
from gpu_worker.models.matmul_tiles import Tiles

if sys.argv[1] != "none":
    best = {}
    with open(sys.argv[1]) as f:
        rows = json.load(f)["rows"]
    for r in rows:
        if not r["product"].endswith("(bf16)") or "triton_us" not in r:
            continue
        key = ((r["n"], r["k"]), r["tokens"])
        if key not in best or r["triton_us"] < best[key][0]:
            best[key] = (r["triton_us"], Tiles(**r["tiles"]), r["f_linear_us"])
    table = {}
    for (shape, rows), (us, tiles, ref) in sorted(best.items()):
        table.setdefault(shape, []).append((rows, tiles if us < ref / 1.03 else None))
    triton_matmul.PLAIN_DECODE_ROWS = {k: tuple(v) for k, v in table.items()}
    print("PLAIN_DECODE_ROWS", triton_matmul.PLAIN_DECODE_ROWS)
from benchmarks.offline import main

main(sys.argv[2:])
