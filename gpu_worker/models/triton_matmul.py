"""Our Triton matrix product, a [M, K] . b [N, K]^T with both operands K-major (a projection's input and weight):
FP8 with row-wise scales (models/fp8.py takes it where it measured faster than torch._scaled_mm:
fp8_triton.matmul_tiles), per channel and group of inputs (a block-scaled checkpoint's weights), or plain
bfloat16 / float16 (`matmul`, where it measured faster than cuBLAS: plain_tiles). Its launch shape and program
order are the fused MoE's (models/matmul_tiles.py); the launch shape also says how the operands' tiles are fed
(Tiles.feed): by each thread's pointers, or by Hopper's TMA from tensor descriptors, optionally persistent and
warp-specialized (row-wise or no scales; where TMA cannot describe an operand, pointers)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from gpu_worker.models.matmul_tiles import Tiles, program_tile

try:  # (Triton 3.3 on: the host's descriptor of a tensor, which the "tma" feeds take)
    from triton.tools.tensor_descriptor import TensorDescriptor
except ImportError:  # pragma: no cover - an older Triton: every product takes the pointers feed
    TensorDescriptor = None


@triton.jit
def _scaled_matmul_kernel(
    a_ptr,
    a_scale_ptr,
    b_ptr,
    b_scale_ptr,
    c_ptr,
    M,
    N,
    K,
    stride_am,
    stride_bn,
    stride_cm,
    stride_as,
    stride_bs,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    SCALED: tl.constexpr,
    SCALE_GROUP: tl.constexpr,
):
    """c [M, N] = (a [M, K] . b [N, K]^T) * a_scale [M] * b_scale [N], float32 accumulation, both operands
    K-major (as fp8 tensor cores take them). With SCALE_GROUP > 0, a_scale is [M, K / SCALE_GROUP] and b_scale
    [N, K / SCALE_GROUP] (row strides stride_as, stride_bs): each tile's products are scaled by both of their
    inputs' group before they add up (BLOCK_K divides SCALE_GROUP). SCALED False: no scales (a_scale_ptr and
    b_scale_ptr unread; bfloat16 or float16 operands). Programs in matmul_tiles.program_tile's order."""
    pid_m, pid_n = program_tile(tl.program_id(0), tl.cdiv(M, BLOCK_M), tl.cdiv(N, BLOCK_N), GROUP_M)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    ks = tl.arange(0, BLOCK_K)
    a_ptrs = a_ptr + rows.to(tl.int64)[:, None] * stride_am + ks[None, :]
    b_ptrs = b_ptr + cols.to(tl.int64)[:, None] * stride_bn + ks[None, :]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in range(0, K, BLOCK_K):
        a = tl.load(a_ptrs, mask=(rows < M)[:, None] & (ks < K - k)[None, :], other=0.0)
        b = tl.load(b_ptrs, mask=(cols < N)[:, None] & (ks < K - k)[None, :], other=0.0)
        if SCALE_GROUP:
            a_group = tl.load(a_scale_ptr + rows * stride_as + k // SCALE_GROUP, mask=rows < M, other=0.0)
            b_group = tl.load(b_scale_ptr + cols * stride_bs + k // SCALE_GROUP, mask=cols < N, other=0.0)
            acc += tl.dot(a, tl.trans(b)) * (a_group[:, None] * b_group[None, :])
        else:
            acc = tl.dot(a, tl.trans(b), acc)
        a_ptrs += BLOCK_K
        b_ptrs += BLOCK_K
    if SCALED and not SCALE_GROUP:
        acc = acc * tl.load(a_scale_ptr + rows * stride_as, mask=rows < M, other=0.0)[:, None]
        acc = acc * tl.load(b_scale_ptr + cols, mask=cols < N, other=0.0)[None, :]
    c_ptrs = c_ptr + rows.to(tl.int64)[:, None] * stride_cm + cols[None, :]
    tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=(rows < M)[:, None] & (cols < N)[None, :])


@triton.jit
def _tma_matmul_kernel(
    a_desc,
    b_desc,
    c_desc,
    a_scale_ptr,
    b_scale_ptr,
    M,
    N,
    K,
    programs,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    SCALED: tl.constexpr,
    WARP_SPECIALIZE: tl.constexpr,
):
    """_scaled_matmul_kernel's product (row-wise scales or none) with its operands' tiles loaded through tensor
    descriptors (TMA: the copy engine does the addressing and the bounds; tiles past an edge read zeros, and
    the store drops what lies past one). `programs` programs walk the output's tiles a grid apart: one a tile,
    or (WARP_SPECIALIZE) one an SM, its loads in warps of their own so the next tile's arrive under this
    tile's sums."""
    row_tiles = tl.cdiv(M, BLOCK_M)
    col_tiles = tl.cdiv(N, BLOCK_N)
    for tile in tl.range(
        tl.program_id(0), row_tiles * col_tiles, programs, flatten=WARP_SPECIALIZE, warp_specialize=WARP_SPECIALIZE
    ):
        pid_m, pid_n = program_tile(tile, row_tiles, col_tiles, GROUP_M)
        first_row = pid_m * BLOCK_M
        first_col = pid_n * BLOCK_N
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k in range(0, K, BLOCK_K):
            acc = tl.dot(a_desc.load([first_row, k]), b_desc.load([first_col, k]).T, acc)
        if SCALED:
            rows = first_row + tl.arange(0, BLOCK_M)
            cols = first_col + tl.arange(0, BLOCK_N)
            acc = acc * tl.load(a_scale_ptr + rows, mask=rows < M, other=0.0)[:, None]
            acc = acc * tl.load(b_scale_ptr + cols, mask=cols < N, other=0.0)[None, :]
        c_desc.store([first_row, first_col], acc.to(c_desc.dtype))


def _tma_feedable(*tensors: torch.Tensor) -> bool:
    """Whether TMA can describe each of these matrices: rows of contiguous entries, 16-byte aligned base and row
    stride (the copy engine's rule)."""
    return TensorDescriptor is not None and all(
        t.dim() == 2 and t.stride(1) == 1 and t.data_ptr() % 16 == 0 and t.stride(0) * t.element_size() % 16 == 0
        for t in tensors
    )


def _tma_product(
    a: torch.Tensor, b: torch.Tensor, c: torch.Tensor, tiles: Tiles, a_scale=None, b_scale=None
) -> torch.Tensor:
    """c = a . b^T (scaled per row of a and of b when the scales are given: a_scale [M] contiguous, b_scale [N]) on
    _tma_matmul_kernel, fed as tiles.feed says."""
    m, n = c.shape
    tile_count = triton.cdiv(m, tiles.block_m) * triton.cdiv(n, tiles.block_n)
    persistent = tiles.feed == "tma_ws"
    programs = min(tile_count, _multiprocessors(a.device)) if persistent else tile_count
    scaled = a_scale is not None
    if scaled:  # ([M, 1] and [1, N] as the callers keep them: one scale an entry, read in order)
        a_scale, b_scale = a_scale.reshape(-1).contiguous(), b_scale.reshape(-1).contiguous()
    _tma_matmul_kernel[(programs,)](
        TensorDescriptor.from_tensor(a, [tiles.block_m, tiles.block_k]),
        TensorDescriptor.from_tensor(b, [tiles.block_n, tiles.block_k]),
        TensorDescriptor.from_tensor(c, [tiles.block_m, tiles.block_n]),
        a_scale if scaled else a,  # (unscaled: never read)
        b_scale if scaled else b,
        m,
        n,
        a.shape[1],
        programs,
        SCALED=scaled,
        WARP_SPECIALIZE=persistent,
        **tiles.launch_options(),
    )
    return c


def _multiprocessors(device: torch.device) -> int:
    if device.type != "cuda":
        return 4  # (the interpreter: a few programs, each walking several tiles)
    return torch.cuda.get_device_properties(device).multi_processor_count


def scaled_matmul(
    a: torch.Tensor,
    a_scale: torch.Tensor,
    b: torch.Tensor,
    b_scale: torch.Tensor,
    tiles: Tiles,
    out_dtype: torch.dtype = torch.bfloat16,
    group: int = 0,
) -> torch.Tensor:
    """a float8 [M, K] with scales [M, 1], b float8 [N, K] (a weight) with scales [1, N] -> [M, N] of out_dtype:
    what torch._scaled_mm(a, b.t(), scale_a=a_scale, scale_b=b_scale) computes. With group > 0, a's scales are
    [M, ceil(K / group)] and b's [N, ceil(K / group)], one per row (channel) and `group` inputs
    (fp8.quantize_activation, fp8.quantize_blocks), a multiple of tiles.block_k."""
    if group and group % tiles.block_k:
        raise ValueError(f"scales per {group} inputs: the product's tiles of {tiles.block_k} inputs must divide it")
    if a_scale.stride(-1) != 1:
        a_scale = a_scale.contiguous()
    c = torch.empty((a.shape[0], b.shape[0]), dtype=out_dtype, device=a.device)
    return _product(a, b, c, tiles, a_scale, b_scale, group)


def _product(
    a: torch.Tensor, b: torch.Tensor, c: torch.Tensor, tiles: Tiles, a_scale=None, b_scale=None, group: int = 0
) -> torch.Tensor:
    """c = a . b^T, scaled when the scales are given (per row, or per row and `group` inputs), fed as tiles.feed
    says where TMA can describe the operands (row-wise or no scales), by pointers elsewhere."""
    if tiles.feed != "pointers" and not group and _tma_feedable(a, b, c):
        return _tma_product(a, b, c, tiles, a_scale, b_scale)
    (m, k), n = a.shape, b.shape[0]
    scaled = a_scale is not None
    grid = (triton.cdiv(m, tiles.block_m) * triton.cdiv(n, tiles.block_n),)
    _scaled_matmul_kernel[grid](
        a,
        a_scale if scaled else a,  # (unscaled: never read)
        b,
        b_scale if scaled else b,
        c,
        m,
        n,
        k,
        a.stride(0),
        b.stride(0),
        c.stride(0),
        a_scale.stride(0) if scaled else 0,
        b_scale.stride(0) if scaled else 0,
        SCALED=scaled,
        SCALE_GROUP=group,
        **tiles.launch_options(),
    )
    return c


# A table of measured launch shapes: per weight shape (N, K), (most rows, tiles or None) in increasing rows.
MeasuredTiles = dict[tuple[int, int], tuple[tuple[int, Tiles | None], ...]]

# Plain (bfloat16 / float16) products that measured faster on our kernel than on cuBLAS, per weight shape (N, K):
# for up to each row count measured, the launch shape that won, None where cuBLAS did. cuBLAS picks 128-row tiles
# for a decode batch, which leave a narrow product's grid short of the SMs (as the FP8 table found:
# fp8_triton.DECODE_ROWS). None did on an H200, pointer- or TMA-fed (`python -m benchmarks.fp8_gemm --plain`;
# docs/benchmarks.md, "Real model sizes"), so every plain product stays on cuBLAS.
PLAIN_DECODE_ROWS: MeasuredTiles = {}


def measured_tiles(table: MeasuredTiles, rows: int, n: int, k: int) -> Tiles | None:
    """The entry of the least row count measured at or above `rows` for an [n, k] weight; None where that entry is
    None, past the last one, or for a shape not in the table."""
    for most_rows, tiles in table.get((n, k), ()):
        if rows <= most_rows:
            return tiles
    return None


def plain_tiles(x: torch.Tensor, weight: torch.Tensor) -> Tiles | None:
    """The launch shape `matmul` takes for x [..., K] . weight [N, K]^T, or None for cuBLAS (F.linear): only
    bfloat16 and float16 on CUDA, for the weight shapes and row counts PLAIN_DECODE_ROWS holds."""
    if not x.is_cuda or x.dtype not in (torch.bfloat16, torch.float16):
        return None
    return measured_tiles(PLAIN_DECODE_ROWS, x.numel() // x.shape[-1], *weight.shape)


def matmul(a: torch.Tensor, b: torch.Tensor, tiles: Tiles) -> torch.Tensor:
    """a [M, K] . b [N, K]^T (bfloat16 or float16, b a weight) -> [M, N] in a's dtype, float32 sums: F.linear's
    product on our kernel."""
    if a.stride(1) != 1:
        a = a.contiguous()
    return _product(a, b, torch.empty((a.shape[0], b.shape[0]), dtype=a.dtype, device=a.device), tiles)
