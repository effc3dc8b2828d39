"""RMSNorm as the model families write it: they differ only in where the weight is applied.

    llama   weight * (normalized, cast to the model dtype)         Llama, Mistral, Qwen, Phi-3, Mixtral
    gemma   ((1 + weight) * normalized in float32), then cast     Gemma 2 and 3 (weights stored as w - 1)
    olmo    (weight * normalized in float32), then cast           OLMo 2

With `fused` (CUDA, next to the Triton attention) the residual add and the norm are one kernel
(models/triton_ops.py) that rounds where the torch ops below do.
"""

from __future__ import annotations

from typing import Literal

import torch
from torch import nn

NormStyle = Literal["llama", "gemma", "olmo"]


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float, fused: bool = False, style: NormStyle = "llama"):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps
        self.fused = fused
        self.offset = 1.0 if style == "gemma" else 0.0
        self.scale_in_float32 = style != "llama"

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        """RMSNorm of x over its last dimension; given the residual stream, of residual + x, returned with that
        sum (the new residual stream: the fused kernel writes it into `residual`)."""
        if self.fused:
            from gpu_worker.models import triton_ops

            rows = x.reshape(-1, x.shape[-1])  # per-head norms see [T, heads, D]: one row per head
            out = triton_ops.add_rms_norm(
                rows, self.weight, self.eps, residual, offset=self.offset, scale_in_float32=self.scale_in_float32
            ).view(x.shape)
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
