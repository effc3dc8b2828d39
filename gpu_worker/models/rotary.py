"""Rotary position embeddings, with cos/sin precomputed for every position of the context.

The inverse frequencies come from transformers' rope utilities for scaled variants (linear, llama3, yarn,
longrope), so the numbers are the checkpoint authors'; the default variant is computed here exactly as
the reference does, which keeps float32 outputs token-identical. Per-layer parameters (Gemma 3: a local
base for sliding layers, a scaled global one for the rest) are chosen by `layer_type`. With a partial
rotary factor (Phi-3 variants) only the first rotary_dim dims of each head turn.

longrope (Phi-3's "su"): transformers uses the short factors while a sequence is within
original_max_position_embeddings and the long ones once it is longer, for all of its positions: the step
that crosses the limit drops its KV cache and recomputes the sequence (Phi3ForCausalLM's
prepare_inputs_for_generation). A paged KV store keeps what it computed, so here each position has one row
instead: positions below the limit use the short factors, later ones the long. Within the original length
that is transformers' result exactly; past it, the earlier keys keep their short-factor rotation (vLLM
instead picks the long factors for a whole batch when any of its positions is past the limit, keeping
earlier keys as they were too).
"""

from __future__ import annotations

import torch
from torch import nn


def rope_parameters(config, layer_type: str | None = None) -> dict:
    """The RoPE parameters of one layer type (transformers 5 keeps per-type dicts for Gemma 3)."""
    params = getattr(config, "rope_parameters", None)
    if params:
        params = params.get(layer_type, params) if layer_type else params
        return dict(params)
    scaling = dict(getattr(config, "rope_scaling", None) or {})
    scaling.setdefault("rope_type", scaling.pop("type", "default"))
    scaling.setdefault("rope_theta", getattr(config, "rope_theta", 10000.0))
    return scaling


class RotaryEmbedding(nn.Module):
    def __init__(self, config, fused_kernels: bool = False, layer_type: str | None = None):
        super().__init__()
        self.fused_kernels = fused_kernels
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        params = rope_parameters(config, layer_type)
        factor = params.get("partial_rotary_factor", getattr(config, "partial_rotary_factor", 1.0))
        self.rotary_dim = int(head_dim * factor)
        rope_type = params.get("rope_type", "default")
        positions = torch.arange(config.max_position_embeddings, dtype=torch.float)
        by_type = {"layer_type": layer_type} if layer_type else {}
        if rope_type == "default":
            base = params["rope_theta"]
            dim = self.rotary_dim
            inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float) / dim))
            freqs, scaling = positions[:, None] * inv_freq[None, :], 1.0
        elif rope_type == "dynamic":
            raise ValueError("dynamic RoPE scaling is not supported (its frequencies depend on the batch)")
        else:
            from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

            init = ROPE_INIT_FUNCTIONS[rope_type]
            # transformers' tables are made on the CPU; the positions on the device the model is built on.
            inv_freq, scaling = init(config, torch.device("cpu"), **by_type)
            freqs = positions[:, None] * inv_freq.to(positions.device)[None, :]
            if rope_type == "longrope":
                original = params["original_max_position_embeddings"]
                long_inv_freq, _ = init(config, torch.device("cpu"), seq_len=original + 1, **by_type)
                freqs[original:] = positions[original:, None] * long_inv_freq.to(positions.device)[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        self.register_buffer("cos", emb.cos() * scaling, persistent=False)
        self.register_buffer("sin", emb.sin() * scaling, persistent=False)

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """q [T, Hq, D], k [T, Hk, D]."""
        if self.fused_kernels:  # in place, one launch for q and k
            from gpu_worker.models import triton_ops

            triton_ops.rotary(positions, q, k, self.cos, self.sin)
            return q, k
        cos = self.cos[positions].to(q.dtype)[:, None, :]  # [T, 1, R]
        sin = self.sin[positions].to(q.dtype)[:, None, :]
        if self.rotary_dim < q.shape[-1]:
            r = self.rotary_dim
            return (
                torch.cat((_rotate(q[..., :r], cos, sin), q[..., r:]), dim=-1),
                torch.cat((_rotate(k[..., :r], cos, sin), k[..., r:]), dim=-1),
            )
        return _rotate(q, cos, sin), _rotate(k, cos, sin)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    return x * cos + _rotate_half(x) * sin


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)
