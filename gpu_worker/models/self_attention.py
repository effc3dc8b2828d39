"""The attention block the decoder families share: fused q/k/v projection, optional q/k norms, the rotary
embedding, paged attention (with the layer's sliding window and soft-cap), the output projection.

With tensor parallelism a rank holds num_heads / N query heads and num_kv_heads / N KV heads (its KV store
holds only those); o_proj all-reduces. Sizes below are this rank's.

    q/k norms       applied                          family
    per_head        RMSNorm over each head, [T, H, D]  Qwen3, Qwen3-MoE, Gemma 3
    whole           over the whole projection [T, H*D] OLMo 2 (a norm that sees every rank's heads)
"""

from __future__ import annotations

from typing import Literal

import torch
from torch import nn

from gpu_worker.attention.base import LayerAttention
from gpu_worker.models import fp8
from gpu_worker.models.forward_context import ForwardContext
from gpu_worker.models.parallel_layers import ColumnParallelLinear, RowParallelLinear
from gpu_worker.models.rotary import RotaryEmbedding
from gpu_worker.parallel import TensorParallel, UnreducedSum

QKNorm = Literal["per_head", "whole"]


def head_dim_of(config) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def sliding_window_of(config, layer_index: int) -> int | None:
    """The layer's window as transformers applies it: per `layer_types` where the config has them (Gemma,
    Qwen2/3: a sliding_window their config already cleared unless use_sliding_window), else the config's
    sliding_window on every layer (Mistral, Mixtral, Phi-3, Qwen3-MoE)."""
    layer_types = getattr(config, "layer_types", None)
    window = getattr(config, "sliding_window", None)
    if layer_types is not None and layer_types[layer_index] != "sliding_attention":
        return None
    return window or None


class SelfAttention(nn.Module):
    def __init__(
        self,
        config,
        layer_index: int,
        rotary: RotaryEmbedding,
        tp: TensorParallel,
        *,
        qkv_bias: bool,
        o_bias: bool,
        scale: float | None = None,
        softcap: float | None = None,
        q_norm: nn.Module | None = None,
        k_norm: nn.Module | None = None,
        qk_norm: QKNorm = "per_head",
    ):
        """scale: None is head_dim ** -0.5. q_norm, k_norm: the family's norms, sized for `qk_norm`."""
        super().__init__()
        h = config.hidden_size
        self.layer_index = layer_index
        self.head_dim = head_dim_of(config)
        self.num_heads = tp.shard(config.num_attention_heads, "attention heads")
        self.num_kv_heads = tp.shard(config.num_key_value_heads, "KV heads")
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.scale = self.head_dim**-0.5 if scale is None else scale
        self.sliding_window = sliding_window_of(config, layer_index)
        self.softcap = softcap or None
        self.rotary = rotary
        q_full, kv_full = config.num_attention_heads * self.head_dim, config.num_key_value_heads * self.head_dim
        self.qkv_proj = ColumnParallelLinear(h, [q_full, kv_full, kv_full], tp, qkv_bias, "attention features")
        self.o_proj = RowParallelLinear(q_full, h, tp, o_bias, "attention features")
        self.q_norm, self.k_norm = q_norm, k_norm
        self.qk_norm = qk_norm

    @property
    def layer_attention(self) -> LayerAttention:
        return LayerAttention(
            self.num_heads, self.num_kv_heads, self.head_dim, self.scale, self.sliding_window, self.softcap
        )

    def forward(self, x: fp8.Activation, positions: torch.Tensor, ctx: ForwardContext) -> torch.Tensor | UnreducedSum:
        t = positions.shape[0]
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], -1)
        if self.q_norm is not None and self.qk_norm == "whole":
            q, k = self.q_norm(q), self.k_norm(k)
        q = q.view(t, self.num_heads, self.head_dim)
        k = k.view(t, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None and self.qk_norm == "per_head":
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = self.rotary(positions, q, k)
        k_cache, v_cache = ctx.kv_cache.layer(self.layer_index)
        attn = ctx.attention.forward(
            q,
            k,
            v.view(t, self.num_kv_heads, self.head_dim),
            k_cache,
            v_cache,
            ctx.attn_metadata,
            self.scale,
            sliding_window=self.sliding_window,
            softcap=self.softcap,
            kv_scales=ctx.kv_cache.scales[self.layer_index],
        )
        return self.o_proj(attn.reshape(t, -1))
