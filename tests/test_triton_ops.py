"""The models' fused CUDA kernels give the torch reference's numbers: in float32 exactly (rotary) or to the
last bit or two (a sum in another order: RMSNorm's mean, silu's exponential), in half precision within one
rounding. Without CUDA they run in the Triton interpreter on CPU (see test_triton_attention.py)."""

from __future__ import annotations

import os
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

pytest.importorskip("triton", reason="triton is not installed (pip install triton)")

from gpu_worker.models import triton_ops  # noqa: E402
from gpu_worker.models.llama import RMSNorm  # noqa: E402
from gpu_worker.models.rotary import RotaryEmbedding  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
HALF = torch.bfloat16 if DEVICE.type == "cuda" else torch.float16  # the interpreter has no bfloat16


def close(dtype: torch.dtype, float32_exact: bool = False) -> dict:
    if dtype == torch.float32:
        return {"rtol": 0, "atol": 0} if float32_exact else {"rtol": 1e-6, "atol": 1e-6}
    return {"rtol": 1e-2, "atol": 1e-2}


def randn(*shape: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(DEVICE, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, HALF])
def test_rms_norm_with_and_without_the_residual_add(dtype):
    norm = RMSNorm(96, 1e-5).to(DEVICE, dtype)
    norm.weight.data = randn(96, dtype=dtype, seed=1)
    x, residual = randn(7, 96, dtype=dtype, seed=2), randn(7, 96, dtype=dtype, seed=3)
    torch.testing.assert_close(triton_ops.add_rms_norm(x, norm.weight, norm.eps), norm(x), **close(dtype))
    expected_out, expected_sum = norm(x, residual)
    fused_residual = residual.clone()
    out = triton_ops.add_rms_norm(x, norm.weight, norm.eps, fused_residual)
    torch.testing.assert_close(fused_residual, expected_sum, **close(dtype, float32_exact=True))
    torch.testing.assert_close(out, expected_out, **close(dtype))


@pytest.mark.parametrize("dtype", [torch.float32, HALF])
def test_rotary_rotates_q_and_k_in_place_through_their_strides(dtype):
    config = SimpleNamespace(
        hidden_size=6 * 32,
        num_attention_heads=6,
        max_position_embeddings=64,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
    )
    rotary = RotaryEmbedding(config).to(DEVICE)
    qkv = randn(5, 6 + 2 * 2, 32, dtype=dtype, seed=4)  # q, k and v as views of one projection
    q, k, _ = qkv.split([6, 2, 2], dim=1)
    positions = torch.tensor([0, 3, 17, 40, 63], device=DEVICE)
    expected_q, expected_k = rotary(positions, q, k)
    triton_ops.rotary(positions, q, k, rotary.cos, rotary.sin)
    torch.testing.assert_close(q, expected_q, **close(dtype, float32_exact=True))
    torch.testing.assert_close(k, expected_k, **close(dtype, float32_exact=True))


@pytest.mark.parametrize("dtype", [torch.float32, HALF])
def test_silu_and_mul_splits_the_fused_gate_up_output(dtype):
    gate_up = randn(4, 2 * 80, dtype=dtype, seed=5)
    gate, up = gate_up.split(80, dim=-1)
    torch.testing.assert_close(triton_ops.silu_and_mul(gate_up), F.silu(gate) * up, **close(dtype))
