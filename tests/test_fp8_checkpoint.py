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

from benchmarks.fp8_checkpoints import compressed_tensors, save_fp8_checkpoint, save_with_weights
from common.checkpoint_quantization import UnsupportedQuantization, checkpoint_quantization, fp8_block_size
from common.model_info import check_folder_supported
from common.sampling_params import SamplingParams
from gpu_worker.model_loader import load_model
from offline import LLM
from tests.tiny_models import random_prompts

BLOCK = (24, 40)  # rows, columns: neither divides the tiny model's sides, so edge blocks are partial


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


@pytest.mark.parametrize("strategy", ["tensor", "block"])
def test_a_per_tensor_or_block_scaled_checkpoint_serves_as_its_dequantized_weights_do(tiny_llama, tmp_path, strategy):
    stands_for = saved_in_fp8(tiny_llama, tmp_path / "fp8", strategy)
    dequantized = save_with_weights(tiny_llama, tmp_path / "dequantized", stands_for)
    cpu = torch.device("cpu")
    served = dict(load_model(str(tmp_path / "fp8"), "auto", torch.float32, cpu, quantization=None).named_buffers())
    reference = load_model(str(dequantized), "auto", torch.float32, cpu, quantization="fp8")
    for name, scale in reference.named_buffers():
        torch.testing.assert_close(served[name], scale, rtol=0, atol=0)
    assert greedy(tmp_path / "fp8") == greedy(dequantized, quantization="fp8")


def test_a_block_scaled_checkpoint_splits_over_tensor_parallel_ranks_as_its_dequantized_weights_do(
    tiny_llama, tmp_path
):
    # Each rank reads its rows (q|k|v, gate|up) or columns (o, down) of the weights, and their blocks' scales.
    dequantized = save_with_weights(
        tiny_llama, tmp_path / "dequantized", saved_in_fp8(tiny_llama, tmp_path / "fp8", "block")
    )
    two = greedy(tmp_path / "fp8", tensor_parallel_size=2)
    assert two == greedy(dequantized, quantization="fp8", tensor_parallel_size=2)


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
