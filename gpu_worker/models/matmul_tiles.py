"""A Triton matrix product's launch shape, and the order its programs walk the output's tiles in: shared by the
fused MoE's grouped products (models/fused_moe.py) and the FP8 product (models/fp8_triton.py)."""

from __future__ import annotations

from dataclasses import dataclass

import triton
import triton.language as tl


@dataclass(frozen=True, slots=True)
class Tiles:
    block_m: int
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int
    group_m: int = 0  # programs walk GROUP_M blocks of rows across every column before the next ones; 0: all
    # How a dense product's operand tiles reach shared memory (FEEDS; the fused MoE gathers its rows: "pointers"):
    #   "pointers"  each thread's loads, addressed in registers (cp.async)
    #   "tma"       Hopper's tensor memory accelerator, from a descriptor of each operand (one program a tile)
    #   "tma_ws"    the same, persistent programs (one an SM) whose loads run in warps of their own
    #               (warp-specialized), the next tile's loads under this tile's sums
    feed: str = "pointers"

    def launch_options(self) -> dict[str, int]:
        """The launch's tile constexprs (BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M: every product kernel here takes these
        names) and its warps and stages."""
        return {
            "BLOCK_M": self.block_m,
            "BLOCK_N": self.block_n,
            "BLOCK_K": self.block_k,
            "GROUP_M": self.group_m,
            "num_warps": self.num_warps,
            "num_stages": self.num_stages,
        }


FEEDS = ("pointers", "tma", "tma_ws")


@triton.jit
def program_tile(pid, row_tiles, col_tiles, GROUP_M: tl.constexpr):
    """(row tile, column tile) of program pid. GROUP_M 0: the row tiles first, so that neighbouring programs share
    a column tile (a weight tile); else GROUP_M row tiles at a time, each across every column tile, so that the
    weight tiles a group reads stay in L2 across its rows."""
    if GROUP_M == 0:
        row_tile = pid % row_tiles
        col_tile = pid // row_tiles
    else:
        per_group = GROUP_M * col_tiles
        first = pid // per_group * GROUP_M
        rows_in_group = tl.minimum(row_tiles - first, GROUP_M)
        row_tile = first + pid % per_group % rows_in_group
        col_tile = pid % per_group // rows_in_group
    return row_tile, col_tile
