"""The paged KV store: one preallocated pool of blocks per layer. Block ids are the scheduler's.

    data: [num_layers, 2 (k, v), num_blocks, block_size, num_kv_heads, head_dim]

The worker reads and writes blocks only where a plan's block tables point; it never chooses a block.

With --kv-cache-dtype fp8 the store holds float8 e4m3 (half of bfloat16's bytes: twice the blocks in the same
memory) and one scale per layer for K and one for V (kv_scales.py): a stored element is
round_to_e4m3(clamp(x / scale, +-448)), read back as element * scale. Every writer and reader (the attention
backends' store and load) follows quantize / dequantize below; the Triton kernels do the same in their own code.
"""

from __future__ import annotations

import torch

FP8 = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8).max  # 448: e4m3fn has no infinity, so what would overflow is clamped to it
# vLLM's spellings: "fp8" is e4m3 (the format with the precision; e5m2's range is not needed with a scale).
KV_CACHE_DTYPES = {"fp8": FP8, "fp8_e4m3": FP8}


def resolve_kv_cache_dtype(name: str, model_dtype: torch.dtype) -> torch.dtype:
    """--kv-cache-dtype: "auto" is the model's dtype."""
    if name == "auto":
        return model_dtype
    if name not in KV_CACHE_DTYPES:
        raise ValueError(f"--kv-cache-dtype {name!r} is not supported (auto, {', '.join(KV_CACHE_DTYPES)})")
    return KV_CACHE_DTYPES[name]


def quantize(x: torch.Tensor, scale: float) -> torch.Tensor:
    """x in float8 e4m3 units of `scale` (round to nearest even, saturating at +-448)."""
    return (x.float() * (1.0 / scale)).clamp(-FP8_MAX, FP8_MAX).to(FP8)


def dequantize(x: torch.Tensor, scale: float, dtype: torch.dtype) -> torch.Tensor:
    return (x.float() * scale).to(dtype)


class PagedKVCache:
    def __init__(
        self,
        num_layers: int,
        num_blocks: int,
        block_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device,
        scales: list[tuple[float, float]] | None = None,
    ):
        """scales: each layer's (K scale, V scale) where dtype is float8 (kv_scales.py); None: 1.0 each."""
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.data = torch.zeros(
            num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim, dtype=dtype, device=device
        )
        self.scales = scales or [(1.0, 1.0)] * num_layers

    @property
    def quantized(self) -> bool:
        return self.data.dtype == FP8

    def layer(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.data[index, 0], self.data[index, 1]

    @staticmethod
    def bytes_per_block(num_layers: int, block_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
        return num_layers * 2 * block_size * num_kv_heads * head_dim * dtype.itemsize
