"""Attention backends: one interface, a pure-torch reference and (on CUDA) Triton kernels or FlashInfer's.

Which one runs (--attention-backend): torch anywhere, triton and flashinfer on CUDA. auto is flashinfer on CUDA
where it imports and runs the model's attention (FlashInferAttention's model_problem), else triton; torch
elsewhere. The choice comes with its reason, which the worker logs.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from gpu_worker.attention.base import AttentionBackend, BatchLayout, LayerAttention
from gpu_worker.attention.torch_backend import TorchAttention

__all__ = [
    "AttentionBackend",
    "AttentionBackendUnavailable",
    "BackendChoice",
    "BatchLayout",
    "LayerAttention",
    "TorchAttention",
    "choose_attention_backend",
    "make_attention_backend",
]


class AttentionBackendUnavailable(ValueError):
    """The backend asked for by name cannot run here (no CUDA device, FlashInfer missing, a model it cannot run)."""


@dataclass(frozen=True, slots=True)
class BackendChoice:
    name: str  # "torch" | "triton" | "flashinfer"
    reason: str


def choose_attention_backend(
    requested: str, device_type: str, layers: list[LayerAttention], dtype: torch.dtype, kv_cache_dtype: str = "auto"
) -> BackendChoice:
    """The backend for `requested` (--attention-backend) on a device of `device_type`, for a model whose layers'
    attention is `layers`, run in `dtype`; kv_cache_dtype: --kv-cache-dtype's ("auto": the model's dtype).
    AttentionBackendUnavailable where a backend asked for by name cannot run."""
    if requested == "torch":
        return BackendChoice("torch", "asked for")
    if device_type != "cuda":
        if requested == "auto":
            return BackendChoice("torch", f"auto on {device_type}: the Triton and FlashInfer kernels need CUDA")
        raise AttentionBackendUnavailable(
            f"--attention-backend {requested} needs a CUDA device (this one is {device_type})"
        )
    if requested == "triton":
        return BackendChoice("triton", "asked for")
    if requested not in ("auto", "flashinfer"):
        raise AttentionBackendUnavailable(f"unknown attention backend {requested!r}")
    problem = _flashinfer_problem(layers, dtype, kv_cache_dtype)
    if problem is None:
        return BackendChoice(
            "flashinfer", "asked for" if requested == "flashinfer" else "auto: FlashInfer runs this model"
        )
    if requested == "flashinfer":
        raise AttentionBackendUnavailable(f"--attention-backend flashinfer cannot run here: {problem}")
    return BackendChoice("triton", f"auto: not FlashInfer, {problem}")


def _flashinfer_problem(layers: list[LayerAttention], dtype: torch.dtype, kv_cache_dtype: str) -> str | None:
    from gpu_worker.attention import flashinfer_backend

    if kv_cache_dtype != "auto":
        return f"its fp8 KV path is not wired here (--kv-cache-dtype {kv_cache_dtype})"
    return flashinfer_backend.model_problem(layers, dtype) or flashinfer_backend.import_problem()


def make_attention_backend(
    name: str, device: torch.device, block_size: int, layers: list[LayerAttention], dtype: torch.dtype
) -> AttentionBackend:
    """name: a choice's (choose_attention_backend); layers: the model's, on this rank."""
    if name == "torch":
        return TorchAttention(block_size)
    if name == "triton":
        from gpu_worker.attention.triton_backend import TritonAttention

        return TritonAttention(block_size, layers[0].num_kv_heads, device)
    if name == "flashinfer":
        from gpu_worker.attention.flashinfer_backend import FlashInferAttention

        return FlashInferAttention(block_size, layers, dtype, device)
    raise ValueError(f"unknown attention backend {name!r}")
