"""Checkpoints saved in FP8 (common/checkpoint_quantization.py, gpu_worker/fp8_checkpoint.py): a per-channel one
serves exactly as the engine serves the float checkpoint it came from with --quantization fp8, a per-tensor or
block-scaled one as its dequantized weights would, on one rank or two; what the engine cannot serve is refused,
naming what it found."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from benchmarks.fp8_checkpoints import by_block, compressed_tensors, save_fp8_checkpoint, save_with_weights
from common.checkpoint_quantization import UnsupportedQuantization, checkpoint_quantization, fp8_block_size
from common.model_info import check_folder_supported
from common.sampling_params import SamplingParams
from gpu_worker.fp8_checkpoint import DequantizedWeight
from gpu_worker.model_loader import load_model
from gpu_worker.models import fp8
from offline import LLM
from tests.tiny_models import random_prompts

# The checkpoints' blocks: 16 rows, whole blocks of every fused part (q, k, v; gate, up), as 128 are of real models';
# 24 inputs, which leave partial blocks at the edge of each side (64, 128).
BLOCK = (16, 24)


def saved_in_fp8(folder: Path, out: Path, strategy: str) -> dict[str, torch.Tensor]:
    return save_fp8_checkpoint(folder, out, strategy, BLOCK)


def greedy(folder: Path, **engine_args) -> list[list[int]]:
    prompts = random_prompts(4, [7, 19, 30, 3], vocab=512, seed=5)
    with LLM(str(folder), device="cpu", dtype="float32", **engine_args) as llm:  # its ranks stop on leaving
        outs = llm.generate(prompts, SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True))
    return [o.token_ids for o in outs]


def test_a_per_channel_fp8_checkpoint_serves_as_its_float_one_does_with_quantization_fp8(tiny_llama, tmp_path):
    saved_in_fp8(tiny_llama, tmp_path / "fp8", "channel")
    cpu = torch.device("cpu")
    served = load_model(str(tmp_path / "fp8"), "auto", torch.float32, cpu)  # no --quantization: the checkpoint's
    quantized = load_model(str(tiny_llama), "auto", torch.float32, cpu, quantization="fp8")
    theirs = dict(quantized.named_parameters()) | dict(quantized.named_buffers())
    for name, mine in [*served.named_parameters(), *served.named_buffers()]:
        if mine.dtype == torch.float8_e4m3fn:  # the checkpoint's own e4m3 values, bit for bit
            assert torch.equal(mine.view(torch.uint8), theirs[name].view(torch.uint8)), name
        else:  # its scales within a rounding of the float32 products they came back through; the rest equal
            torch.testing.assert_close(mine, theirs[name], rtol=2e-7, atol=0), name
    assert greedy(tmp_path / "fp8") == greedy(tiny_llama, quantization="fp8")


def test_a_per_tensor_checkpoint_serves_as_its_dequantized_weights_do_on_one_rank_or_two(tiny_llama, tmp_path):
    # Two ranks read their rows (q|k|v, gate|up) or columns (o, down) of each dequantized weight.
    stands_for = saved_in_fp8(tiny_llama, tmp_path / "fp8", "tensor")
    dequantized = save_with_weights(tiny_llama, tmp_path / "dequantized", stands_for)
    cpu = torch.device("cpu")
    served = dict(load_model(str(tmp_path / "fp8"), "auto", torch.float32, cpu).named_buffers())
    reference = load_model(str(dequantized), "auto", torch.float32, cpu, quantization="fp8")
    for name, scale in reference.named_buffers():
        torch.testing.assert_close(served[name], scale, rtol=0, atol=0)
    assert greedy(tmp_path / "fp8") == greedy(dequantized, quantization="fp8")
    assert greedy(tmp_path / "fp8", tensor_parallel_size=2) == greedy(
        dequantized, quantization="fp8", tensor_parallel_size=2
    )


def test_a_block_scaled_checkpoint_comes_back_as_its_own_values_and_block_scales(tiny_llama, tmp_path):
    """Quantized again per block of the layers' own weights, the blocks of each fused part lining up with the
    checkpoint's: its e4m3 values bit for bit, its scales (each repeated over its block's rows) within a rounding
    of the float32 products they came back through; far closer to its values than one scale per channel."""
    stands_for = saved_in_fp8(tiny_llama, tmp_path / "fp8", "block")
    cpu = torch.device("cpu")
    served = load_model(str(tmp_path / "fp8"), "auto", torch.float32, cpu)
    checkpoint = load_file(tmp_path / "fp8" / "model.safetensors")
    for name in ("model.layers.0.mlp.down_proj.weight", "model.layers.1.self_attn.o_proj.weight"):
        layer = served.get_submodule(name.removeprefix("model.").removesuffix(".weight"))
        assert torch.equal(layer.weight.view(torch.uint8), checkpoint[name].view(torch.uint8)), name
        own_scales = checkpoint[name + "_scale_inv"].repeat_interleave(BLOCK[0], dim=0)[: layer.weight.shape[0]]
        torch.testing.assert_close(layer.weight_scale, own_scales, rtol=2e-7, atol=0)
        assert layer.weight_group == BLOCK[1]
    fused = served.layers[0].self_attn.qkv_proj  # q | k | v rows, each part its own blocks
    parts = [checkpoint[f"model.layers.0.self_attn.{p}_proj.weight"] for p in "qkv"]
    assert torch.equal(fused.weight.view(torch.uint8), torch.cat(parts).view(torch.uint8))
    values = stands_for["model.layers.0.mlp.down_proj.weight"]
    layer = served.layers[0].mlp.down_proj
    grouped = layer.weight.float() * layer.weight_scale.repeat_interleave(BLOCK[1], dim=1)[:, : values.shape[1]]
    per_channel, scale = fp8.quantize_rows(values)
    assert (grouped - values).norm() < 1e-3 * (per_channel.float() * scale - values).norm()
    assert len(greedy(tmp_path / "fp8")[0]) == 12  # and it generates (on the CPU: the emulated product)


def test_a_block_scaled_mixture_of_experts_keeps_its_experts_own_values_and_block_scales(tmp_path):
    """Each expert's gate, up and down quantized per block as it loads (models/moe.py use_weight_blocks), the
    blocks of each lining up with the checkpoint's: its e4m3 values bit for bit, its scales within a rounding."""
    from tests.tiny_models import build_model

    folder = build_model("qwen3_moe", tmp_path / "float")
    saved_in_fp8(folder, tmp_path / "fp8", "block")
    served = load_model(str(tmp_path / "fp8"), "auto", torch.float32, torch.device("cpu"))
    checkpoint = load_file(tmp_path / "fp8" / "model.safetensors")
    experts = served.layers[0].mlp.experts
    assert experts.weight_group == BLOCK[1]
    n = experts.local
    for e in (0, experts.num_experts - 1):
        for weight, rows, part in (
            ("gate_up_proj", slice(0, n), "gate_proj"),
            ("gate_up_proj", slice(n, 2 * n), "up_proj"),
            ("down_proj", slice(None), "down_proj"),
        ):
            name = f"model.layers.0.mlp.experts.{e}.{part}.weight"
            values, scales = getattr(experts, weight)[e, rows], getattr(experts, f"{weight}_scale")[e, rows]
            assert torch.equal(values.view(torch.uint8), checkpoint[name].view(torch.uint8)), name
            own_scales = checkpoint[name + "_scale_inv"].repeat_interleave(BLOCK[0], dim=0)[: values.shape[0]]
            torch.testing.assert_close(scales, own_scales, rtol=2e-7, atol=0), name
    assert len(greedy(tmp_path / "fp8")[0]) == 12  # and it generates (the torch path's dequantized products)


