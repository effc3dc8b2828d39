"""The Llama family: pre-norm decoder layers of RMSNorm, grouped-query attention with RoPE, and a SwiGLU
MLP. Its variants differ in a few settings, read from the config here:

    family       differences from Llama
    mistral      sliding window on every layer (config.sliding_window)
    qwen2        q/k/v bias; sliding window on the layers layer_types marks
    qwen3        RMSNorm on each head of q and k before RoPE; sliding layers as Qwen2
    phi3         q|k|v and gate|up stored fused in the checkpoint; partial rotary and longrope scaling
                 where configured; sliding window on every layer
    mixtral      the MLP is a mixture of experts: top-2 of 8, renormalized (models/moe.py)
    qwen3_moe    qwen3's attention; a mixture of experts on every decoder_sparse_step-th layer not in
                 mlp_only_layers, renormalized only with norm_topk_prob, the rest dense

With `fused_kernels` (CUDA, next to the Triton attention) RMSNorm with its residual add, the rotary embedding
and act(gate) * up are one kernel each (models/triton_ops.py), and the experts run as grouped matmuls
(models/fused_moe.py); otherwise the torch ops run, the reference that float32 outputs are checked against.
With FP8 projections too, the norms before qkv and gate_up quantize their output for them (fuse_fp8_inputs).
"""

from __future__ import annotations

import torch
from torch import nn

from gpu_worker.models.causal_lm import CausalLM
from gpu_worker.models.forward_context import ForwardContext
from gpu_worker.models.mlp import GatedMLP
from gpu_worker.models.moe import SparseMoE
from gpu_worker.models.norms import RMSNorm
from gpu_worker.models.rotary import RotaryEmbedding
from gpu_worker.models.self_attention import SelfAttention, head_dim_of
from gpu_worker.parallel import SINGLE, TensorParallel

PER_HEAD_QK_NORM = ("qwen3", "qwen3_moe")


def llama_mlp(config, layer_index: int, tp: TensorParallel, fused: bool, quantization: str | None) -> nn.Module:
    h, act = config.hidden_size, config.hidden_act
    if config.model_type == "mixtral":
        return SparseMoE(
            h,
            config.intermediate_size,
            config.num_local_experts,
            config.num_experts_per_tok,
            tp,
            act,
            fused=fused,
            renormalize=True,
            weights_in_model_dtype=False,
            quantization=quantization,
        )
    if config.model_type == "qwen3_moe" and _is_sparse_layer(config, layer_index):
        return SparseMoE(
            h,
            config.moe_intermediate_size,
            config.num_experts,
            config.num_experts_per_tok,
            tp,
            act,
            fused=fused,
            renormalize=config.norm_topk_prob,
            weights_in_model_dtype=True,
            quantization=quantization,
        )
    return GatedMLP(h, config.intermediate_size, tp, act, fused, bias=getattr(config, "mlp_bias", False))


def _is_sparse_layer(config, layer_index: int) -> bool:
    """Qwen3-MoE's rule (transformers' Qwen3MoeDecoderLayer)."""
    return (
        layer_index not in (config.mlp_only_layers or [])
        and config.num_experts > 0
        and (layer_index + 1) % config.decoder_sparse_step == 0
    )


class LlamaDecoderLayer(nn.Module):
    def __init__(
        self,
        config,
        layer_index: int,
        rotary: RotaryEmbedding,
        fused_kernels: bool,
        tp: TensorParallel,
        quantization: str | None,
    ):
        super().__init__()
        h, eps = config.hidden_size, config.rms_norm_eps
        attention_bias = getattr(config, "attention_bias", False)
        qk_norm = config.model_type in PER_HEAD_QK_NORM
        head_dim = head_dim_of(config)
        self.input_layernorm = RMSNorm(h, eps, fused_kernels)
        self.self_attn = SelfAttention(
            config,
            layer_index,
            rotary,
            tp,
            qkv_bias=config.model_type == "qwen2" or attention_bias,
            o_bias=attention_bias,
            q_norm=RMSNorm(head_dim, eps, fused_kernels) if qk_norm else None,
            k_norm=RMSNorm(head_dim, eps, fused_kernels) if qk_norm else None,
        )
        self.post_attention_layernorm = RMSNorm(h, eps, fused_kernels)
        self.mlp = llama_mlp(config, layer_index, tp, fused_kernels, quantization)
        # Both row-parallel outputs go straight to a residual norm (this layer's second, the next layer's first
        # or the model's last): the norm sums them, in its own kernel where it can (models/norms.py).
        self.self_attn.o_proj.sum_in_next_norm = True
        if isinstance(self.mlp, GatedMLP):
            self.mlp.down_proj.sum_in_next_norm = True

    def fuse_fp8_inputs(self) -> None:
        """Each norm's output has one reader: qkv_proj; gate_up_proj unless the MLP is a mixture of experts
        (its router reads the rows too)."""
        self.input_layernorm.quantize_for(self.self_attn.qkv_proj)
        if isinstance(self.mlp, GatedMLP):
            self.post_attention_layernorm.quantize_for(self.mlp.gate_up_proj)

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None, positions: torch.Tensor, ctx: ForwardContext
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """x: the previous layer's MLP output (the embeddings for the first layer, whose residual is None);
        returns this layer's MLP output and the residual stream before it."""
        if residual is None:
            h, residual = self.input_layernorm(x), x
        else:
            h, residual = self.input_layernorm(x, residual)
        h, residual = self.post_attention_layernorm(self.self_attn(h, positions, ctx), residual)
        return self.mlp(h), residual


class LlamaForCausalLM(CausalLM):
    def __init__(
        self, config, fused_kernels: bool = False, tp: TensorParallel = SINGLE, quantization: str | None = None
    ):
        """quantization: "fp8" builds the experts (Mixtral, Qwen3-MoE) in FP8, quantized as they load; the
        projections are quantized after loading (models/fp8.py)."""
        rotary = RotaryEmbedding(config, fused_kernels)  # one table, shared by every layer
        super().__init__(
            config, tp, fused_kernels, lambda i: LlamaDecoderLayer(config, i, rotary, fused_kernels, tp, quantization)
        )
