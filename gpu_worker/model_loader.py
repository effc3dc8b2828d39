"""Build our model for a folder and fill its weights: from safetensors/.bin files (read tensor by tensor onto
the device, each rank its part: checkpoint_reader.py), or random (dummy)."""

from __future__ import annotations

import contextlib
import json
import logging
from pathlib import Path

import torch
from transformers import AutoConfig, PretrainedConfig

from common.checkpoint_quantization import checkpoint_quantization, fp8_block_size
from common.model_source import checkpoint_files
from gpu_worker.checkpoint_reader import CheckpointReader
from gpu_worker.fp8_checkpoint import dequantized, read_weight_scales
from gpu_worker.models import fp8, model_class_for
from gpu_worker.models.moe import MoEExperts
from gpu_worker.models.weights import load_tensor
from gpu_worker.parallel import SINGLE, TensorParallel

log = logging.getLogger(__name__)


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[name]


def load_model(
    folder: str,
    load_format: str,
    dtype: torch.dtype,
    device: torch.device,
    seed: int = 0,
    progress: bool = False,
    fused_kernels: bool = False,
    tp: TensorParallel = SINGLE,
    quantization: str | None = None,
) -> torch.nn.Module:
    """fused_kernels: the model's Triton kernels for elementwise steps (CUDA) instead of torch ops.
    tp: this rank's share of the model (each layer takes its share of the whole tensors it is given).
    quantization: "fp8" quantizes the projections' loaded (or random) weights, each rank its own shard; the
    experts' rows as they load (models/moe.py: a mixture of experts is too large to build whole first), per
    block where the checkpoint was saved with block scales. A
    checkpoint saved in FP8 (common/checkpoint_quantization.py) is served so whether or not it is asked for."""
    config = json.loads((Path(folder) / "config.json").read_text())
    saved_as = checkpoint_quantization(config)
    block = fp8_block_size(config)  # random weights too: a shape served as its checkpoint would be
    if saved_as is not None and quantization is None:
        log.info("the checkpoint is quantized (%s): serving it with --quantization %s", saved_as, saved_as)
        quantization = saved_as
    if quantization is not None:
        fp8.check_method(quantization, device)
    model, hf_config = build_model(folder, dtype, device, fused_kernels, tp, quantization)
    if quantization is not None and block is not None:
        for experts in (module for module in model.modules() if isinstance(module, MoEExperts)):
            experts.use_weight_blocks(block)  # quantized per block as they load (the dense layers after loading)
    if load_format == "dummy":
        _init_dummy(model, hf_config, seed, dtype)
    else:
        read_weights(model, folder, device, progress, dequantize=saved_as is not None, block=block)
    if quantization is not None:
        fp8.quantize_weights(model, quantization, block)  # a block-scaled checkpoint: its own blocks again
    return model.eval().requires_grad_(False)


def build_model(
    folder: str,
    dtype: torch.dtype,
    device: torch.device,
    fused_kernels: bool = False,
    tp: TensorParallel = SINGLE,
    quantization: str | None = None,
) -> tuple[torch.nn.Module, PretrainedConfig]:
    """The model's layers on `device` in `dtype` (experts in FP8 with quantization "fp8"), their weights not yet
    loaded; and its config."""
    hf_config = AutoConfig.from_pretrained(folder)
    with default_dtype(dtype), device:
        model = model_class_for(hf_config)(hf_config, fused_kernels=fused_kernels, tp=tp, quantization=quantization)
    return model, hf_config


def read_weights(
    model: torch.nn.Module,
    folder: str,
    device: torch.device,
    progress: bool = False,
    dequantize: bool = False,
    block: tuple[int, int] | None = None,
) -> int:
    """Fill the model from the folder's weight files, each tensor's part this rank keeps read straight onto
    `device` (gpu_worker/checkpoint_reader.py); dequantize: an FP8 checkpoint's weights read as the values
    they stand for (fp8_checkpoint.py; block: its scales' blocks, if so). Returns the bytes read."""
    files = checkpoint_files(folder)
    reader = CheckpointReader(files, device, progress)
    model.load_weights(dequantized(reader, read_weight_scales(files, device), block) if dequantize else reader)
    return reader.bytes_read


@contextlib.contextmanager
def default_dtype(dtype: torch.dtype):
    """Layers built inside take `dtype` as the model dtype (their parameters', and what they read back as it)."""
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


def _init_dummy(model: torch.nn.Module, hf_config, seed: int, dtype: torch.dtype) -> None:
    """Random weights with the checkpoint's scale, so activations stay in a realistic range. A tensor-parallel
    layer's are drawn whole and split (load_tensor), so every tensor-parallel size gets the same model. Each is
    handed over in the model dtype, as a checkpoint's would be: FP8 experts quantize it as they load."""
    std = getattr(hf_config, "initializer_range", 0.02)
    params = dict(model.named_parameters())
    # Drawn where the model lives: an 8B model's weights take seconds on a GPU, a minute on the CPU's generator.
    device = next(iter(params.values())).device
    gen = torch.Generator(device=device).manual_seed(seed)
    for name, param in params.items():
        owner, _, attr = name.rpartition(".")
        module = model.get_submodule(owner)
        shape = module.full_shape(attr) if hasattr(module, "full_shape") else param.shape
        if "norm" in name or "ln_" in name:
            values = torch.ones(shape, device=device) if name.endswith("weight") else torch.zeros(shape, device=device)
        elif name.endswith("bias"):
            values = torch.zeros(shape, device=device)
        else:
            values = torch.randn(shape, generator=gen, device=device) * std
        load_tensor(model, params, name, values.to(param.dtype if param.dtype != fp8.FP8 else dtype))
