"""The models' fused CUDA kernels give the torch reference's numbers: in float32 exactly (rotary) or to the
last bit or two (a sum in another order: RMSNorm's mean, an exponential), in half precision within one
rounding; every family's variant (norm styles, partial rotary, GeGLU). Without CUDA they run in the Triton
interpreter on CPU (see test_triton_attention.py)."""

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
from gpu_worker.models.norms import RMSNorm  # noqa: E402
from gpu_worker.models.rotary import RotaryEmbedding  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
HALF = torch.bfloat16 if DEVICE.type == "cuda" else torch.float16  # the interpreter has no bfloat16


def close(dtype: torch.dtype, float32_exact: bool = False) -> dict:
    if dtype == torch.float32:
        return {"rtol": 0, "atol": 0} if float32_exact else {"rtol": 1e-6, "atol": 1e-6}
    return {"rtol": 1e-2, "atol": 1e-2}


def randn(*shape: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(DEVICE, dtype)


@pytest.mark.parametrize("style", ["llama", "gemma", "olmo"])
@pytest.mark.parametrize("dtype", [torch.float32, HALF])
def test_rms_norm_with_and_without_the_residual_add(dtype, style):
    norm = RMSNorm(96, 1e-5, style=style).to(DEVICE, dtype)
    norm.weight.data = randn(96, dtype=dtype, seed=1)
    fused = RMSNorm(96, 1e-5, fused=True, style=style).to(DEVICE, dtype)
    fused.weight.data = norm.weight.data
    x, residual = randn(7, 96, dtype=dtype, seed=2), randn(7, 96, dtype=dtype, seed=3)
    torch.testing.assert_close(fused(x), norm(x), **close(dtype))
    expected_out, expected_sum = norm(x, residual)
    fused_residual = residual.clone()
    out, _ = fused(x, fused_residual)
    torch.testing.assert_close(fused_residual, expected_sum, **close(dtype, float32_exact=True))
    torch.testing.assert_close(out, expected_out, **close(dtype))


@pytest.mark.parametrize("dtype", [torch.float32, HALF])
def test_per_head_norms_normalize_each_head_of_a_strided_view(dtype):
    """Qwen3's and Gemma 3's q/k norms: [T, heads, D], q a view into the fused projection's output."""
    norm = RMSNorm(32, 1e-6, style="gemma").to(DEVICE, dtype)
    norm.weight.data = randn(32, dtype=dtype, seed=6)
    fused = RMSNorm(32, 1e-6, fused=True, style="gemma").to(DEVICE, dtype)
    fused.weight.data = norm.weight.data
    q = randn(5, 10, 32, dtype=dtype, seed=7)[:, :6]
    torch.testing.assert_close(fused(q), norm(q), **close(dtype))


@pytest.mark.parametrize("rotary_share", [1.0, 0.5])
@pytest.mark.parametrize("dtype", [torch.float32, HALF])
def test_rotary_rotates_q_and_k_in_place_through_their_strides(dtype, rotary_share):
    """rotary_share 0.5: a partial rotary factor (Phi-3 variants), the second half of each head left as it is."""
    config = SimpleNamespace(
        hidden_size=6 * 32,
        num_attention_heads=6,
        max_position_embeddings=64,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": rotary_share},
    )
    rotary = RotaryEmbedding(config).to(DEVICE)
    qkv = randn(5, 6 + 2 * 2, 32, dtype=dtype, seed=4)  # q, k and v as views of one projection
    q, k, _ = qkv.split([6, 2, 2], dim=1)
    positions = torch.tensor([0, 3, 17, 40, 63], device=DEVICE)
    expected_q, expected_k = rotary(positions, q, k)
    triton_ops.rotary(positions, q, k, rotary.cos, rotary.sin)
    torch.testing.assert_close(q, expected_q, **close(dtype, float32_exact=True))
    torch.testing.assert_close(k, expected_k, **close(dtype, float32_exact=True))


@pytest.mark.parametrize("width", [80, 2500], ids=["one-block", "blocks-of-a-row"])  # a row over several programs
@pytest.mark.parametrize("activation", ["silu", "gelu_tanh"])
@pytest.mark.parametrize("dtype", [torch.float32, HALF])
def test_act_and_mul_splits_the_fused_gate_up_output(dtype, activation, width):
    gate_up = randn(4, 2 * width, dtype=dtype, seed=5) * 3
    gate, up = gate_up.split(width, dim=-1)
    act = F.silu(gate) if activation == "silu" else F.gelu(gate, approximate="tanh")
    tolerance = close(dtype)
    if dtype == torch.float32:  # tanh's last bits where it saturates (gate ~ -10), times |gate x up| up to ~30
        tolerance["atol"] = 1e-5
    torch.testing.assert_close(triton_ops.act_and_mul(gate_up, activation), act * up, **tolerance)


def test_each_family_runs_the_same_forward_with_the_fused_ops(tiny_family):
    """Each family's layers wired to the kernels (norm styles, per-head and whole-projection q/k norms, partial
    rotary in place, GeGLU, MoE experts beside them): a prefill of two sequences gives the torch ops' logits."""
    from gpu_worker.model_loader import load_model
    from tests.tiny_models import prefill_logits

    logits = [
        prefill_logits(
            load_model(str(tiny_family), "auto", torch.float32, DEVICE, fused_kernels=fused),
            [7, 30],
            [[0], [1, 2, 3, 4]],
            8,
            torch.float32,
            DEVICE,
        )
        for fused in (False, True)
    ]
    torch.testing.assert_close(logits[1], logits[0], rtol=1e-5, atol=1e-5)
