"""A checkpoint saved already quantized (its config.json's `quantization_config`): which of its schemes the engine
serves, and how. Here, not in the GPU worker, so that the launcher refuses one it cannot serve in one line before
starting a process (common/model_info.py's check_folder_supported), as it refuses an architecture.

Served: FP8 e4m3 weights with one scale per output channel or per tensor, the schemes vLLM's FP8 checkpoints come
in (llm-compressor's `compressed-tensors` "float-quantized" with `strategy` channel or tensor, `fbgemm_fp8`, and
vLLM's own `fp8` without block scales). They run as `--quantization fp8` runs (gpu_worker/models/fp8.py): the
worker reads each weight dequantized (gpu_worker/fp8_checkpoint.py) and quantizes it again with one scale per
output channel, which gives back a per-channel checkpoint's own values; activations are quantized per token at
every matmul whatever the checkpoint's activation scheme says (a static `input_scale` is not used). Not served,
and named in the refusal: block-scaled FP8 (`weight_block_size`, `strategy: block`), integer weights (GPTQ, AWQ,
bitsandbytes, int8 compressed-tensors), anything else.
"""

from __future__ import annotations

from typing import Any

FP8_BY_CHANNEL_OR_TENSOR = ("channel", "tensor")


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
            if weights.get("strategy") not in FP8_BY_CHANNEL_OR_TENSOR:
                raise _unsupported(f"compressed-tensors group {name!r} has {kind} weights")
        if not quantization.get("config_groups"):
            raise _unsupported("compressed-tensors without config_groups")
        return "fp8"
    if method == "fp8":  # vLLM's own serialization: per-tensor scales; Hugging Face's adds block scales
        if quantization.get("weight_block_size"):
            raise _unsupported(f"FP8 with block scales (weight_block_size {quantization['weight_block_size']})")
        return "fp8"
    raise _unsupported(f"quant_method {method!r}")


def _unsupported(found: str) -> UnsupportedQuantization:
    return UnsupportedQuantization(
        f"the checkpoint is quantized ({found}); served: FP8 e4m3 weights with one scale per output channel or "
        "per tensor (compressed-tensors float-quantized, fbgemm_fp8, fp8 without block scales). For another, "
        "serve the unquantized checkpoint (with --quantization fp8 to quantize it at load)"
    )
