"""What the worker's CUDA graphs share: their static inputs, filled on the host and copied over in one transfer,
the capture of a graph per bucket, and the holder of both kinds (StepGraphs).

A captured graph reads fixed device addresses, so everything a step changes lives in one int32 device buffer
whose fields are views, refilled before each replay from a pinned host buffer of the same layout:

    host (pinned, a ring) ─ one copy ─▶ | field | field | ... |   one int32 device buffer, each field 16-byte aligned

The host side is a ring (host_copy.py says why): a buffer whose copy is still queued is never rewritten.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, TypeVar

import numpy as np
import torch

from common.pipeline import host_ring_size

if TYPE_CHECKING:
    from gpu_worker.cuda_graphs import DecodeGraphs
    from gpu_worker.mixed_graphs import MixedGraphs

T = TypeVar("T")
FIELD_ALIGN = 4  # int32 elements: 16 bytes, the alignment Triton specializes kernels on


class GraphInputs:
    """Named int32 fields of one device buffer. `fill()` hands out the next host buffer's fields as numpy
    arrays (writing them is a step's whole host-side input work); `upload()` queues its copy to the device.

    The last field is the block table, [rows, max_model_len / block_size]: for a long-context model the
    largest by far (Llama-3.2-1B's 131,072 positions: 8 MiB for 256 rows), and a step reads only its top-left
    corner (its rows, the columns its longest context reaches). The copy runs on the compute stream between
    two steps' graphs, the GPU idle meanwhile, so a step uploads only that corner: packed on the host, copied,
    and spread into the table's rows on the device. The table's other entries keep older values, never read."""

    def __init__(self, shapes: dict[str, tuple[int, ...]], device: torch.device, table: str = "block_tables"):
        if list(shapes)[-1] != table:
            raise ValueError(f"the block table {table!r} must be the last field")
        total = flat_size(shapes)
        pinned = device.type == "cuda"
        ring = host_ring_size()
        self._hosts = [torch.zeros(total, dtype=torch.int32, pin_memory=pinned) for _ in range(ring)]
        self._device = torch.zeros(total, dtype=torch.int32, device=device)
        self._host_fields = [field_views(shapes, host.numpy()) for host in self._hosts]  # views made once
        self.device = field_views(shapes, self._device)
        self._turn = 0
        self._table = table
        self._table_offset = flat_size({name: shape for name, shape in shapes.items() if name != table})
        self._table_width = shapes[table][1]
        table_size = int(np.prod(shapes[table]))
        self._packed_hosts = [torch.zeros(table_size, dtype=torch.int32, pin_memory=pinned) for _ in range(ring)]
        self._packed_device = torch.zeros(table_size, dtype=torch.int32, device=device)

    def fill(self) -> dict[str, np.ndarray]:
        """The next host buffer's fields, to be written and then uploaded (they hold older steps' values)."""
        self._turn = (self._turn + 1) % len(self._hosts)
        return self._host_fields[self._turn]

    def upload(self, table_rows: int | None = None, table_columns: int | None = None) -> None:
        """Queue the copy of the fields filled: all of them, or every field but the block table and of the table
        its [:table_rows, :table_columns] corner (the rows and columns the step's graph reads)."""
        host = self._hosts[self._turn]
        if table_rows is None or table_columns is None:
            self._device.copy_(host, non_blocking=True)
            return
        start = self._table_offset
        self._device[:start].copy_(host[:start], non_blocking=True)
        if table_columns >= self._table_width:  # whole rows: one contiguous run
            end = start + table_rows * self._table_width
            self._device[start:end].copy_(host[start:end], non_blocking=True)
            return
        size = table_rows * table_columns
        packed = self._packed_hosts[self._turn][:size]
        packed.numpy().reshape(table_rows, table_columns)[...] = self._host_fields[self._turn][self._table][
            :table_rows, :table_columns
        ]
        landed = self._packed_device[:size]
        landed.copy_(packed, non_blocking=True)
        self.device[self._table][:table_rows, :table_columns].copy_(landed.view(table_rows, table_columns))


def flat_size(shapes: dict[str, tuple[int, ...]]) -> int:
    return sum(-(-int(np.prod(shape)) // FIELD_ALIGN) * FIELD_ALIGN for shape in shapes.values())


def field_views(shapes: dict[str, tuple[int, ...]], flat):
    """Each field's view of `flat` (a 1-D array or tensor of flat_size(shapes) elements), in order, aligned."""
    views, offset = {}, 0
    for name, shape in shapes.items():
        size = int(np.prod(shape))
        views[name] = flat[offset : offset + size].reshape(shape)
        offset += -(-size // FIELD_ALIGN) * FIELD_ALIGN
    return views


@dataclass(slots=True)
class StepGraphs:
    """Every graph the worker captured, in one memory pool (they never run at once): decode-only steps by batch
    size (cuda_graphs.py), steps that compute prompt tokens by token count (mixed_graphs.py)."""

    decode: DecodeGraphs
    mixed: MixedGraphs

    def release(self) -> None:
        for graph in [*self.decode.graphs.values(), *self.mixed.graphs.values()]:
            graph.reset()


def smallest_bucket(buckets: list[int], size: int) -> int | None:
    """The first of the (ascending) buckets that holds `size`; None where none does."""
    i = bisect.bisect_left(buckets, size)
    return buckets[i] if i < len(buckets) else None


def capture_buckets(
    buckets: list[int], forward_of: Callable[[int], Callable[[], T]], pool, device: torch.device
) -> dict[int, tuple[torch.cuda.CUDAGraph, T]]:
    """A graph of `forward_of(bucket)` for every bucket, and its output; largest first, so that the smaller
    graphs reuse its memory in the shared pool. forward_of may fill and upload the static inputs the first
    run of its bucket reads."""
    captured = {}
    for bucket in reversed(buckets):
        captured[bucket] = capture(forward_of(bucket), pool, device)
    torch.cuda.synchronize(device)
    return captured


def capture(forward: Callable[[], T], pool, device: torch.device) -> tuple[torch.cuda.CUDAGraph, T]:
    """A graph of `forward` (run once outside the capture first: that compiles and autotunes), and its output."""
    with torch.inference_mode():
        stream = torch.cuda.Stream(device)
        stream.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(stream):
            forward()
        torch.cuda.current_stream(device).wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        # thread_local: a CUDA call on another thread (NCCL's watchdog polling its events, with tensor
        # parallelism; the control thread) must not invalidate this thread's capture.
        with torch.cuda.graph(graph, pool=pool, capture_error_mode="thread_local"):
            output = forward()
    return graph, output


def write_gather_slots(field: np.ndarray, num_rows: int, pending_rows: np.ndarray, pending_slots: np.ndarray) -> None:
    """Which of a step's first num_rows input rows the graph takes from the device (the token sampled last in
    that slot, by a step whose result the host has not read yet): the slot there, -1 where the host wrote the
    input id. Rows past num_rows are padding's, set to -1 with the rest of it."""
    if len(pending_rows) == num_rows:  # every row (a steady decode step): they are rows 0..n-1, in order
        field[:num_rows] = pending_slots
        return
    field[:num_rows] = -1
    field[pending_rows] = pending_slots


def with_device_inputs(input_ids: torch.Tensor, gather_slots: torch.Tensor, last_tokens: torch.Tensor) -> torch.Tensor:
    """Inside a graph: the input ids, with each row whose gather slot is set (write_gather_slots) taking that
    slot's last sampled token. On the device, so the host neither uploads rows nor launches a copy per step."""
    return torch.where(gather_slots >= 0, last_tokens[gather_slots.clamp(min=0)], input_ids)


def write_decode_slices(host: dict[str, np.ndarray], slices, capacity: int) -> None:
    """A step's decode slices (AttentionBackend.decode_slices) into the static fields: their sequences, then -1
    up to the `capacity` its graph launches for; each decode's first slice; the slice length, the decode
    span's fourth entry."""
    n = len(slices.seqs)
    host["slice_seqs"][:n] = slices.seqs
    host["slice_seqs"][n:capacity] = -1
    host["slice_starts"][: len(slices.starts)] = slices.starts
    host["decode_span"][3] = slices.slice_len
