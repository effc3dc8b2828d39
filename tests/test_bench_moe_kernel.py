"""benchmarks.moe_kernel's layer (the GPU timings need CUDA; the layer, its fused call and its byte count do not):
with --quantization fp8 the experts are FP8 as the engine holds them, one byte a weight in the reading speed, and
the fused call it times computes the torch loop's numbers. The kernels run in the Triton interpreter on CPU."""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

pytest.importorskip("triton", reason="triton is not installed (pip install triton)")

from benchmarks.moe_kernel import expert_bytes, moe_layer, run_fused  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
# A Qwen3-MoE shape small enough for the interpreter.
SHAPE = {
    "model_type": "qwen3_moe",
    "hidden_size": 64,
    "moe_intermediate_size": 32,
    "num_experts": 8,
    "num_experts_per_tok": 2,
    "hidden_act": "silu",
    "norm_topk_prob": True,
}


@pytest.mark.parametrize("quantization", [None, "fp8"])
def test_the_timed_layer_holds_the_engines_experts_and_its_fused_call_gives_the_torch_loops_sum(quantization):
    layer = moe_layer(SHAPE, 1, torch.float32, DEVICE, quantization)
    experts = layer.experts
    weight_bytes = 1 if quantization == "fp8" else 4
    scale_bytes = 4 * (2 * 32 + 64) if quantization == "fp8" else 0
    assert expert_bytes(experts) == weight_bytes * (2 * 32 * 64 + 64 * 32) + scale_bytes
    x = torch.randn(5, 64, generator=torch.Generator().manual_seed(0)).to(DEVICE)
    ids, weights = layer.route(x)
    torch.testing.assert_close(run_fused(experts, x, ids, weights), experts(x, ids, weights), rtol=1e-5, atol=1e-5)


def test_a_tensor_parallel_rank_holds_its_share_of_every_expert():
    experts = moe_layer(SHAPE, 2, torch.float32, DEVICE, "fp8").experts
    assert experts.gate_up_proj.shape == (8, 32, 64) and experts.down_proj_scale.shape == (8, 64)
