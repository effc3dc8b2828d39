"""An FP8 checkpoint's weights, read dequantized: the layers load them as they load any checkpoint's, and
`--quantization fp8` (models/fp8.py) quantizes them again once loaded (common/checkpoint_quantization.py says
which checkpoints are served so).

    its weight scales (`<weight>_scale` or `<weight>_scale_inv`, float32: [N, 1], [N], [1] or [] for a channel's or
    the tensor's; [ceil(N / rows), ceil(K / cols)] for blocks) ──read first, whole: KBs a layer
    (name, float8 weight [N, K]) ──DequantizedWeight──▶ a layer's `load` indexes it ──▶ q[part] * scale[part]

Indexing reads only that part's bytes, as CheckpointTensor does (a tensor-parallel rank its shard), and scales
it in float32 on the device; the parameter's copy_ rounds it to the model dtype once. Re-quantized with one scale
per output channel, a per-channel checkpoint's weights come back as its own values (each channel's largest
magnitude is 448 times its scale, both ways). The checkpoint's other scales (static activation scales, KV scales)
are skipped: activations are quantized per token at every matmul and the KV store keeps its own scales.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch

from gpu_worker.checkpoint_reader import CheckpointReader
from gpu_worker.models.weights import TensorSource

SCALE_SUFFIXES = ("_scale", "_scale_inv")  # a weight's: "<...>.weight_scale" (Hugging Face's fp8: "_scale_inv")
# Tensors of FP8 checkpoints that scale what the engine quantizes its own way.
SKIPPED_SUFFIXES = (".input_scale", ".input_scale_ub", ".k_scale", ".v_scale", ".q_scale", ".output_scale")


class DequantizedWeight:
    """A checkpoint's float8 weight [N, K] with its scale (one per output channel, or one for the tensor) as a
    TensorSource of the values they stand for, float32."""

    def __init__(self, name: str, values: TensorSource, scale: torch.Tensor, block: tuple[int, int] | None = None):
        self.name = name
        self.values = values
        self.block = block
        if len(values.shape) != 2:
            raise ValueError(f"{name}: an FP8 weight of shape {tuple(values.shape)} (served: [out, in] matrices)")
        channels, inputs = values.shape
        if block is not None:
            blocks = (-(-channels // block[0]), -(-inputs // block[1]))
            if tuple(scale.shape) != blocks:
                raise ValueError(f"{name}: scales {tuple(scale.shape)} for blocks of {block}: expected {blocks}")
            self.scale = scale
        elif scale.numel() == 1:
            self.scale = scale.reshape(())
        elif scale.numel() == channels:
            self.scale = scale.reshape(channels, 1)
        else:
            raise ValueError(
                f"{name}: {scale.numel()} scales for {channels} output channels (served: one per channel, one "
                "per tensor, or blocks)"
            )

    @property
    def shape(self) -> torch.Size:
        return self.values.shape

    def __getitem__(self, index) -> torch.Tensor:
        part = self.values[index].float()
        if self.scale.dim() == 0:
            return part * self.scale.to(part.device)
        rows, cols = (*index, slice(None))[:2] if isinstance(index, tuple) else (index, slice(None))
        rows = slice(None) if rows is Ellipsis else rows  # t[rows], t[:, cols], t[rows, cols], t[...]
        if self.block is None:
            return part * self.scale[rows].to(part.device)
        channels, inputs = self.values.shape
        row_blocks = torch.arange(channels)[rows] // self.block[0]
        col_blocks = torch.arange(inputs)[cols] // self.block[1]
        return part * self.scale[row_blocks][:, col_blocks].to(part.device)

    def t(self) -> TensorSource:
        raise ValueError(f"{self.name}: an FP8 weight stored transposed (GPT-2's Conv1D layout) is not supported")


class UnscaledWeight:
    """Any other tensor of an FP8 checkpoint: read as it is, unless it is float8 (a scale the checkpoint lacks
    would leave its values unscaled: refused)."""

    def __init__(self, name: str, values: TensorSource):
        self.name = name
        self.values = values

    @property
    def shape(self) -> torch.Size:
        return self.values.shape

    def __getitem__(self, index) -> torch.Tensor:
        part = self.values[index]
        if part.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
            raise ValueError(f"{self.name}: a float8 tensor without a {self.name}_scale beside it")
        return part

    def t(self) -> TensorSource:
        return UnscaledWeight(self.name, self.values.t())


def _weight_of(name: str) -> str | None:
    """The weight a scale tensor's name belongs to; None for any other name."""
    for suffix in SCALE_SUFFIXES:
        if name.endswith(".weight" + suffix):
            return name.removesuffix(suffix)
    return None


def read_weight_scales(files: list[str], device: torch.device) -> dict[str, torch.Tensor]:
    """Every weight's scale tensor in the checkpoint, whole, float32, by its weight's name."""
    return {
        weight: tensor[...].float()
        for name, tensor in CheckpointReader(files, device)
        if (weight := _weight_of(name)) is not None
    }


def dequantized(
    weights: Iterable[tuple[str, TensorSource]],
    scales: dict[str, torch.Tensor],
    block: tuple[int, int] | None = None,
) -> Iterator[tuple[str, TensorSource]]:
    """The checkpoint's tensors as the layers load them: each scaled weight dequantized (block: the [rows,
    columns] each scale covers, for a block-scaled checkpoint), its scale and the scales the engine does not use
    left out."""
    for name, tensor in weights:
        if name.endswith(SKIPPED_SUFFIXES) or _weight_of(name) is not None:
            continue
        scale = scales.get(name)
        if scale is None:
            yield name, UnscaledWeight(name, tensor)
        else:
            yield name, DequantizedWeight(name, tensor, scale, block)
