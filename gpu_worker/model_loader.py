"""Build our model for a folder and fill its weights: from safetensors/.bin files, or random (dummy)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from tqdm import tqdm
from transformers import AutoConfig

from common.model_source import checkpoint_files
from gpu_worker.models import fp8, model_class_for
from gpu_worker.models.weights import load_tensor
from gpu_worker.parallel import SINGLE, TensorParallel


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
    quantization: "fp8" quantizes the projections' loaded (or random) weights, each rank its own shard."""
    hf_config = AutoConfig.from_pretrained(folder)
    cls = model_class_for(hf_config)
    with _default_dtype(dtype), device:
        model = cls(hf_config, fused_kernels=fused_kernels, tp=tp)
    if load_format == "dummy":
        _init_dummy(model, hf_config, seed)
    else:
        files = checkpoint_files(folder)
        model.load_weights(
            tqdm(
                _read_tensors(files),
                desc="Loading weights",
                unit=" tensors",
                disable=not progress,
                total=_count_tensors(files),
            )
        )
    if quantization is not None:
        fp8.quantize_weights(model, quantization)
    return model.eval().requires_grad_(False)


@contextlib.contextmanager
def _default_dtype(dtype: torch.dtype):
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


def _count_tensors(files: list[str]) -> int | None:
    if not files[0].endswith(".safetensors"):
        return None
    from safetensors import safe_open

    total = 0
    for path in files:
        with safe_open(path, framework="pt") as f:
            total += len(f.keys())
    return total


def _read_tensors(files: list[str]) -> Iterator[tuple[str, torch.Tensor]]:
    for path in files:
        if path.endswith(".safetensors"):
            from safetensors import safe_open

            with safe_open(path, framework="pt") as f:
                for name in f.keys():  # noqa: SIM118 (safe_open is not iterable)
                    yield name, f.get_tensor(name)
        else:
            yield from torch.load(path, map_location="cpu", weights_only=True, mmap=True).items()


def _init_dummy(model: torch.nn.Module, hf_config, seed: int) -> None:
    """Random weights with the checkpoint's scale, so activations stay in a realistic range. A tensor-parallel
    layer's are drawn whole and split (load_tensor), so every tensor-parallel size gets the same model."""
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
        load_tensor(model, params, name, values.to(param.dtype))
