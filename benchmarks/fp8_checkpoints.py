"""FP8 checkpoints written from a float one, as quantization tools save them, for the engine to serve
(common/checkpoint_quantization.py): benchmarks.quantization_quality measures what serving one costs, and
tests/test_fp8_checkpoint.py that the engine reads each as the values it stands for.

    save_fp8_checkpoint(folder, out, "channel" | "tensor" | "block", block=(128, 128)) -> the weights it stands for
    save_with_weights(folder, out, weights)            folder's checkpoint with these weights instead

The decoder layers' projections (q/k/v/o, gate/up/down) become e4m3 with a scale per output channel, per tensor
(llm-compressor's `compressed-tensors`, with a static input scale and KV scales beside them, as it saves them) or
per block (Hugging Face's `fp8` with `weight_block_size`, its scales `<weight>_scale_inv`); each scale puts its
channel's, tensor's or block's largest magnitude at 448. One safetensors file (a small model's).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from gpu_worker.models import fp8

PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def compressed_tensors(strategy: str, weight_type: str = "float", num_bits: int = 8) -> dict:
    """llm-compressor's quantization_config: weights as told, activations e4m3 per token, dynamic."""
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


def by_block(w: torch.Tensor, block: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """w [N, K] in e4m3 with one scale per block (edge blocks partial; fp8.quantize_blocks): (values, scales
    [ceil(N/rows), ceil(K/cols)], each entry's scale [N, K])."""
    values, per_row = fp8.quantize_blocks(w, block)
    return values, per_row[:: block[0]].contiguous(), fp8.scale_of_each(per_row, block[1], w.shape[1])


def save_fp8_checkpoint(
    folder: Path, out: Path, strategy: str, block: tuple[int, int] = (128, 128)
) -> dict[str, torch.Tensor]:
    """`folder` (config, tokenizer, one model.safetensors) copied to `out` with its projections in e4m3, scaled
    per "channel", "tensor" or "block". Returns the weights the e4m3 tensors stand for (float32, by name)."""
    shutil.copytree(folder, out)
    state = {
        name: t.float() if t.is_floating_point() else t for name, t in load_file(out / "model.safetensors").items()
    }
    stands_for = {}
    for name in [n for n in state if n.endswith(".weight") and n.rsplit(".", 2)[-2] in PROJECTIONS]:
        w = state[name]
        if strategy == "channel":
            q, scale = fp8.quantize_rows(w)
            each = scale
        elif strategy == "tensor":
            scale = each = (w.abs().amax() / fp8.FP8_MAX).clamp(min=fp8.MIN_SCALE).reshape(1)
            q = (w / scale).clamp(-fp8.FP8_MAX, fp8.FP8_MAX).to(fp8.FP8)
        else:
            q, scale, each = by_block(w, block)
        state[name], state[name + ("_scale_inv" if strategy == "block" else "_scale")] = q, scale
        if strategy != "block":
            state[name.replace(".weight", ".input_scale")] = torch.ones(1)
        stands_for[name] = q.float() * each
    if strategy != "block":
        for layer in {n.split(".self_attn")[0] for n in state if ".self_attn." in n}:
            state[f"{layer}.self_attn.k_scale"], state[f"{layer}.self_attn.v_scale"] = torch.ones(()), torch.ones(())
    save_file(state, out / "model.safetensors")
    config = json.loads((out / "config.json").read_text())
    blocks = {"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": list(block)}
    config["quantization_config"] = blocks if strategy == "block" else compressed_tensors(strategy)
    (out / "config.json").write_text(json.dumps(config))
    return stands_for


def save_with_weights(folder: Path, out: Path, weights: dict[str, torch.Tensor]) -> Path:
    """`folder` copied to `out` with these tensors in place of its own (a checkpoint's dequantized weights)."""
    shutil.copytree(folder, out)
    save_file(load_file(out / "model.safetensors") | weights, out / "model.safetensors")
    return out
