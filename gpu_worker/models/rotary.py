"""Rotary position embeddings, with cos/sin precomputed for every position of the context.

The inverse frequencies come from transformers' rope utilities for scaled variants (linear, llama3, yarn,
longrope), so the numbers are the checkpoint authors'; the default variant is computed here exactly as
the reference does, which keeps float32 outputs token-identical.
"""

from __future__ import annotations

import torch
from torch import nn


def _rope_parameters(config) -> dict:
    params = getattr(config, "rope_parameters", None)
    if params:
        return dict(params)
    scaling = dict(getattr(config, "rope_scaling", None) or {})
    scaling.setdefault("rope_type", scaling.pop("type", "default"))
    scaling.setdefault("rope_theta", getattr(config, "rope_theta", 10000.0))
    return scaling


class RotaryEmbedding(nn.Module):
    def __init__(self, config, fused_kernels: bool = False):
        super().__init__()
        self.fused_kernels = fused_kernels
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        params = _rope_parameters(config)
        rope_type = params.get("rope_type", "default")
        if rope_type == "default":
            base = params["rope_theta"]
            inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float) / head_dim))
            scaling = 1.0
        elif rope_type == "dynamic":
            raise ValueError("dynamic RoPE scaling is not supported (its frequencies depend on the batch)")
        else:
            from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

            inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](config, torch.device("cpu"))
        positions = torch.arange(config.max_position_embeddings, dtype=torch.float)
        freqs = positions[:, None] * inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        self.register_buffer("cos", emb.cos() * scaling, persistent=False)
        self.register_buffer("sin", emb.sin() * scaling, persistent=False)

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if self.fused_kernels:  # in place, one launch for q and k
            from gpu_worker.models import triton_ops

            triton_ops.rotary(positions, q, k, self.cos, self.sin)
            return q, k
        cos = self.cos[positions].to(q.dtype)[:, None, :]  # [T, 1, D]
        sin = self.sin[positions].to(q.dtype)[:, None, :]
        return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)
