"""FP8 weights (--quantization fp8): the e4m3 rounding of weights and activations stays within what three
mantissa bits allow, only the decoder layers' projections are quantized, and the engine (one rank or two,
CPU emulation, or Hopper's _scaled_mm where a GPU is present) generates what the float model mostly does."""

from __future__ import annotations

import pytest
import torch

from common.sampling_params import SamplingParams
from gpu_worker.model_loader import load_model
from gpu_worker.models import fp8
from launch import parse_args
from offline import LLM
from tests.tiny_models import random_prompts

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="torch._scaled_mm needs a CUDA device")
needs_hopper = pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9),
    reason="FP8 matmuls need a CUDA device of compute capability 8.9 or more (Ada, Hopper)",
)
E4M3_HALF_ULP = 2.0**-4  # relative rounding error of a normal e4m3 number (3 mantissa bits)
E4M3_SUBNORMAL_HALF_STEP = 2.0**-10  # absolute, in units of the scale: subnormals are spaced 2^-9


def randn(*shape: int, seed: int = 0, device: str = "cpu") -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(device)


def relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.float() - want.float()).norm() / want.float().norm()).item()


def test_rows_round_trip_within_e4m3_precision_with_one_scale_per_row():
    w = randn(96, 64) * torch.logspace(-3, 1, 96)[:, None]  # rows of very different magnitudes
    q, scale = fp8.quantize_rows(w)
    assert q.dtype == torch.float8_e4m3fn and q.shape == (96, 64)
    assert scale.dtype == torch.float32 and scale.shape == (96, 1)
    back = q.float() * scale
    assert ((back - w).abs() <= w.abs() * E4M3_HALF_ULP + scale * E4M3_SUBNORMAL_HALF_STEP).all()
    torch.testing.assert_close(back.abs().amax(dim=1), w.abs().amax(dim=1))  # each row's largest is exact


def test_an_all_zero_row_quantizes_to_zeros_not_nan():
    q, scale = fp8.quantize_rows(torch.zeros(2, 16))
    assert (q.float() == 0).all() and (scale > 0).all()


def test_fp8_linear_is_close_to_the_float_one():
    w, x, bias = randn(96, 64, seed=1) * 0.05, randn(2, 5, 64, seed=2), randn(96, seed=3)
    q, scale = fp8.quantize_rows(w)
    y = fp8.linear(x, q, bias, scale.t().contiguous())
    assert y.shape == (2, 5, 96) and y.dtype == x.dtype
    assert relative_error(y, torch.nn.functional.linear(x, w, bias)) < 5e-2


def test_without_a_weight_scale_linear_is_the_float_matmul():
    w, x = randn(96, 64, seed=1), randn(5, 64, seed=2)
    assert torch.equal(fp8.linear(x, w, None, None), torch.nn.functional.linear(x, w))


def test_only_the_decoder_layers_projections_are_quantized(tiny_llama):
    model = load_model(str(tiny_llama), "auto", torch.float32, torch.device("cpu"), quantization="fp8")
    reference = dict(load_model(str(tiny_llama), "auto", torch.float32, torch.device("cpu")).named_parameters())
    projections = {"qkv_proj", "o_proj", "gate_up_proj", "down_proj"}
    for name, param in model.named_parameters():
        owner = name.rsplit(".", 2)[-2]
        if owner in projections and name.endswith("weight"):
            assert param.dtype == torch.float8_e4m3fn, name
            scale = model.get_submodule(name.rpartition(".")[0]).weight_scale
            assert scale.shape == (1, param.shape[0]) and scale.dtype == torch.float32
            assert relative_error(param.float() * scale.t(), reference[name]) < 5e-2, name
        else:
            assert param.dtype == torch.float32 and torch.equal(param, reference[name]), name


def test_an_unknown_quantization_is_refused_naming_it(tiny_llama, capsys):
    with pytest.raises(ValueError, match="quantization 'int8' is not supported"):
        load_model(str(tiny_llama), "dummy", torch.float32, torch.device("cpu"), quantization="int8")
    with pytest.raises(SystemExit):
        parse_args(["--quantization", "int8"])
    assert "invalid choice: 'int8'" in capsys.readouterr().err
    assert parse_args(["-q", "fp8"]).quantization == "fp8" and parse_args([]).quantization is None


