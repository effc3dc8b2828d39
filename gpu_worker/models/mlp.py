"""The gated MLP of the decoder families: down(act(gate) * up), gate and up one fused projection (one matmul
instead of two). With tensor parallelism a rank holds 1/N of the intermediate width; down_proj all-reduces.
With the fused kernels and an FP8 down_proj, act(gate) * up comes quantized for it from the same kernel.

    act                      families
    silu (SwiGLU)            Llama, Mistral, Qwen, Phi-3, OLMo 2, the MoE experts
    gelu_pytorch_tanh (GeGLU) Gemma 2 and 3
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from gpu_worker.models import fp8
from gpu_worker.models.parallel_layers import ColumnParallelLinear, RowParallelLinear
from gpu_worker.parallel import TensorParallel, UnreducedSum

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
        self.quantized_act = False  # set at load: fuse_fp8_inputs

    def fuse_fp8_inputs(self) -> None:
        self.quantized_act = self.fused and fp8.is_quantized(self.down_proj)

    def forward(self, x: fp8.Activation) -> torch.Tensor | UnreducedSum:
        gate_up = self.gate_up_proj(x)
        if self.quantized_act:
            from gpu_worker.models import triton_ops

            return self.down_proj(triton_ops.act_and_mul_fp8(gate_up, self.activation))
        return self.down_proj(act_and_mul(gate_up, self.activation, self.fused))
