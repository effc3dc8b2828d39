"""Copying checkpoint tensors into our parameters, with the checks that make a wrong checkpoint loud."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any, Protocol

import torch
from torch import nn


class TensorSource(Protocol):
    """A whole checkpoint tensor as a layer's `load` sees it: its shape, and the parts it keeps, read by
    indexing (`t[rows]`, `t[:, cols]`, `t[...]` for all of it). A torch.Tensor is one (random weights); so is
    gpu_worker/checkpoint_reader.py's CheckpointTensor, which reads only the part indexed."""

    @property
    def shape(self) -> torch.Size: ...

    def __getitem__(self, index: Any) -> torch.Tensor: ...

    def t(self) -> TensorSource: ...  # a 2-D tensor's transpose, read the same way


# Where a checkpoint tensor goes: our parameter's name and which part of it (None: all of it), or None to skip.
Placement = tuple[str, Any] | None


def copy_param(params: dict[str, nn.Parameter], name: str, tensor: TensorSource) -> None:
    """Copy `tensor` into parameter `name`."""
    param = params.get(name)
    if param is None:
        raise ValueError(f"checkpoint tensor {name!r} has no place in the model")
    target = param.data
    if target.shape != tensor.shape:
        raise ValueError(f"{name}: checkpoint shape {tuple(tensor.shape)} != model shape {tuple(target.shape)}")
    target.copy_(tensor[...])


def load_tensor(model: nn.Module, params: dict[str, nn.Parameter], name: str, tensor: TensorSource, part=None) -> None:
    """Copy checkpoint tensor `name` into the model: a tensor-parallel layer keeps its rank's share (of part
    `part` of a fused projection, or all of it); any other parameter takes it whole."""
    owner, _, attr = name.rpartition(".")
    module = model.get_submodule(owner) if name in params else None
    if module is not None and hasattr(module, "full_shape"):
        try:
            module.load(attr, tensor, part)
        except ValueError as exc:
            raise ValueError(f"{name}: {exc}") from None
    else:
        copy_param(params, name, tensor)


def load_checkpoint(
    model: nn.Module, weights: Iterable[tuple[str, TensorSource]], place: Callable[[str], Placement]
) -> None:
    """Copy every checkpoint tensor where `place` puts it, then check that nothing is missing: a parameter
    loaded in parts (q|k|v, gate|up, one expert at a time) must have received every part its layer has
    (`part_count`: the fused linear layers' and the experts')."""
    params = dict(model.named_parameters())
    loaded: set[str] = set()
    parts: dict[str, set] = {}
    for checkpoint_name, tensor in weights:
        placement = place(checkpoint_name)
        if placement is None:
            continue
        name, part = placement
        load_tensor(model, params, name, tensor, part)
        if part is None:
            loaded.add(name)
        else:
            parts.setdefault(name, set()).add(part)
    for name, seen in parts.items():
        owner, _, attr = name.rpartition(".")
        if len(seen) == model.get_submodule(owner).part_count(attr):
            loaded.add(name)
        elif name not in loaded:
            raise ValueError(f"checkpoint lacks parts of fused tensor {name}: has {sorted(seen, key=str)}")
    check_all_loaded(params, loaded)


def check_all_loaded(params: dict[str, nn.Parameter], loaded: set[str]) -> None:
    missing = sorted(set(params) - loaded)
    if missing:
        raise ValueError(f"checkpoint lacks {len(missing)} tensors, e.g. {missing[:3]}")


VOCAB_ALIGNMENT = 64


def padded_vocab_size(vocab_size: int, ranks: int = 1) -> int:
    """Embedding and head rows rounded up to a multiple of 64 per tensor-parallel rank: the logits matmul
    then runs on aligned tiles (GPT-2's 50257 rows made cuBLAS pick a kernel several times slower), and
    every rank holds as many. Extra rows are never looked up, and their logits are cut off."""
    multiple = VOCAB_ALIGNMENT * ranks
    return -(-vocab_size // multiple) * multiple
