"""FP8 (float8_e4m3fn) projections, as vLLM's `--quantization fp8` on an unquantized checkpoint: each weight
quantized once, after loading, with one scale per output channel; each activation per token at every matmul
(dynamic: no calibration); embeddings and the head stay in the model's dtype.

    weight [N, K]:  w_scale[n] = max_k |w[n, k]| / 448    w_q = e4m3(w / w_scale)    (once, at load)
    x      [M, K]:  x_scale[m] = max_k |x[m, k]| / 448    x_q = e4m3(x / x_scale)    (every matmul)
    y[m, n] = x_scale[m] * w_scale[n] * sum_k x_q[m, k] * w_q[n, k]  (+ bias)

A checkpoint saved with block scales (gpu_worker/fp8_checkpoint.py) is quantized per block of [rows, inputs]
instead (quantize_blocks), each block's scale kept for each of its rows: weight_scale [N, ceil(K / inputs)] and
the layer's `weight_group` = inputs; its activations per token and group of as many inputs (vLLM's per-token-
group quantization for block-scaled checkpoints: an outlier sets the scale of its group only), and the product
scales each group of inputs' sums by both scales before they add up.

CUDA (Hopper) quantizes the activations in one Triton kernel (models/fp8_triton.py, the same bits as
quantize_rows) and runs the product as torch._scaled_mm with row-wise scales (fp8 tensor cores, float32
accumulation); the CPU runs the same quantization and multiplies the rounded values in float32, so quality
measured on a CPU is that of the same numbers. Both stay on the device: no host sync, CUDA graphs hold them.

A layer takes FP8 weights by declaring a `weight_scale` buffer (None until quantized) and computing through
`linear` (models/parallel_layers.py does, so every family built on its projections gets FP8). A tensor-parallel
rank quantizes its own shard: a column shard's channels are whole; a row shard's scales are over the rank's
slice of the inputs, and its partial sums are scaled before the all-reduce adds them.

Where a fused kernel (models/triton_ops.py) produces a projection's only input, it quantizes the rows itself
and hands the projection `QuantizedRows`: the same bits, one launch instead of two. A module that can do so
defines `fuse_fp8_inputs()`, which quantize_weights calls once the projections are FP8:

    input of        quantized by                                         in
    qkv_proj        the norm before attention (with the residual add)    Llama's and Gemma's layers
    gate_up_proj    the norm before a dense MLP (with the residual add)  Llama's and Gemma's layers
    down_proj       act(gate) * up                                       every GatedMLP (models/mlp.py)
    o_proj          `linear` (the attention output has no such kernel)   all

The mixture-of-experts experts (models/moe.py) are FP8 too, weight-only: every expert's rows quantized with
quantize_rows as they load (one scale per expert and output channel, or per block from a block-scaled
checkpoint: MoEExperts.use_weight_blocks; a Mixtral-8x7B is 93 GB in bfloat16, so
a model built whole before quantizing would not fit the GPU it fits in FP8), their activations left in the
model dtype. The fused kernel (models/fused_moe.py) converts each weight tile to the activations' dtype and
multiplies its float32 sums by the channel scales; the torch path computes the same numbers (weight_only_linear).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

FP8 = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8).max  # 448
# vLLM's floor: an all-zero row gets a tiny scale instead of 0 (whose division would give NaN).
MIN_SCALE = 1.0 / (FP8_MAX * 512.0)
QUANTIZATION_METHODS = ("fp8",)


@dataclass(frozen=True, slots=True)
class QuantizedRows:
    """An FP8 projection's input [M, K] quantized per row (by the kernel that produced it, or `linear`), or per
    row and group of inputs (quantize_activation with a group)."""

    values: torch.Tensor  # float8_e4m3fn [M, K]
    scales: torch.Tensor  # float32 [M, 1], or [M, ceil(K / group)]
    dtype: torch.dtype  # the rows' dtype before quantization: the projection's output comes back in it


# What a projection takes: the rows in the model dtype, or (FP8 projections only) quantized already.
Activation = torch.Tensor | QuantizedRows


def is_quantized(projection: nn.Module) -> bool:
    return getattr(projection, "weight_scale", None) is not None


def quantize_rows(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """t [R, K] -> (float8 [R, K], float32 scales [R, 1]) with t ~= q * scale, each row scaled so that its
    largest magnitude becomes 448."""
    t = t.float()
    # Times the reciprocal, not divided by 448: torch divides by a scalar that way on CUDA, and the Triton kernel
    # (fp8_triton.py) must round the same.
    scale = t.abs().amax(dim=-1, keepdim=True).mul_(1.0 / FP8_MAX).clamp_(min=MIN_SCALE)
    return (t / scale).clamp_(-FP8_MAX, FP8_MAX).to(FP8), scale


def quantize_blocks(t: torch.Tensor, block: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """t [R, K] -> (float8 [R, K], float32 scales [R, ceil(K / block[1])]): each block of block[0] rows by block[1]
    inputs scaled so that its largest magnitude becomes 448 (edge blocks partial), its scale repeated for each of
    its rows. On a block-scaled checkpoint's values, with blocks that line up with its own, that is its own
    scale and e4m3 values again."""
    rows, k = t.shape
    block_rows, block_cols = block
    padded = torch.zeros(-(-rows // block_rows) * block_rows, -(-k // block_cols) * block_cols, device=t.device)
    padded[:rows, :k] = t.float().abs()
    grid = padded.reshape(padded.shape[0] // block_rows, block_rows, padded.shape[1] // block_cols, block_cols)
    scale = grid.amax(dim=(1, 3)).mul_(1.0 / FP8_MAX).clamp_(min=MIN_SCALE).repeat_interleave(block_rows, dim=0)[:rows]
    return (t.float() / scale_of_each(scale, block_cols, k)).clamp_(-FP8_MAX, FP8_MAX).to(FP8), scale


def scale_of_each(scale: torch.Tensor, group: int, k: int) -> torch.Tensor:
    """Scales per row and group of `group` inputs [R, ceil(k / group)] -> each entry's scale [R, k]."""
    return scale.repeat_interleave(group, dim=1)[:, :k]


