"""Gemma 2 and Gemma 3 (text): the Llama layout with a norm on both sides of each block.

    x ──(1+w) norm─▶ attention ─(1+w) norm─▶ + ──(1+w) norm─▶ GeGLU MLP ─(1+w) norm─▶ + ─▶
    └────────────────────────────────────────┘└─────────────────────────────────────────┘

- embeddings scaled by sqrt(hidden_size); every RMSNorm is (1 + w) * normalized in float32 ("gemma" style);
- the MLP is GeGLU with tanh-approximated GELU; attention scores are scaled by query_pre_attn_scalar ** -0.5;
- layers alternate sliding-window and global attention (config.layer_types, from sliding_window_pattern);
- Gemma 2: attention scores and final logits tanh soft-capped;
- Gemma 3: RMSNorm on each head of q and k, and a RoPE table per layer type (sliding layers use
  rope_local_base_freq, global ones rope_theta and any scaling).
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
from gpu_worker.parallel import SINGLE, TensorParallel


class GemmaDecoderLayer(nn.Module):
    def __init__(self, config, layer_index: int, rotary: RotaryEmbedding, fused_kernels: bool, tp: TensorParallel):
        super().__init__()
        h, eps = config.hidden_size, config.rms_norm_eps

        def norm(size: int) -> RMSNorm:
            return RMSNorm(size, eps, fused_kernels, "gemma")

        qk_norm = config.model_type == "gemma3_text"
        self.input_layernorm = norm(h)
        self.self_attn = SelfAttention(
            config,
            layer_index,
            rotary,
            tp,
            qkv_bias=config.attention_bias,
            o_bias=config.attention_bias,
            scale=config.query_pre_attn_scalar**-0.5,
            softcap=getattr(config, "attn_logit_softcapping", None),
            q_norm=norm(head_dim_of(config)) if qk_norm else None,
            k_norm=norm(head_dim_of(config)) if qk_norm else None,
        )
        self.post_attention_layernorm = norm(h)
        self.pre_feedforward_layernorm = norm(h)
        self.mlp = GatedMLP(h, config.intermediate_size, tp, config.hidden_activation, fused_kernels)
        self.post_feedforward_layernorm = norm(h)

    def fuse_fp8_inputs(self) -> None:
        """The norms whose output one projection alone reads: before qkv_proj and before gate_up_proj."""
        self.input_layernorm.quantize_for(self.self_attn.qkv_proj)
        self.pre_feedforward_layernorm.quantize_for(self.mlp.gate_up_proj)

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None, positions: torch.Tensor, ctx: ForwardContext
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            h, residual = self.input_layernorm(x), x
        else:
            h, residual = self.input_layernorm(x, residual)
        h = self.post_attention_layernorm(self.self_attn(h, positions, ctx))
        h, residual = self.pre_feedforward_layernorm(h, residual)
        return self.post_feedforward_layernorm(self.mlp(h)), residual


class GemmaForCausalLM(CausalLM):
    def __init__(
        self, config, fused_kernels: bool = False, tp: TensorParallel = SINGLE, quantization: str | None = None
    ):
        """quantization: unused (no experts, the only layers built quantized; models/fp8.py)."""
        if getattr(config, "use_bidirectional_attention", False):
            raise ValueError("Gemma 3 with use_bidirectional_attention (an embedding model) is not supported")
        if config.model_type == "gemma3_text":  # one RoPE table per layer type, shared by the layers of that type
            tables = {kind: RotaryEmbedding(config, fused_kernels, kind) for kind in set(config.layer_types)}
            rotary_of = [tables[kind] for kind in config.layer_types]
        else:
            rotary_of = [RotaryEmbedding(config, fused_kernels)] * config.num_hidden_layers
        super().__init__(
            config,
            tp,
            fused_kernels,
            lambda i: GemmaDecoderLayer(config, i, rotary_of[i], fused_kernels, tp),
            norm_style="gemma",
            embed_scale=config.hidden_size**0.5,
            final_softcap=getattr(config, "final_logit_softcapping", None),
        )
