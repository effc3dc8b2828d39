"""Reading a checkpoint's weight files onto the device, one tensor at a time, each rank only its part.

    shard files ──mapped (safetensors' safe_open, or torch.load(mmap=True) for .bin)──▶ CheckpointTensor
        (nothing read yet) ──layer.load indexes it: t[rows], t[:, cols], t[...]──▶ only those bytes are read
        from the page cache, copied once to the device; the parameter's copy_ converts them there

No tensor is copied whole into CPU memory unless a rank keeps it whole, and never the whole model: the files
are mapped (their pages are the page cache's, counted in RssFile while a shard is open, not copies); a part
that is not contiguous in the file (a row-parallel weight's columns) is gathered into one CPU buffer of that
part's size on its way to a GPU.
"""

from __future__ import annotations

import contextlib
import math
import os
from collections.abc import Iterator
from typing import Any

import torch
from tqdm import tqdm

# Bytes per element of safetensors' dtype names (the progress bar's count; a name missing here moves the
# bar at the end of its shard instead).
_ITEM_SIZE = {"F64": 8, "I64": 8, "U64": 8, "F32": 4, "I32": 4, "U32": 4, "F16": 2, "BF16": 2, "I16": 2}
_ITEM_SIZE |= {"U16": 2, "I8": 1, "U8": 1, "BOOL": 1, "F8_E4M3": 1, "F8_E5M2": 1}


class CheckpointTensor:
    """A checkpoint tensor not read yet. Indexing it (torch's rules) reads that part onto the device: the
    one way a layer's `load` takes its share. `t()` is its transpose, read the same way (GPT-2's Conv1D
    weights are stored [in, out])."""

    def __init__(self, source, shape: tuple[int, ...], reader: CheckpointReader, transposed: bool = False):
        self._source = source  # safetensors' slice, or a tensor mapped from a .bin file: both index lazily
        self._stored_shape = shape
        self._reader = reader
        self._transposed = transposed

    @property
    def shape(self) -> torch.Size:
        return torch.Size(reversed(self._stored_shape) if self._transposed else self._stored_shape)

    def t(self) -> CheckpointTensor:
        if len(self._stored_shape) != 2:
            raise ValueError(f"t() of a {len(self._stored_shape)}-dimensional checkpoint tensor")
        return CheckpointTensor(self._source, self._stored_shape, self._reader, not self._transposed)

    def __getitem__(self, index) -> torch.Tensor:
        part = self._source[_swap_axes(index)].t() if self._transposed else self._source[index]
        self._reader.bytes_read += part.nbytes
        return part.to(self._reader.device)


def _swap_axes(index):
    """The index into the stored [a, b] tensor that reads what `index` selects from its transpose."""
    if index is Ellipsis:
        return index
    rows, cols = (*index, slice(None))[:2] if isinstance(index, tuple) else (index, slice(None))
    return cols, rows


class CheckpointReader:
    """The checkpoint's tensors, shard after shard, as (name, CheckpointTensor). `bytes_read`: what this
    process has read so far (a tensor-parallel rank about 1/size of the split weights). The progress bar
    (stderr) counts the checkpoint's bytes walked, with the shard it is in."""

    def __init__(self, files: list[str], device: torch.device, progress: bool = False):
        self.files = files
        self.device = device
        self.progress = progress
        self.bytes_read = 0

    def __iter__(self) -> Iterator[tuple[str, CheckpointTensor]]:
        sizes = [os.path.getsize(path) for path in self.files]
        with tqdm(
            total=sum(sizes),
            desc="Loading weights",
            unit="B",
            unit_scale=True,
            unit_divisor=1024,
            disable=not self.progress,
        ) as bar:
            for number, (path, size) in enumerate(zip(self.files, sizes), start=1):
                bar.set_postfix_str(f"shard {number}/{len(self.files)}", refresh=False)
                walked = 0
                with _open_shard(path) as entries:
                    for name, source, shape, nbytes in entries:
                        yield name, CheckpointTensor(source, shape, self)
                        bar.update(nbytes)
                        walked += nbytes
                bar.update(size - walked)  # the header, and any tensor of an unknown dtype


# (name, lazily indexed source, shape, bytes) of each tensor of one weight file
ShardEntries = Iterator[tuple[str, Any, tuple[int, ...], int]]


@contextlib.contextmanager
def _open_shard(path: str) -> Iterator[ShardEntries]:
    """A .safetensors file's tensors in file order (a cold read goes front to back), or a pytorch_model*.bin
    file's, mapped (torch.load(mmap=True)) so that they index lazily too."""
    if path.endswith(".safetensors"):
        from safetensors import safe_open

        with safe_open(path, framework="pt") as f:
            yield _safetensors_entries(f)
    else:
        state = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
        yield ((name, t, tuple(t.shape), t.nbytes) for name, t in state.items())


def _safetensors_entries(f) -> ShardEntries:
    for name in getattr(f, "offset_keys", f.keys)():  # file order; older safetensors: keys()
        view = f.get_slice(name)
        shape = tuple(view.get_shape())
        yield name, view, shape, math.prod(shape) * _ITEM_SIZE.get(view.get_dtype(), 0)
