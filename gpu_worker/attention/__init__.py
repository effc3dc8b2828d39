"""Attention backends: one interface, a pure-torch reference and (on CUDA) Triton kernels."""

import torch

from gpu_worker.attention.base import AttentionBackend, BatchLayout
from gpu_worker.attention.torch_backend import TorchAttention

__all__ = ["AttentionBackend", "BatchLayout", "TorchAttention", "make_attention_backend", "resolve_attention_backend"]


def resolve_attention_backend(name: str, device: str) -> str:
    """'auto' is Triton on CUDA and the torch reference elsewhere."""
    if name == "auto":
        return "triton" if device.startswith("cuda") else "torch"
    return name


def make_attention_backend(name: str, device: torch.device, block_size: int, num_kv_heads: int) -> AttentionBackend:
    """num_kv_heads: the model's, on this rank."""
    name = resolve_attention_backend(name, device.type)
    if name == "torch":
        return TorchAttention(block_size)
    if name == "triton":
        if device.type != "cuda":
            raise ValueError("--attention-backend triton needs a CUDA device")
        from gpu_worker.attention.triton_backend import TritonAttention

        return TritonAttention(block_size, num_kv_heads, device)
    raise ValueError(f"unknown attention backend {name!r}")
