"""The mixture-of-experts MLP as two grouped matmuls in Triton: each token's k (token, expert) pairs sorted by
expert, each expert's pairs padded to a whole block of rows, so that every block of rows multiplies one
expert's weights:

    pairs      ids [T, k] flattened: pair p = t * k + j is token t's j-th expert
    sort       rows [blocks * BLOCK_M]: the pairs of expert 0, padded to a multiple of BLOCK_M with the
               sentinel T * k, then expert 1's, ...; block_experts [blocks]: each block's expert (E: unused)
               (models/moe_sort.py, three launches)
    gate_up    h[p] = act(x[t] @ gate[e].T) * (x[t] @ up[e].T)      one launch, act-and-mul in its epilogue
    down       y[p] = (h[p] @ down[e].T) * weights[p]                one launch
    sum        out[t] = sum_j y[t * k + j]

CUDA-graph safe: no host reads and no shape that depends on the routing. The sort's length is the worst case
for T tokens, and the blocks past the last used one (block_experts E) return at once. Only the weights of the
experts some token picked are read.

Rounding follows the torch path (models/moe.py), which rounds to the model dtype after each projection, after
the activation, after the product, and after the routing weight: float32 results differ from it only in the
last bits of sums taken in another order (the matmuls' own, and the k experts' sum).

FP8 weights (--quantization fp8, weight-only: models/fp8.py): each weight tile is loaded as float8 (half the
bytes of bfloat16: decode steps are bound by reading them) and converted to the activations' dtype, exactly
(e4m3 values fit in bfloat16, float16 and float32); the float32 sums are multiplied by each expert's channel
scales before anything else, as fp8.weight_only_linear does on the torch path. Block-scaled experts (a checkpoint
saved so: models/moe.py use_weight_blocks) scale each tile's sums by their inputs' group before they add up.
"""

from __future__ import annotations

import dataclasses
import math

import torch
import triton
import triton.language as tl

from gpu_worker.models.matmul_tiles import Tiles, program_tile
from gpu_worker.models.moe_sort import sort_by_expert
from gpu_worker.triton_math import tanh


def tiles_for(num_pairs: int, num_experts: int) -> Tiles:
    """Decode-sized batches leave a few pairs per expert: 16-row blocks waste the least padding, and the weights'
    read dominates (long k steps; neighbouring programs share a weight tile). Past 16 pairs per expert on average,
    larger blocks reuse each weight tile, and groups of 8 blocks of rows keep their inputs in L2 while they walk
    the columns (the gathered inputs of a long prefill outgrow it)."""
    if num_pairs <= 16 * num_experts:
        return Tiles(block_m=16, block_n=64, block_k=128, num_warps=4, num_stages=4)
    return Tiles(block_m=64, block_n=128, block_k=64, num_warps=8, num_stages=3, group_m=8)


