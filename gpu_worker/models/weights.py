"""Copying checkpoint tensors into our parameters, with the checks that make a wrong checkpoint loud."""

from __future__ import annotations

import torch
from torch import nn


def copy_param(params: dict[str, nn.Parameter], name: str, tensor: torch.Tensor, rows: slice | None = None) -> None:
    """Copy `tensor` into parameter `name` (into rows `rows` of it, for fused projections)."""
    param = params.get(name)
    if param is None:
        raise ValueError(f"checkpoint tensor {name!r} has no place in the model")
    target = param.data if rows is None else param.data[rows]
    if target.shape != tensor.shape:
        raise ValueError(f"{name}: checkpoint shape {tuple(tensor.shape)} != model shape {tuple(target.shape)}")
    target.copy_(tensor)


def check_all_loaded(params: dict[str, nn.Parameter], loaded: set[str]) -> None:
    missing = sorted(set(params) - loaded)
    if missing:
        raise ValueError(f"checkpoint lacks {len(missing)} tensors, e.g. {missing[:3]}")


VOCAB_ALIGNMENT = 64


def padded_vocab_size(vocab_size: int) -> int:
    """Embedding and head rows rounded up to a multiple of 64: the logits matmul then runs on aligned
    tiles (GPT-2's 50257 rows made cuBLAS pick a kernel several times slower). Extra rows are never
    looked up, and their logits are cut off."""
    return -(-vocab_size // VOCAB_ALIGNMENT) * VOCAB_ALIGNMENT
