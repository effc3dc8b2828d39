"""With --quantization fp8 and the fused kernels, the kernel that produces an FP8 projection's only input
quantizes it per token (models/fp8.py: QuantizedRows): the norms before qkv and gate_up, act(gate) * up before
down. Its rows and scales are bit for bit those of storing the output and quantizing it in a second kernel, so
the model's logits are too. Without CUDA the kernels run in the Triton interpreter on CPU (see
test_triton_attention.py), whose float8 cast rounds its own way: there the quantize-after reference goes
through the same Triton cast (fp8_triton.quantize_rows), on CUDA it is the engine's own path."""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

pytest.importorskip("triton", reason="triton is not installed (pip install triton)")

from gpu_worker.models import fp8, fp8_triton, triton_ops  # noqa: E402
from gpu_worker.models.mlp import GatedMLP  # noqa: E402
from gpu_worker.models.norms import RMSNorm  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
HALF = torch.bfloat16 if DEVICE.type == "cuda" else torch.float16  # the interpreter has no bfloat16


def randn(*shape: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(DEVICE, dtype)


def quantize_after(rows: torch.Tensor) -> fp8.QuantizedRows:
    """The separate quantization kernel the fused ones replace."""
    values, scales = fp8_triton.quantize_rows(rows, fp8.FP8_MAX, fp8.MIN_SCALE)
    return fp8.QuantizedRows(values, scales, rows.dtype)


def assert_same_bits(got: fp8.QuantizedRows, want: fp8.QuantizedRows) -> None:
    assert got.values.dtype == fp8.FP8 and got.dtype == want.dtype
    assert torch.equal(got.scales, want.scales)
    assert torch.equal(got.values.view(torch.uint8), want.values.view(torch.uint8))


@pytest.mark.parametrize("with_residual", [False, True])
@pytest.mark.parametrize("style", ["llama", "gemma"])
@pytest.mark.parametrize("dtype", [torch.float32, HALF])
def test_the_norm_quantizes_its_rows_as_quantizing_them_after_it_does(dtype, style, with_residual):
    """Rows of very different magnitudes, one all zero (the floor scale), a width that is not a power of two."""
    weight = randn(96, dtype=dtype, seed=1)
    x = randn(7, 96, dtype=dtype, seed=2) * torch.logspace(-3, 2, 7, device=DEVICE)[:, None].to(dtype)
    x[3] = 0
    residual = randn(7, 96, dtype=dtype, seed=3) if with_residual else None
    residual_after = None if residual is None else residual.clone()
    style_args = {"offset": 1.0 if style == "gemma" else 0.0, "scale_in_float32": style == "gemma"}
    if residual is not None:
        residual[3] = residual_after[3] = 0
    fused = triton_ops.add_rms_norm_fp8(x, weight, 1e-5, residual, **style_args)
    want = quantize_after(triton_ops.add_rms_norm(x, weight, 1e-5, residual_after, **style_args))
    assert_same_bits(fused, want)
    if residual is not None:
        assert torch.equal(residual, residual_after)  # the new residual stream, written as before


@pytest.mark.parametrize("width", [80, 1500])
@pytest.mark.parametrize("activation", ["silu", "gelu_tanh"])
@pytest.mark.parametrize("dtype", [torch.float32, HALF])
def test_act_and_mul_quantizes_its_rows_as_quantizing_them_after_it_does(dtype, activation, width):
    """1500: wider than act_and_mul's block of 1024, where the fused kernel takes the whole row at once."""
    gate_up = randn(4, 2 * width, dtype=dtype, seed=5) * 3
    gate_up[2] = 0
    fused = triton_ops.act_and_mul_fp8(gate_up, activation)
    assert_same_bits(fused, quantize_after(triton_ops.act_and_mul(gate_up, activation)))


def load_fp8(folder, dtype: torch.dtype, fused_inputs: bool) -> torch.nn.Module:
    """The tiny model with FP8 projections and the fused kernels; fused_inputs False: every projection's input
    quantized on its own, as before this fusion."""
    from gpu_worker.model_loader import load_model

    model = load_model(str(folder), "auto", dtype, DEVICE, fused_kernels=True, quantization="fp8")
    if not fused_inputs:
        for module in model.modules():
            if isinstance(module, RMSNorm):
                module.quantized_output = False
            if isinstance(module, GatedMLP):
                module.quantized_act = False
    return model


def prefill_logits(model: torch.nn.Module) -> torch.Tensor:
    """One prefill step of two sequences (5 and 11 tokens) on the torch attention."""
    from tests.tiny_models import prefill_logits as prefill

    return prefill(model, [5, 11], [[0], [1, 2]], 8, model.embed_tokens.weight.dtype, DEVICE)


@pytest.fixture
def separate_quantizations(monkeypatch) -> list[int]:
    """Counts the inputs quantized apart from the kernel that made them (fp8.quantize_activation), through the
    Triton kernel on any device: the interpreter's float8 cast is then the fused kernels' own."""
    calls: list[int] = []

    def quantize_activation(x: torch.Tensor, group: int = 0) -> fp8.QuantizedRows:
        assert group == 0, "per-channel weights: activations per token"
        calls.append(x.shape[-1])
        return quantize_after(x)

    monkeypatch.setattr(fp8, "quantize_activation", quantize_activation)
    return calls


# Per layer, the projections whose input no fused kernel quantizes: o_proj; OLMo 2 (post-norm) has no norm before
# qkv and gate_up; Mixtral's experts are FP8 weight-only (their inputs stay in the model dtype: models/moe.py).
APART_PER_LAYER = {"llama": 1, "gemma2": 1, "olmo2": 3, "mixtral": 1}


@pytest.mark.parametrize("kind", list(APART_PER_LAYER))
def test_only_inputs_without_a_producing_kernel_are_quantized_apart(kind, tmp_path, separate_quantizations):
    from tests.tiny_models import build_model

    model = load_fp8(build_model(kind, tmp_path / kind), torch.float32, fused_inputs=True)
    prefill_logits(model)
    assert len(separate_quantizations) == APART_PER_LAYER[kind] * len(model.layers)


@pytest.mark.parametrize("dtype", [torch.float32, HALF])
@pytest.mark.parametrize("kind", ["llama", "gemma2"])
def test_the_fused_quantization_gives_the_logits_of_quantizing_after(kind, dtype, tmp_path, separate_quantizations):
    from tests.tiny_models import build_model

    folder = build_model(kind, tmp_path / kind)
    fused = prefill_logits(load_fp8(folder, dtype, fused_inputs=True))
    after = prefill_logits(load_fp8(folder, dtype, fused_inputs=False))
    assert torch.equal(fused, after)