def test_a_block_scaled_weight_reads_any_part_as_the_whole_reads_it():
    # What a tensor-parallel rank reads: rows of a column-parallel weight, columns of a row-parallel one.
    edges = (24, 40)  # blocks partial at both edges of a 70 x 90 weight
    values, scales, each = by_block(torch.randn(70, 90, generator=torch.Generator().manual_seed(3)), edges)
    weight = DequantizedWeight("w", values, scales, edges)
    whole = values.float() * each
    for index in (..., slice(10, 47), (slice(None), slice(33, 81)), (slice(24, 60), slice(0, 45))):
        assert torch.equal(weight[index], whole[index]), index
    with pytest.raises(ValueError, match=r"stacked|\[out, in\] matrices"):
        DequantizedWeight("experts", values[None], scales[None], edges)  # stacked experts: not served


def test_a_float8_weight_without_its_scale_is_refused(tiny_llama, tmp_path):
    saved_in_fp8(tiny_llama, tmp_path / "fp8", "channel")
    state = load_file(tmp_path / "fp8" / "model.safetensors")
    missing = next(n for n in state if n.endswith("o_proj.weight_scale"))
    del state[missing]
    save_file(state, tmp_path / "fp8" / "model.safetensors")
    with pytest.raises(ValueError, match=f"{missing.removesuffix('_scale')}: a float8 tensor without"):
        load_model(str(tmp_path / "fp8"), "auto", torch.float32, torch.device("cpu"))


@pytest.mark.parametrize(
    "config,method",
    [
        ({}, None),
        ({"quantization_config": compressed_tensors("channel")}, "fp8"),
        ({"quantization_config": compressed_tensors("tensor")}, "fp8"),
        ({"quantization_config": {"quant_method": "fbgemm_fp8", "activation_scale_ub": 1200.0}}, "fp8"),
        ({"quantization_config": {"quant_method": "fp8", "activation_scheme": "static"}}, "fp8"),
        ({"quantization_config": compressed_tensors("block")}, "fp8"),
        ({"quantization_config": {"quant_method": "fp8", "weight_block_size": [128, 128]}}, "fp8"),
    ],
)
def test_fp8_schemes_with_channel_tensor_or_block_scales_are_served_as_fp8(config, method):
    assert checkpoint_quantization(config) == method
    blocks = config.get("quantization_config", {}).get("weight_block_size") or (
        [128, 128] if "block" in json.dumps(config) else None
    )
    assert fp8_block_size(config) == (None if blocks is None else tuple(blocks))


@pytest.mark.parametrize(
    "quantization,named",
    [
        (compressed_tensors("channel", "int", 8), "int8"),
        (compressed_tensors("group"), "strategy 'group'"),
        ({"quant_method": "awq", "bits": 4}, "quant_method 'awq'"),
        ({"quant_method": "gptq", "bits": 4}, "quant_method 'gptq'"),
    ],
)
def test_other_quantized_checkpoints_are_refused_before_the_server_starts_naming_what_they_are(
    tiny_llama, tmp_path, quantization, named
):
    folder = tmp_path / "quantized"
    shutil.copytree(tiny_llama, folder)
    config = json.loads((folder / "config.json").read_text()) | {"quantization_config": quantization}
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(UnsupportedQuantization, match=named) as refused:
        check_folder_supported(folder)  # what the launcher runs first: exit code 2 and this line
    assert "serve the unquantized checkpoint" in str(refused.value)
