"""benchmarks.offline with DECODE_TILES entries set from argv[1]: 'default' or 'HD,fp8|bf16=B,W,S[,P];...'."""

import sys

from gpu_worker.attention import triton_kernels as k

if sys.argv[1] != "default":
    for item in sys.argv[1].split(";"):
        key, tiles = item.split("=")
        hd, store = key.split(",")
        parts = tiles.split(",")
        k.DECODE_TILES[(int(hd), store == "fp8")] = k.DecodeTiles(
            int(parts[0]), int(parts[1]), int(parts[2]), *parts[3:]
        )
    print("DECODE_TILES", k.DECODE_TILES)
from benchmarks.offline import main

main(sys.argv[2:])
