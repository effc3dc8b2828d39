"""Attention backends: one interface, a pure-torch reference and (on CUDA) Triton kernels."""

from gpu_worker.attention.base import AttentionBackend, BatchLayout
from gpu_worker.attention.torch_backend import TorchAttention

__all__ = ["AttentionBackend", "BatchLayout", "TorchAttention", "make_attention_backend", "resolve_attention_backend"]


def resolve_attention_backend(name: str, device: str) -> str:
    """'auto' is Triton on CUDA and the torch reference elsewhere."""
    if name == "auto":
        return "triton" if device.startswith("cuda") else "torch"
    return name


def make_attention_backend(name: str, device: str, block_size: int) -> AttentionBackend:
    name = resolve_attention_backend(name, device)
    if name == "torch":
        return TorchAttention(block_size)
    if name == "triton":
        if not device.startswith("cuda"):
            raise ValueError("--attention-backend triton needs a CUDA device")
        from gpu_worker.attention.triton_backend import TritonAttention

        return TritonAttention(block_size)
    raise ValueError(f"unknown attention backend {name!r}")
