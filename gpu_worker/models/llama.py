"""The Llama family (Llama, Mistral, Qwen2, SmolLM2): RoPE, RMSNorm, SwiGLU MLP, grouped-query attention.

q/k/v are one fused projection and gate/up another (one matmul each instead of three and two). With
`fused_kernels` (CUDA, next to the Triton attention) RMSNorm with its residual add, the rotary embedding
and silu(gate) * up are one kernel each (models/triton_ops.py); otherwise the torch ops below run, the
reference that float32 outputs are checked against.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.nn.functional as F
from torch import nn

from gpu_worker.models.forward_context import ForwardContext
from gpu_worker.models.parallel_layers import ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding
from gpu_worker.models.rotary import RotaryEmbedding
from gpu_worker.models.weights import check_all_loaded, load_tensor
from gpu_worker.parallel import SINGLE, TensorParallel


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float, fused: bool = False):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps
        self.fused = fused

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        """RMSNorm of x; given the residual stream, of residual + x, returned with that sum (the new
        residual stream: the fused kernel writes it into `residual`)."""
        if self.fused:
            from gpu_worker.models import triton_ops

            out = triton_ops.add_rms_norm(x, self.weight, self.eps, residual)
            return out if residual is None else (out, residual)
        if residual is None:
            return self._norm(x)
        x = x + residual
        return self._norm(x), x

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        # The same operation order as the reference implementation: normalize in float32, cast, then scale.
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(x.dtype)


class LlamaDecoderLayer(nn.Module):
    """With tensor parallelism a rank holds num_heads / N query heads, num_kv_heads / N KV heads (its KV
    store holds only those) and a 1/N share of the MLP; o_proj and down_proj all-reduce. Sizes below are
    this rank's."""

    def __init__(self, config, layer_index: int, rotary: RotaryEmbedding, fused_kernels: bool, tp: TensorParallel):
        super().__init__()
        self.fused_kernels = fused_kernels
        h = config.hidden_size
        self.layer_index = layer_index
        self.head_dim = getattr(config, "head_dim", None) or h // config.num_attention_heads
        self.num_heads = tp.shard(config.num_attention_heads, "attention heads")
        self.num_kv_heads = tp.shard(config.num_key_value_heads, "KV heads")
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.scale = self.head_dim**-0.5
        qkv_bias = config.model_type == "qwen2" or getattr(config, "attention_bias", False)
        mlp_bias = getattr(config, "mlp_bias", False)
        self.rotary = rotary
        self.input_layernorm = RMSNorm(h, config.rms_norm_eps, fused_kernels)
        q_full, kv_full = config.num_attention_heads * self.head_dim, config.num_key_value_heads * self.head_dim
        self.qkv_proj = ColumnParallelLinear(h, [q_full, kv_full, kv_full], tp, qkv_bias, "attention features")
        self.o_proj = RowParallelLinear(q_full, h, tp, getattr(config, "attention_bias", False), "attention features")
        self.post_attention_layernorm = RMSNorm(h, config.rms_norm_eps, fused_kernels)
        inter = config.intermediate_size
        self.intermediate = tp.shard(inter, "MLP features (intermediate_size)")
        self.gate_up_proj = ColumnParallelLinear(h, [inter, inter], tp, mlp_bias, "MLP features (intermediate_size)")
        self.down_proj = RowParallelLinear(inter, h, tp, mlp_bias, "MLP features (intermediate_size)")
        if config.hidden_act != "silu":
            raise ValueError(f"hidden_act {config.hidden_act!r} is not supported (silu only)")

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None, positions: torch.Tensor, ctx: ForwardContext
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """x: the previous layer's MLP output (the embeddings for the first layer, whose residual is None);
        returns this layer's MLP output and the residual stream before it."""
        t = x.shape[0]
        if residual is None:
            h, residual = self.input_layernorm(x), x
        else:
            h, residual = self.input_layernorm(x, residual)
        q, k, v = self.qkv_proj(h).split([self.q_size, self.kv_size, self.kv_size], -1)
        q = q.view(t, self.num_heads, self.head_dim)
        k = k.view(t, self.num_kv_heads, self.head_dim)
        q, k = self.rotary(positions, q, k)
        k_cache, v_cache = ctx.kv_cache.layer(self.layer_index)
        attn = ctx.attention.forward(
            q, k, v.view(t, self.num_kv_heads, self.head_dim), k_cache, v_cache, ctx.attn_metadata, self.scale
        )
        h, residual = self.post_attention_layernorm(self.o_proj(attn.reshape(t, -1)), residual)
        gate_up = self.gate_up_proj(h)
        if self.fused_kernels:
            from gpu_worker.models import triton_ops

            return self.down_proj(triton_ops.silu_and_mul(gate_up)), residual
        gate, up = gate_up.split(self.intermediate, -1)
        return self.down_proj(F.silu(gate) * up), residual


class LlamaForCausalLM(nn.Module):
    def __init__(self, config, fused_kernels: bool = False, tp: TensorParallel = SINGLE):
        super().__init__()
        self.config = config
        self.tied = bool(getattr(config, "tie_word_embeddings", False))
        self.vocab_size = config.vocab_size
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size, tp)
        self.rotary = RotaryEmbedding(config, fused_kernels)
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(config, i, self.rotary, fused_kernels, tp) for i in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, fused_kernels)
        # The head is split by vocabulary like the embedding (an embedding's weight, used only for logits).
        self.lm_head = None if self.tied else VocabParallelEmbedding(config.vocab_size, config.hidden_size, tp)

    @property
    def kv_shape(self) -> tuple[int, int, int]:
        layer = self.layers[0]
        return len(self.layers), layer.num_kv_heads, layer.head_dim

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        x, residual = self.embed_tokens(input_ids), None
        for layer in self.layers:
            x, residual = layer(x, residual, positions, ctx)
        return self.norm(x, residual)[0]

    def compute_logits(self, hidden: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        return (self.embed_tokens if self.lm_head is None else self.lm_head).logits(hidden, out)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Hugging Face Llama names -> ours, writing q/k/v and gate/up as parts of their fused projections."""
        shards = {
            "self_attn.q_proj": ("qkv_proj", 0),
            "self_attn.k_proj": ("qkv_proj", 1),
            "self_attn.v_proj": ("qkv_proj", 2),
            "self_attn.o_proj": ("o_proj", None),
            "mlp.gate_proj": ("gate_up_proj", 0),
            "mlp.up_proj": ("gate_up_proj", 1),
            "mlp.down_proj": ("down_proj", None),
        }
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        shard_count: dict[str, int] = {}
        for name, tensor in weights:
            name = name.removeprefix("model.")
            if "rotary_emb" in name or (self.tied and name == "lm_head.weight"):
                continue
            part = None
            for hf, (ours, index) in shards.items():
                if f".{hf}." in name:
                    name, part = name.replace(f".{hf}.", f".{ours}."), index
                    break
            load_tensor(self, params, name, tensor, part)
            shard_count[name] = shard_count.get(name, 0) + 1
            loaded.add(name)
        fused_parts = {"qkv_proj": 3, "gate_up_proj": 2}
        incomplete = [
            n for n, c in shard_count.items() for part, k in fused_parts.items() if f".{part}." in n and c != k
        ]
        if incomplete:
            raise ValueError(f"checkpoint lacks parts of fused projections: {incomplete[:3]}")
        check_all_loaded(params, loaded)