def dequantize_groups(values: torch.Tensor, scales: torch.Tensor, group: int) -> torch.Tensor:
    """float8 values [R, K] with scales per row and group of `group` inputs -> what they stand for, float32."""
    return values.float() * scale_of_each(scales, group, values.shape[1])


def quantize_activation(x: torch.Tensor, group: int = 0) -> QuantizedRows:
    """x [M, K] per token, or with `group` > 0 per token and group of `group` inputs (scales [M, ceil(K /
    group)]): one Triton kernel on CUDA, quantize_rows / quantize_blocks elsewhere (the same bits)."""
    if x.is_cuda and not group & (group - 1):  # the kernel's groups: powers of two (real checkpoints': 128)
        from gpu_worker.models import fp8_triton

        values, scales = fp8_triton.quantize_rows(x, FP8_MAX, MIN_SCALE, group)
    else:
        values, scales = quantize_blocks(x, (1, group)) if group else quantize_rows(x)
    return QuantizedRows(values, scales, x.dtype)


def _product_on_cuda(rows: QuantizedRows, weight: torch.Tensor, weight_scale: torch.Tensor, group: int) -> torch.Tensor:
    """The bfloat16 product (other model dtypes are converted from it): our Triton kernel where it measured faster
    than _scaled_mm (fp8_triton.matmul_tiles: few rows, a decode of a few requests; many, a prefill; between, for
    the weight shapes measured), and for every grouped weight (_scaled_mm scales whole rows); else _scaled_mm,
    whose second operand weight.t() is [K, N] column-major, the layout it wants."""
    from gpu_worker.models import fp8_triton, triton_matmul

    tiles = fp8_triton.matmul_tiles(rows.values.shape[0], *weight.shape, grouped=group > 0)
    if tiles is not None:
        return triton_matmul.scaled_matmul(rows.values, rows.scales, weight, weight_scale, tiles, group=group)
    return torch._scaled_mm(
        rows.values, weight.t(), scale_a=rows.scales, scale_b=weight_scale, out_dtype=torch.bfloat16
    )


