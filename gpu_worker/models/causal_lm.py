"""What every decoder family here shares: token embedding -> decoder layers -> final norm -> LM head, and
Hugging Face checkpoint names mapped onto ours. A family gives its layer class (llama.py, gemma.py,
olmo2.py) and its few differences (an embedding scale, the norms' style, a final logit soft-cap).

Layers pass the residual stream beside their output, (x, residual) -> (x, residual), so that a family whose
layer starts with a norm adds the residual inside it (one fused kernel on CUDA, models/norms.py). The first
layer gets residual None; the final norm adds the last layer's output.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable

import torch
from torch import nn

from gpu_worker.attention.base import LayerAttention
from gpu_worker.models.forward_context import ForwardContext
from gpu_worker.models.norms import NormStyle, RMSNorm
from gpu_worker.models.parallel_layers import VocabParallelEmbedding
from gpu_worker.models.weights import Placement, TensorSource, load_checkpoint
from gpu_worker.parallel import TensorParallel

# Checkpoint names (after "model.") -> ours, with the part of a fused tensor they fill. Phi-3 stores
# qkv_proj and gate_up_proj fused already (they load whole); transformers 5 names stacked experts as ours.
FUSED_PARTS = {
    ".self_attn.q_proj.": (".self_attn.qkv_proj.", 0),
    ".self_attn.k_proj.": (".self_attn.qkv_proj.", 1),
    ".self_attn.v_proj.": (".self_attn.qkv_proj.", 2),
    ".mlp.gate_proj.": (".mlp.gate_up_proj.", 0),
    ".mlp.up_proj.": (".mlp.gate_up_proj.", 1),
}
# One tensor per expert: Mixtral's block_sparse_moe.experts.E.w1|w3|w2, Qwen3-MoE's mlp.experts.E.gate_proj|...
EXPERT_TENSOR = re.compile(
    r"\.(?:block_sparse_moe|mlp)\.experts\.(\d+)\.(w1|w3|w2|gate_proj|up_proj|down_proj)\.weight$"
)
EXPERT_PART = {"w1": 0, "gate_proj": 0, "w3": 1, "up_proj": 1, "w2": None, "down_proj": None}


def place_decoder_tensor(name: str) -> Placement:
    """Where a Hugging Face decoder checkpoint tensor goes in our model (None: nowhere, e.g. rotary buffers)."""
    name = name.removeprefix("model.")
    if "rotary_emb" in name:
        return None
    expert = EXPERT_TENSOR.search(name)
    if expert:
        index, kind = int(expert.group(1)), expert.group(2)
        layer = name[: expert.start()]
        param = "gate_up_proj" if EXPERT_PART[kind] is not None else "down_proj"
        return f"{layer}.mlp.experts.{param}", (index, EXPERT_PART[kind])
    name = name.replace(".block_sparse_moe.gate.", ".mlp.gate.")
    for theirs, (ours, part) in FUSED_PARTS.items():
        if theirs in name:
            return name.replace(theirs, ours), part
    return name, None


class CausalLM(nn.Module):
    def __init__(
        self,
        config,
        tp: TensorParallel,
        fused_kernels: bool,
        make_layer: Callable[[int], nn.Module],
        *,
        norm_style: NormStyle = "llama",
        embed_scale: float | None = None,
        final_softcap: float | None = None,
    ):
        """embed_scale: multiplies the embeddings (Gemma: sqrt(hidden_size), rounded to the model dtype as the
        reference rounds it). final_softcap: logits become cap * tanh(logits / cap) (Gemma 2)."""
        super().__init__()
        self.config = config
        self.tied = bool(getattr(config, "tie_word_embeddings", False))
        self.vocab_size = config.vocab_size
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size, tp)
        dtype = torch.get_default_dtype()  # the model dtype: the loader builds the model under it
        self.embed_scale = None if embed_scale is None else torch.tensor(embed_scale).to(dtype).item()
        self.final_softcap = final_softcap or None
        self.layers = nn.ModuleList(make_layer(i) for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, fused_kernels, norm_style)
        # The head is split by vocabulary like the embedding (an embedding's weight, used only for logits).
        self.lm_head = None if self.tied else VocabParallelEmbedding(config.vocab_size, config.hidden_size, tp)

    @property
    def kv_shape(self) -> tuple[int, int, int]:
        """(layers, this rank's KV heads, head dim): the same in every layer of these families."""
        attention = self.layers[0].self_attn
        return len(self.layers), attention.num_kv_heads, attention.head_dim

    @property
    def attention_layers(self) -> list[LayerAttention]:
        """Each layer's attention, as the backends see it (gpu_worker/attention: which one can run the model)."""
        return [layer.self_attn.layer_attention for layer in self.layers]

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        x = self.embed_tokens(input_ids)
        if self.embed_scale is not None:
            x = x * self.embed_scale
        residual = None
        for layer in self.layers:
            x, residual = layer(x, residual, positions, ctx)
        return self.norm(x, residual)[0]

    @property
    def head(self) -> VocabParallelEmbedding:
        return self.embed_tokens if self.lm_head is None else self.lm_head

    def compute_logits(self, hidden: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        logits = self.head.logits(hidden, out)
        if self.final_softcap is not None:  # in place: a given `out` keeps the numbers
            logits = logits.div_(self.final_softcap).tanh_().mul_(self.final_softcap)
        return logits

    def logits_buffer(self, rows: int) -> torch.Tensor:
        """Where compute_logits(out=) writes: the model's dtype, or float32 where a final soft cap is applied
        (as on every path without a buffer: the cap's tanh in float32)."""
        dtype = torch.float32 if self.final_softcap is not None else self.head.weight.dtype
        return self.head.logits_buffer(rows, dtype)

    def load_weights(self, weights: Iterable[tuple[str, TensorSource]]) -> None:
        def place(name: str) -> Placement:
            if self.tied and name == "lm_head.weight":
                return None
            return place_decoder_tensor(name)

        load_checkpoint(self, weights, place)
