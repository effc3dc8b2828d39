"""GPT-2: learned positions, multi-head attention, pre-LayerNorm, GELU (tanh) MLP, head tied to the embedding."""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch
import torch.nn.functional as F
from torch import nn

from gpu_worker.attention.base import LayerAttention
from gpu_worker.models.forward_context import ForwardContext
from gpu_worker.models.parallel_layers import ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding
from gpu_worker.models.weights import TensorSource, check_all_loaded, load_tensor
from gpu_worker.parallel import SINGLE, TensorParallel


class GPT2Block(nn.Module):
    """With tensor parallelism a rank holds num_heads / N heads (q, k and v: HF's fused c_attn is split
    per q/k/v first) and a 1/N share of the MLP; attn_out and fc_out all-reduce."""

    def __init__(self, config, layer_index: int, tp: TensorParallel):
        super().__init__()
        h = config.n_embd
        self.layer_index = layer_index
        self.num_heads = tp.shard(config.n_head, "attention heads")
        self.head_dim = h // config.n_head
        self.scale = 1.0 / math.sqrt(self.head_dim) if config.scale_attn_weights else 1.0
        inner = config.n_inner or 4 * h
        self.ln_1 = nn.LayerNorm(h, eps=config.layer_norm_epsilon)
        self.qkv = ColumnParallelLinear(h, [h, h, h], tp, bias=True, what="attention features")
        self.attn_out = RowParallelLinear(h, h, tp, bias=True, what="attention features")
        self.ln_2 = nn.LayerNorm(h, eps=config.layer_norm_epsilon)
        self.fc_in = ColumnParallelLinear(h, [inner], tp, bias=True, what="MLP features")
        self.fc_out = RowParallelLinear(inner, h, tp, bias=True, what="MLP features")

    def forward(self, x: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        t = x.shape[0]
        q, k, v = self.qkv(self.ln_1(x)).view(t, 3, self.num_heads, self.head_dim).unbind(1)
        k_cache, v_cache = ctx.kv_cache.layer(self.layer_index)
        attn = ctx.attention.forward(
            q, k, v, k_cache, v_cache, ctx.attn_metadata, self.scale, kv_scales=ctx.kv_cache.scales[self.layer_index]
        )
        x = x + self.attn_out(attn.reshape(t, -1))
        return x + self.fc_out(F.gelu(self.fc_in(self.ln_2(x)), approximate="tanh"))


class GPT2ForCausalLM(nn.Module):
    def __init__(
        self, config, fused_kernels: bool = False, tp: TensorParallel = SINGLE, quantization: str | None = None
    ):
        # fused_kernels changes nothing here: LayerNorm and GELU are already one torch kernel each; nor does
        # quantization (only experts are built quantized; projections are quantized after loading: models/fp8.py).
        super().__init__()
        unsupported = [
            name
            for name in ("scale_attn_by_inverse_layer_idx", "reorder_and_upcast_attn")
            if getattr(config, name, False)
        ]
        if unsupported or config.activation_function not in ("gelu_new", "gelu_pytorch_tanh"):
            raise ValueError(f"GPT-2 options not supported: {unsupported or config.activation_function}")
        self.config = config
        self.vocab_size = config.vocab_size
        self.wte = VocabParallelEmbedding(config.vocab_size, config.n_embd, tp)
        self.wpe = nn.Embedding(config.n_positions, config.n_embd)
        self.blocks = nn.ModuleList(GPT2Block(config, i, tp) for i in range(config.n_layer))
        self.ln_f = nn.LayerNorm(config.n_embd, eps=config.layer_norm_epsilon)

    @property
    def kv_shape(self) -> tuple[int, int, int]:
        """(layers, this rank's kv heads, head dim)"""
        block = self.blocks[0]
        return len(self.blocks), block.num_heads, block.head_dim

    @property
    def attention_layers(self) -> list[LayerAttention]:
        """Each layer's attention, as the backends see it (gpu_worker/attention: which one can run the model)."""
        return [LayerAttention(b.num_heads, b.num_heads, b.head_dim, b.scale) for b in self.blocks]

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        x = self.wte(input_ids) + self.wpe(positions)
        for block in self.blocks:
            x = block(x, ctx)
        return self.ln_f(x)

    def compute_logits(self, hidden: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        return self.wte.logits(hidden, out)

    def logits_buffer(self, rows: int) -> torch.Tensor:
        return self.wte.logits_buffer(rows, self.wte.weight.dtype)

    def load_weights(self, weights: Iterable[tuple[str, TensorSource]]) -> None:
        """Hugging Face GPT-2 names -> ours. HF's Conv1D stores [in, out]; nn.Linear wants [out, in]."""
        renames = {"attn.c_attn": "qkv", "attn.c_proj": "attn_out", "mlp.c_fc": "fc_in", "mlp.c_proj": "fc_out"}
        params = dict(self.named_parameters())
        loaded = set()
        for name, tensor in weights:
            name = name.removeprefix("transformer.")
            if name.endswith((".attn.bias", ".attn.masked_bias")) or name == "lm_head.weight":
                continue  # causal-mask buffers; the head is tied to wte
            if name.startswith("h."):
                name = "blocks." + name[2:]
                for old, new in renames.items():
                    if f".{old}." in name:
                        name = name.replace(f".{old}.", f".{new}.")
                        if name.endswith(".weight"):
                            tensor = tensor.t()
            load_tensor(self, params, name, tensor)
            loaded.add(name)
        check_all_loaded(params, loaded)