# The arguments that change with the token count are not specialized on (Triton would compile a variant per
# divisibility class, mid-serving): one kernel per model and Tiles, both built by the warm-up's steps.
@triton.jit(do_not_specialize=["num_pairs", "num_blocks"])
def _expert_matmul_kernel(
    a_ptr,
    w_ptr,
    w_scale_ptr,
    out_ptr,
    rows_ptr,
    block_experts_ptr,
    weights_ptr,
    num_pairs,
    num_blocks,
    stride_a,
    stride_we,
    stride_wn,
    stride_se,
    stride_sn,
    stride_o,
    N: tl.constexpr,
    K: tl.constexpr,
    NUM_EXPERTS: tl.constexpr,
    PAIRS_PER_A_ROW: tl.constexpr,
    GATE_UP: tl.constexpr,
    GELU: tl.constexpr,
    W_FP8: tl.constexpr,
    SCALE_GROUP: tl.constexpr,
    PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
):
    """out[p, n] for the pairs p of one block of rows and BLOCK_N columns: GATE_UP, act(a @ w[:N].T) *
    (a @ w[N:].T) with a = x[p // k]; else (a @ w.T) * weights[p] with a = h[p]. w is [E, N or 2N, K], a and w
    contiguous along K. W_FP8: w is float8 with float32 scales [E, N or 2N] (w_scale_ptr; unread otherwise), or
    with SCALE_GROUP > 0 [E, N or 2N, K / SCALE_GROUP] (row stride stride_sn; BLOCK_K divides SCALE_GROUP).
    GROUP_M: the programs' order (matmul_tiles.program_tile; 0, the blocks of rows first, lets neighbours share a
    weight tile while an expert's blocks last)."""
    block, col_block = program_tile(tl.program_id(0), num_blocks, tl.cdiv(N, BLOCK_N), GROUP_M)
    expert = tl.load(block_experts_ptr + block).to(tl.int64)
    if expert >= NUM_EXPERTS:
        return
    pairs = tl.load(rows_ptr + block * BLOCK_M + tl.arange(0, BLOCK_M))
    row_mask = pairs < num_pairs
    a_rows = (pairs // PAIRS_PER_A_ROW).to(tl.int64)
    cols = col_block * BLOCK_N + tl.arange(0, BLOCK_N)
    col_mask = cols < N
    ks = tl.arange(0, BLOCK_K)
    a_ptrs = a_ptr + a_rows[:, None] * stride_a + ks[None, :]
    # The weight tile as [BLOCK_K, BLOCK_N]: w[e, n, k] at column n, row k.
    w_ptrs = w_ptr + expert * stride_we + cols[None, :].to(tl.int64) * stride_wn + ks[:, None]
    scale_ptrs = w_scale_ptr + expert * stride_se + cols * stride_sn  # each column's scale (its first group's)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k_mask = ks < K - k0
        a = tl.load(a_ptrs + k0, mask=row_mask[:, None] & k_mask[None, :], other=0.0)
        w_mask = k_mask[:, None] & col_mask[None, :]
        w = tl.load(w_ptrs + k0, mask=w_mask, other=0.0)
        if W_FP8:
            w = w.to(a.dtype)
        if SCALE_GROUP:
            group_scale = tl.load(scale_ptrs + k0 // SCALE_GROUP, mask=col_mask, other=0.0)
            acc += tl.dot(a, w, input_precision=PRECISION) * group_scale[None, :]
        else:
            acc = tl.dot(a, w, acc, input_precision=PRECISION)
        if GATE_UP:
            up = tl.load(w_ptrs + N * stride_wn + k0, mask=w_mask, other=0.0)
            if W_FP8:
                up = up.to(a.dtype)
            if SCALE_GROUP:
                up_scale = tl.load(scale_ptrs + N * stride_sn + k0 // SCALE_GROUP, mask=col_mask, other=0.0)
                acc_up += tl.dot(a, up, input_precision=PRECISION) * up_scale[None, :]
            else:
                acc_up = tl.dot(a, up, acc_up, input_precision=PRECISION)
    if W_FP8 and not SCALE_GROUP:
        acc = acc * tl.load(scale_ptrs, mask=col_mask, other=0.0)[None, :]
        if GATE_UP:
            acc_up = acc_up * tl.load(scale_ptrs + N * stride_sn, mask=col_mask, other=0.0)[None, :]
    dtype = out_ptr.dtype.element_ty
    if GATE_UP:  # as models/triton_ops.py's act_and_mul, on the projections rounded to the model dtype
        g = acc.to(dtype).to(tl.float32)
        if GELU:
            act = 0.5 * g * (1.0 + tanh(0.7978845608028654 * (g + 0.044715 * (g * g * g))))
        else:
            act = g / (1.0 + tl.exp(-g))
        out = act.to(dtype).to(tl.float32) * acc_up.to(dtype).to(tl.float32)
    else:
        routed = tl.load(weights_ptr + pairs, mask=row_mask, other=0.0).to(tl.float32)
        out = acc.to(dtype).to(tl.float32) * routed[:, None]
    out_ptrs = out_ptr + pairs[:, None].to(tl.int64) * stride_o + cols[None, :]
    tl.store(out_ptrs, out.to(dtype), mask=row_mask[:, None] & col_mask[None, :])


def _launch(a, w, w_scale, out, rows, block_experts, weights, pairs_per_a_row, gate_up, activation, tiles, group):
    num_blocks = block_experts.numel()
    n = out.shape[1]
    grid = (num_blocks * triton.cdiv(n, tiles.block_n),)
    _expert_matmul_kernel[grid](
        a,
        w,
        w if w_scale is None else w_scale,  # a pointer the kernel never reads without FP8
        out,
        rows,
        block_experts,
        weights,
        out.shape[0],
        num_blocks,
        a.stride(0),
        w.stride(0),
        w.stride(1),
        0 if w_scale is None else w_scale.stride(0),
        0 if w_scale is None else w_scale.stride(1),
        out.stride(0),
        N=n,
        K=w.shape[2],
        NUM_EXPERTS=w.shape[0],
        PAIRS_PER_A_ROW=pairs_per_a_row,
        GATE_UP=gate_up,
        GELU=activation == "gelu_tanh",
        W_FP8=w_scale is not None,
        SCALE_GROUP=group,
        PRECISION="ieee" if a.dtype == torch.float32 else "tf32",
        **tiles.launch_options(),
        enable_fp_fusion=False,
    )


def fused_experts(
    x: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    ids: torch.Tensor,
    weights: torch.Tensor,
    activation: str = "silu",
    tiles: Tiles | None = None,
    *,
    gate_up_scale: torch.Tensor | None = None,
    down_scale: torch.Tensor | None = None,
    group: int = 0,
) -> torch.Tensor:
    """x [T, H]; gate_up [E, 2I, H] (gate rows, then up); down [E, H, I]; ids, weights [T, k] -> [T, H] in x's
    dtype: sum_j weights[t, j] * down[e] @ act_and_mul(gate_up[e] @ x[t]), e = ids[t, j]. tiles: tiles_for's
    unless given (benchmarks/moe_kernel.py --sweep-tiles). FP8 weights come with their scales, float32
    gate_up_scale [E, 2I] and down_scale [E, H], each weight's rows times its scales being the expert's; with
    group > 0, [E, 2I, ceil(H / group)] and [E, H, ceil(I / group)], a scale per row and group of inputs (the
    tiles' inputs narrowed to divide the group where they do not)."""
    num_tokens, top_k = ids.shape
    num_pairs = num_tokens * top_k
    tiles = tiles or tiles_for(num_pairs, gate_up.shape[0])
    if group and group % tiles.block_k:
        if math.gcd(group, tiles.block_k) < 16:  # tl.dot's least
            raise ValueError(f"scales per {group} inputs: no tile of 16 inputs or more divides it")
        tiles = dataclasses.replace(tiles, block_k=math.gcd(group, tiles.block_k))
    rows, block_experts = sort_by_expert(ids, gate_up.shape[0], tiles.block_m)
    x, weights = x.contiguous(), weights.flatten()
    h = torch.empty(num_pairs, down.shape[2], dtype=x.dtype, device=x.device)
    _launch(x, gate_up, gate_up_scale, h, rows, block_experts, weights, top_k, True, activation, tiles, group)
    y = torch.empty(num_pairs, down.shape[1], dtype=x.dtype, device=x.device)
    _launch(h, down, down_scale, y, rows, block_experts, weights, 1, False, activation, tiles, group)
    return y.view(num_tokens, top_k, -1).sum(dim=1)  # in float32, rounded once