def linear(
    x: Activation,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    weight_scale: torch.Tensor | None,
    group: int = 0,
):
    """x @ weight.T + bias in x's dtype: F.linear (or our Triton product for the shapes where it measured faster:
    triton_matmul.plain_tiles), or with an FP8 weight ([N, K]; weight_scale float32 [1, N], one per output
    channel) the activations quantized per token (unless they come quantized) and the product scaled back; with
    `group` > 0 (weight_scale [N, ceil(K / group)], one per channel and group of inputs) the activations per token
    and group of inputs, each group's sums scaled by both before they add up."""
    if weight_scale is None:
        assert isinstance(x, torch.Tensor), "quantized rows are only for FP8 projections"
        if x.is_cuda:  # (Triton is a CUDA build's; a CPU install may have none)
            from gpu_worker.models import triton_matmul

            tiles = triton_matmul.plain_tiles(x, weight)
            if tiles is not None:
                y = triton_matmul.matmul(x.reshape(-1, x.shape[-1]), weight, tiles).reshape(*x.shape[:-1], -1)
                return y if bias is None else y + bias
        return F.linear(x, weight, bias)
    rows = x if isinstance(x, QuantizedRows) else quantize_activation(x.reshape(-1, x.shape[-1]), group)
    if group and rows.scales.shape[1] != weight_scale.shape[1]:
        raise ValueError(f"a product with scales per {group} inputs takes its rows quantized per group too")
    if rows.values.is_cuda:
        y = _product_on_cuda(rows, weight, weight_scale, group)
    elif group:
        y = dequantize_groups(rows.values, rows.scales, group) @ dequantize_groups(weight, weight_scale, group).t()
    else:
        y = (rows.values.float() @ weight.float().t()) * rows.scales * weight_scale
    y = y.to(rows.dtype)
    if isinstance(x, torch.Tensor):
        y = y.reshape(*x.shape[:-1], -1)
    return y if bias is None else y + bias


def weight_only_linear(
    x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor | None, group: int = 0
) -> torch.Tensor:
    """x [M, K] @ weight.T in x's dtype; with an FP8 weight [N, K] and its scales [N] float32, the product of x
    and the float8 values summed in float32, times each channel's scale, then rounded: the numbers of the fused
    MoE kernel (models/fused_moe.py), whose weight tiles convert to x's dtype exactly (e4m3 fits in it). With
    `group` > 0 the scales are [N, ceil(K / group)], one per channel and group of inputs: the product of the
    dequantized weight (the kernel scales each group's sums instead: the same up to the order of the sums)."""
    if weight_scale is None:
        return F.linear(x, weight)
    if group:
        return F.linear(x.float(), dequantize_groups(weight, weight_scale, group)).to(x.dtype)
    return (F.linear(x.float(), weight.float()) * weight_scale).to(x.dtype)


def check_method(method: str, device: torch.device) -> None:
    """Refuse a method this engine does not have, or FP8 on a GPU without FP8 (before anything is built)."""
    if method not in QUANTIZATION_METHODS:
        raise ValueError(f"quantization {method!r} is not supported (choose from {', '.join(QUANTIZATION_METHODS)})")
    if device.type == "cuda" and torch.cuda.get_device_capability(device) < (8, 9):
        major, minor = torch.cuda.get_device_capability(device)
        raise ValueError(
            f"--quantization fp8 needs FP8 matmuls: a GPU of compute capability 8.9 or more, not {major}.{minor}"
        )


def quantize_weights(model: nn.Module, method: str, block: tuple[int, int] | None = None) -> None:
    """Quantize in place every layer that declares a `weight_scale` (the decoder layers' projections): its
    weight becomes float8 rows, its weight_scale their scales as one row [1, N]; with `block` (a checkpoint
    saved with scales per block of [rows, inputs]: gpu_worker/fp8_checkpoint.py), one scale per such block of
    the layer's own weight (quantize_blocks: the checkpoint's, where its parts and shards are whole blocks, as
    real models' are), kept per channel and group of block[1] inputs [N, ceil(K / block[1])], its
    `weight_group` set to block[1], and no module's inputs fused (they quantize per token). (The experts quantized
    as they loaded.)"""
    check_method(method, next(model.parameters()).device)
    for name, module in model.named_modules():
        if not hasattr(module, "weight_scale") or module.weight_scale is not None:
            continue
        weight = module.weight
        n, k = weight.shape
        if weight.is_cuda and (n % 16 or k % 16):
            raise ValueError(f"{name}: FP8 on CUDA needs both sides of a weight to be multiples of 16, not {n} x {k}")
        if block is not None:
            q, scale = quantize_blocks(weight.data, block)
            module.weight_scale, module.weight_group = scale, block[1]
        else:
            q, scale = quantize_rows(weight.data)
            module.weight_scale = scale.t().contiguous()
        module.weight = nn.Parameter(q, requires_grad=False)
    if block is not None:
        return  # the fused kernels quantize their rows per token; a grouped product takes them per group
    for module in model.modules():
        fuse = getattr(module, "fuse_fp8_inputs", None)
        if fuse is not None:
            fuse()
