"""RMSNorm as the model families write it: they differ only in where the weight is applied.

    llama   weight * (normalized, cast to the model dtype)         Llama, Mistral, Qwen, Phi-3, Mixtral
    gemma   ((1 + weight) * normalized in float32), then cast     Gemma 2 and 3 (weights stored as w - 1)
    olmo    (weight * normalized in float32), then cast           OLMo 2

With `fused` (CUDA, next to the Triton attention) the residual add and the norm are one kernel
(models/triton_ops.py) that rounds where the torch ops below do; when its only reader is an FP8 projection
(`quantize_for`, at load) the kernel also quantizes the rows it returns (models/fp8.py: QuantizedRows).
Under tensor parallelism x may come unreduced (parallel.UnreducedSum): the norm all-reduces it first, or,
fused with peer memory on CUDA, sums it in the same kernel (gpu_worker/all_reduce.py).
"""

from __future__ import annotations

from typing import Literal

import torch
from torch import nn

from gpu_worker.models import fp8
from gpu_worker.parallel import UnreducedSum

NormStyle = Literal["llama", "gemma", "olmo"]


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float, fused: bool = False, style: NormStyle = "llama"):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps
        self.fused = fused
        self.offset = 1.0 if style == "gemma" else 0.0
        self.scale_in_float32 = style != "llama"
        self.quantized_output = False

    def quantize_for(self, projection: nn.Module) -> None:
        """Called at load by the layer whose `projection` alone reads this norm's output: with the fused kernel
        and an FP8 projection, forward returns the rows quantized for it."""
        self.quantized_output = self.fused and fp8.is_quantized(projection)

    def forward(self, x: torch.Tensor | UnreducedSum, residual: torch.Tensor | None = None):
        """RMSNorm of x over its last dimension; given the residual stream, of residual + x, returned with that
        sum (the new residual stream: the fused kernel writes it into `residual`)."""
        if isinstance(x, UnreducedSum):
            peer = x.tp.peer
            if self.fused and residual is not None and peer is not None and peer.takes_rows(x.partial, residual):
                style = {"offset": self.offset, "scale_in_float32": self.scale_in_float32}
                out = peer.sum_add_rms_norm(
                    x.partial, residual, self.weight, self.eps, quantize=self.quantized_output, **style
                )
                return out, residual
            x = x.summed()
        if self.fused:
            from gpu_worker.models import triton_ops

            out: fp8.Activation
            style = {"offset": self.offset, "scale_in_float32": self.scale_in_float32}
            if self.quantized_output:
                out = triton_ops.add_rms_norm_fp8(x, self.weight, self.eps, residual, **style)
            else:
                rows = x.reshape(-1, x.shape[-1])  # per-head norms see [T, heads, D]: one row per head
                out = triton_ops.add_rms_norm(rows, self.weight, self.eps, residual, **style).view(x.shape)
            return out if residual is None else (out, residual)
        if residual is None:
            return self._norm(x)
        x = x + residual
        return self._norm(x), x

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        # The reference implementations' operation order: normalize in float32, then scale (see the table above).
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        if self.scale_in_float32:
            return (h * (self.offset + self.weight.float())).to(x.dtype)
        return self.weight * h.to(x.dtype)
