"""The gated MLP of the decoder families: down(act(gate) * up), gate and up one fused projection (one matmul
instead of two). With tensor parallelism a rank holds 1/N of the intermediate width; down_proj all-reduces.

    act                      families
    silu (SwiGLU)            Llama, Mistral, Qwen, Phi-3, OLMo 2, the MoE experts
    gelu_pytorch_tanh (GeGLU) Gemma 2 and 3
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from gpu_worker.models.parallel_layers import ColumnParallelLinear, RowParallelLinear
from gpu_worker.parallel import TensorParallel

# Hugging Face activation names -> the fused kernel's (models/triton_ops.py: act_and_mul).
ACTIVATIONS = {"silu": "silu", "gelu_pytorch_tanh": "gelu_tanh"}


def activation_of(name: str) -> str:
    if name not in ACTIVATIONS:
        raise ValueError(f"activation {name!r} is not supported ({', '.join(ACTIVATIONS)})")
    return ACTIVATIONS[name]


def act_and_mul(gate_up: torch.Tensor, activation: str, fused: bool) -> torch.Tensor:
    """[T, 2I] (gate then up) -> act(gate) * up, in the model dtype as the reference rounds it."""
    if fused:
        from gpu_worker.models import triton_ops

        return triton_ops.act_and_mul(gate_up, activation)
    gate, up = gate_up.chunk(2, dim=-1)
    act = F.silu(gate) if activation == "silu" else F.gelu(gate, approximate="tanh")
    return act * up


class GatedMLP(nn.Module):
    def __init__(
        self, hidden: int, intermediate: int, tp: TensorParallel, hidden_act: str, fused: bool, bias: bool = False
    ):
        super().__init__()
        what = "MLP features (intermediate_size)"
        self.activation = activation_of(hidden_act)
        self.fused = fused
        self.gate_up_proj = ColumnParallelLinear(hidden, [intermediate, intermediate], tp, bias, what)
        self.down_proj = RowParallelLinear(intermediate, hidden, tp, bias, what)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(act_and_mul(self.gate_up_proj(x), self.activation, self.fused))