def greedy(folder, prompts, device: str = "cpu", dtype: str = "float32", **engine_args) -> list[list[int]]:
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    with LLM(
        str(folder),
        device=device,
        dtype=dtype,
        num_kv_blocks=64,
        max_num_seqs=8,
        max_num_batched_tokens=512,
        **engine_args,
    ) as llm:
        return [o.token_ids for o in llm.generate(prompts, params)]


def first_token_agreement(a: list[list[int]], b: list[list[int]]) -> float:
    return sum(x[0] == y[0] for x, y in zip(a, b, strict=True)) / len(a)


PROMPTS = random_prompts(8, [5, 13, 17, 35], vocab=512, seed=3)


def test_the_engine_with_fp8_weights_mostly_generates_what_the_float_model_does(tiny_model):
    """Random (dummy) weights quantized as checkpoint ones are: the tiny models' wide logits keep most argmaxes."""
    quantized = greedy(tiny_model, PROMPTS, quantization="fp8")
    assert all(len(tokens) == 12 for tokens in quantized)
    assert first_token_agreement(quantized, greedy(tiny_model, PROMPTS)) >= 0.75


def test_two_ranks_with_fp8_each_quantize_their_shard_and_agree_with_one(tiny_llama):
    """Row-parallel shards have their own scales (over each rank's inputs), so not token-exact with one rank."""
    two = greedy(tiny_llama, PROMPTS, quantization="fp8", tensor_parallel_size=2)
    assert first_token_agreement(two, greedy(tiny_llama, PROMPTS, quantization="fp8")) >= 0.75


@needs_hopper
def test_the_triton_quantization_gives_torchs_bits():
    """The CUDA path quantizes activations in one kernel: the same values and scales as quantize_rows."""
    from gpu_worker.models import fp8_triton

    x = (randn(37, 1000, device="cuda") * torch.logspace(-3, 2, 37, device="cuda")[:, None]).bfloat16()
    x[3] = 0
    q, scale = fp8_triton.quantize_rows(x, fp8.FP8_MAX, fp8.MIN_SCALE)
    want_q, want_scale = fp8.quantize_rows(x)
    assert torch.equal(scale, want_scale) and torch.equal(q.view(torch.uint8), want_q.view(torch.uint8))


@needs_hopper
def test_scaled_mm_gives_the_cpu_emulations_product():
    """The same quantized operands: _scaled_mm (float32 accumulation, bfloat16 out) against the CPU's float32
    matmul of them, within bfloat16's rounding of the output."""
    w, x, bias = randn(256, 512, seed=1) * 0.05, randn(37, 512, seed=2), randn(256, seed=3)
    q, scale = fp8.quantize_rows(w)
    on_cpu = fp8.linear(x.bfloat16(), q, bias.bfloat16(), scale.t().contiguous())
    q_gpu, scale_gpu = q.cuda(), scale.t().contiguous().cuda()
    on_gpu = fp8.linear(x.bfloat16().cuda(), q_gpu, bias.bfloat16().cuda(), scale_gpu)
    assert on_gpu.dtype == torch.bfloat16 and relative_error(on_gpu.cpu(), on_cpu) < 1e-2


@needs_hopper
@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float32"])
def test_fp8_on_cuda_mostly_generates_what_the_unquantized_model_does(tiny_model, dtype):
    """CUDA graphs (decode and mixed steps) replaying the per-token quantization and _scaled_mm."""
    quantized = greedy(tiny_model, PROMPTS, "cuda", dtype, quantization="fp8")
    assert first_token_agreement(quantized, greedy(tiny_model, PROMPTS, "cuda", dtype)) >= 0.75


@needs_cuda
def test_a_weight_that_scaled_mm_cannot_take_is_refused_at_load(tmp_path):
    from tests.tiny_models import build_model

    folder = build_model("llama", tmp_path / "odd", intermediate_size=100)
    with pytest.raises(ValueError, match="multiples of 16, not 200 x 64"):
        load_model(str(folder), "auto", torch.bfloat16, torch.device("cuda"), quantization="fp8")
