"""Checkpoints saved in FP8 (common/checkpoint_quantization.py, gpu_worker/fp8_checkpoint.py): a per-channel one
serves exactly as the engine serves the float checkpoint it came from with --quantization fp8, a per-tensor one as
its dequantized weights would; what the engine cannot serve is refused, naming what it found."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from common.checkpoint_quantization import UnsupportedQuantization, checkpoint_quantization
from common.model_info import check_folder_supported
from common.sampling_params import SamplingParams
from gpu_worker.model_loader import load_model
from gpu_worker.models import fp8
from offline import LLM
from tests.tiny_models import random_prompts

PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def compressed_tensors(strategy: str, weight_type: str = "float", num_bits: int = 8) -> dict:
    """llm-compressor's quantization_config for FP8 weights with dynamic per-token activations."""
    return {
        "quant_method": "compressed-tensors",
        "format": "float-quantized",
        "config_groups": {
            "group_0": {
                "targets": ["Linear"],
                "weights": {"num_bits": num_bits, "type": weight_type, "strategy": strategy, "symmetric": True},
                "input_activations": {"num_bits": 8, "type": "float", "strategy": "token", "dynamic": True},
            }
        },
        "ignore": ["lm_head"],
    }


def saved_in_fp8(folder: Path, out: Path, strategy: str) -> dict[str, torch.Tensor]:
    """`folder`'s checkpoint with its projections' weights in e4m3 and a scale per output channel or per tensor,
    a static input scale and KV scales beside them (which the engine leaves aside), as llm-compressor saves one.
    Returns the weights the FP8 tensors stand for (dequantized)."""
    shutil.copytree(folder, out)
    state = load_file(out / "model.safetensors")
    stands_for = {}
    for name in [n for n in state if n.rsplit(".", 2)[-2] in PROJECTIONS]:
        w = state[name]
        if strategy == "channel":
            q, scale = fp8.quantize_rows(w)
        else:
            scale = (w.abs().amax() / fp8.FP8_MAX).reshape(1)
            q = (w / scale).clamp(-fp8.FP8_MAX, fp8.FP8_MAX).to(fp8.FP8)
        state[name], state[name + "_scale"] = q, scale
        state[name.replace(".weight", ".input_scale")] = torch.ones(1)
        stands_for[name] = q.float() * scale
    for layer in {n.split(".self_attn")[0] for n in state if ".self_attn." in n}:
        state[f"{layer}.self_attn.k_scale"], state[f"{layer}.self_attn.v_scale"] = torch.ones(()), torch.ones(())
    save_file(state, out / "model.safetensors")
    config = json.loads((out / "config.json").read_text())
    config["quantization_config"] = compressed_tensors(strategy)
    (out / "config.json").write_text(json.dumps(config))
    return stands_for


def greedy(folder: Path, **engine_args) -> list[list[int]]:
    llm = LLM(str(folder), device="cpu", dtype="float32", **engine_args)
    prompts = random_prompts(4, [7, 19, 30, 3], vocab=512, seed=5)
    outs = llm.generate(prompts, SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True))
    return [o.token_ids for o in outs]


def test_a_per_channel_fp8_checkpoint_serves_as_its_float_one_does_with_quantization_fp8(tiny_llama, tmp_path):
    saved_in_fp8(tiny_llama, tmp_path / "fp8", "channel")
    cpu = torch.device("cpu")
    served = load_model(str(tmp_path / "fp8"), "auto", torch.float32, cpu)  # no --quantization: the checkpoint's
    quantized = load_model(str(tiny_llama), "auto", torch.float32, cpu, quantization="fp8")
    theirs = dict(quantized.named_parameters()) | dict(quantized.named_buffers())
    for name, mine in [*served.named_parameters(), *served.named_buffers()]:
        if mine.dtype == fp8.FP8:  # the checkpoint's own e4m3 values, bit for bit
            assert torch.equal(mine.view(torch.uint8), theirs[name].view(torch.uint8)), name
        else:  # its scales within a rounding of the float32 products they came back through; the rest equal
            torch.testing.assert_close(mine, theirs[name], rtol=2e-7, atol=0), name
    assert greedy(tmp_path / "fp8") == greedy(tiny_llama, quantization="fp8")


def test_a_per_tensor_fp8_checkpoint_serves_as_its_dequantized_weights_do(tiny_llama, tmp_path):
    stands_for = saved_in_fp8(tiny_llama, tmp_path / "fp8", "tensor")
    shutil.copytree(tiny_llama, tmp_path / "dequantized")
    state = load_file(tmp_path / "dequantized" / "model.safetensors") | stands_for
    save_file(state, tmp_path / "dequantized" / "model.safetensors")
    assert greedy(tmp_path / "fp8") == greedy(tmp_path / "dequantized", quantization="fp8")


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
    ],
)
def test_fp8_schemes_with_channel_or_tensor_scales_are_served_as_fp8(config, method):
    assert checkpoint_quantization(config) == method


@pytest.mark.parametrize(
    "quantization,named",
    [
        (compressed_tensors("block"), "strategy 'block'"),
        (compressed_tensors("channel", "int", 8), "int8"),
        ({"quant_method": "fp8", "weight_block_size": [128, 128]}, "block scales"),
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
