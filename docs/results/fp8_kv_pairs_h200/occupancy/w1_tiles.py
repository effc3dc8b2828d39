"""benchmarks.offline with the float8 store's decode tiles for 128-wide heads set from argv[1] (block_n,warps,stages)."""
import sys
from gpu_worker.attention import triton_kernels as k
b, w, s = (int(x) for x in sys.argv[1].split(","))
k.DECODE_TILES[(128, True)] = k.DecodeTiles(b, w, s, "pairs")
from benchmarks.offline import main
main(sys.argv[2:])
