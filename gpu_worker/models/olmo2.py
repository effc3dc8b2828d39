"""OLMo 2: the Llama blocks with their norms moved after them (post-norm), and RMSNorm on the whole q and k
projections before RoPE.

    x ─▶ attention ─norm─▶ + ─▶ SwiGLU MLP ─norm─▶ + ─▶        (no norm before either block)
    └──────────────────────┘└────────────────────────┘

Norms are w * normalized in float32 ("olmo" style). The q/k norms see every head at once; with tensor
parallelism each rank holds some heads, so their mean square is summed over the ranks (one all-reduce each).
"""

from __future__ import annotations

import torch
from torch import nn

from gpu_worker.models.causal_lm import CausalLM
from gpu_worker.models.forward_context import ForwardContext
from gpu_worker.models.mlp import GatedMLP
from gpu_worker.models.norms import RMSNorm
from gpu_worker.models.rotary import RotaryEmbedding
from gpu_worker.models.self_attention import SelfAttention, head_dim_of
from gpu_worker.models.weights import TensorSource
from gpu_worker.parallel import SINGLE, TensorParallel


class WholeProjectionNorm(RMSNorm):
    """RMSNorm over a projection whose features are split across tensor-parallel ranks (whole heads each):
    this rank holds its features' weights and normalizes by the mean square over every rank's."""

    def __init__(self, full_size: int, eps: float, fused: bool, tp: TensorParallel, what: str):
        super().__init__(tp.shard(full_size, what), eps, fused and tp.size == 1, "olmo")
        self.tp = tp
        self.full_size = full_size

    def full_shape(self, name: str) -> tuple[int, ...]:
        return (self.full_size,)

    def load(self, name: str, full: TensorSource, part: None = None) -> None:
        if tuple(full.shape) != (self.full_size,):
            raise ValueError(f"checkpoint shape {tuple(full.shape)} != model shape {(self.full_size,)}")
        n = self.weight.shape[0]
        self.weight.data.copy_(full[self.tp.rank * n : (self.tp.rank + 1) * n])

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        if self.tp.size == 1:
            return super().forward(x, residual)
        h = x.float()
        square_sum = self.tp.all_reduce(h.pow(2).sum(-1, keepdim=True))
        h = h * torch.rsqrt(square_sum / self.full_size + self.eps)
        return (h * self.weight.float()).to(x.dtype)


class Olmo2DecoderLayer(nn.Module):
    def __init__(self, config, layer_index: int, rotary: RotaryEmbedding, fused_kernels: bool, tp: TensorParallel):
        super().__init__()
        h, eps = config.hidden_size, config.rms_norm_eps
        q_full = config.num_attention_heads * head_dim_of(config)
        kv_full = config.num_key_value_heads * head_dim_of(config)
        self.self_attn = SelfAttention(
            config,
            layer_index,
            rotary,
            tp,
            qkv_bias=config.attention_bias,
            o_bias=config.attention_bias,
            q_norm=WholeProjectionNorm(q_full, eps, fused_kernels, tp, "attention features"),
            k_norm=WholeProjectionNorm(kv_full, eps, fused_kernels, tp, "KV features"),
            qk_norm="whole",
        )
        self.post_attention_layernorm = RMSNorm(h, eps, fused_kernels, "olmo")
        self.mlp = GatedMLP(h, config.intermediate_size, tp, config.hidden_act, fused_kernels)
        self.post_feedforward_layernorm = RMSNorm(h, eps, fused_kernels, "olmo")

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None, positions: torch.Tensor, ctx: ForwardContext
    ) -> tuple[torch.Tensor, torch.Tensor]:
        stream = x if residual is None else x + residual
        stream = stream + self.post_attention_layernorm(self.self_attn(stream, positions, ctx))
        return self.post_feedforward_layernorm(self.mlp(stream)), stream


class Olmo2ForCausalLM(CausalLM):
    def __init__(
        self, config, fused_kernels: bool = False, tp: TensorParallel = SINGLE, quantization: str | None = None
    ):
        """quantization: unused (no experts, the only layers built quantized; models/fp8.py)."""
        rotary = RotaryEmbedding(config, fused_kernels)
        super().__init__(
            config,
            tp,
            fused_kernels,
            lambda i: Olmo2DecoderLayer(config, i, rotary, fused_kernels, tp),
            norm_style="olmo",
        )
