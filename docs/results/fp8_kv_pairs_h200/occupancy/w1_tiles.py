"""benchmarks.offline with the float8 store's decode tiles for 128-wide heads set from argv[1] (block_n,warps,stages)."""

import sys

from benchmarks.offline import main
from gpu_worker.attention import triton_kernels as k

if __name__ == "__main__":
    b, w, s = (int(x) for x in sys.argv[1].split(","))
    k.DECODE_TILES[(128, True)] = k.DecodeTiles(b, w, s, "pairs")
    main(sys.argv[2:])
