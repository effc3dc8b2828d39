"""A checkpoint saved already quantized (its config.json's `quantization_config`): which of its schemes the engine
serves, and how. Here, not in the GPU worker, so that the launcher refuses one it cannot serve in one line before
starting a process (common/model_info.py's check_folder_supported), as it refuses an architecture.

Served: FP8 e4m3 weights with one scale per output channel, per tensor or per block, the schemes FP8 checkpoints
come in (llm-compressor's `compressed-tensors` "float-quantized" with `strategy` channel, tensor or block;
`fbgemm_fp8`; `fp8`: vLLM's own per-tensor one, and Hugging Face's with `weight_block_size`, as Qwen3's and
DeepSeek's FP8 releases). They run as `--quantization fp8` runs (gpu_worker/models/fp8.py): the worker reads each
weight dequantized (gpu_worker/fp8_checkpoint.py) and quantizes it again: per output channel, or per block for a
block-scaled one (its scales applied in the FP8 product: models/fp8.py). That gives back a per-channel or
block-scaled checkpoint's own values (where its blocks line up with each layer's fused parts and shards, as real
models' do); a per-tensor one's, and a mixture of experts' experts (quantized per channel as they load), are
rounded again on each channel's grid (docs/benchmarks.md, "FP8 weights and KV store").
Activations are quantized per token at every matmul whatever the checkpoint's activation scheme says (a static
`input_scale` is not used). Not served, and named in the refusal: integer weights (GPTQ, AWQ, bitsandbytes, int8
compressed-tensors), anything else.
"""

from __future__ import annotations

from typing import Any

FP8_SCALE_STRATEGIES = ("channel", "tensor", "block")


class UnsupportedQuantization(ValueError):
    """The checkpoint is quantized in a way the engine does not serve."""


def checkpoint_quantization(config: dict[str, Any]) -> str | None:
    """The --quantization a checkpoint's config.json implies: None for an unquantized one, "fp8" for an FP8
    checkpoint the engine serves; UnsupportedQuantization (naming what it found) for any other."""
    quantization = config.get("quantization_config")
    if not quantization:
        return None
    method = quantization.get("quant_method", "?")
    if method == "fbgemm_fp8":
        return "fp8"
    if method == "compressed-tensors":
        for name, group in (quantization.get("config_groups") or {}).items():
            weights = group.get("weights") or {}
            kind = f"{weights.get('type', '?')}{weights.get('num_bits', '?')}, strategy {weights.get('strategy')!r}"
            if weights.get("type") != "float" or weights.get("num_bits") != 8:
                raise _unsupported(f"compressed-tensors group {name!r} has {kind} weights")
            if weights.get("strategy") not in FP8_SCALE_STRATEGIES:
                raise _unsupported(f"compressed-tensors group {name!r} has {kind} weights")
        if not quantization.get("config_groups"):
            raise _unsupported("compressed-tensors without config_groups")
        return "fp8"
    if method == "fp8":  # vLLM's own serialization (per-tensor scales), or Hugging Face's (block scales)
        return "fp8"
    raise _unsupported(f"quant_method {method!r}")


def fp8_block_size(config: dict[str, Any]) -> tuple[int, int] | None:
    """The [rows, columns] of weight each scale covers in a block-scaled FP8 checkpoint; None for any other."""
    quantization = config.get("quantization_config") or {}
    if quantization.get("quant_method") == "fp8" and quantization.get("weight_block_size"):
        rows, cols = quantization["weight_block_size"]
        return int(rows), int(cols)
    for group in (quantization.get("config_groups") or {}).values():
        weights = group.get("weights") or {}
        if weights.get("strategy") == "block":
            rows, cols = weights.get("block_structure") or (128, 128)
            return int(rows), int(cols)
    return None


def _unsupported(found: str) -> UnsupportedQuantization:
    return UnsupportedQuantization(
        f"the checkpoint is quantized ({found}); served: FP8 e4m3 weights with scales per output channel, per "
        "tensor or per block (compressed-tensors float-quantized, fbgemm_fp8, fp8). For another, serve the "
        "unquantized checkpoint (with --quantization fp8 to quantize it at load)"
    )
