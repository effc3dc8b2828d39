"""The staging ring's copy path, run without a GPU: its pinned and device buffers replaced by CPU tensors, so
what a CUDA step uploads (values, dtype, shape, 16-byte alignment) is checked in CI too."""

from __future__ import annotations

import types

import numpy as np
import torch

from gpu_worker.host_copy import ALIGN, StagingRing


def cpu_staged_ring(capacity: int = 4096, depth: int = 2) -> StagingRing:
    ring = StagingRing(torch.device("cpu"), capacity, depth=depth)
    ring._hosts = [torch.zeros(capacity, dtype=torch.uint8) for _ in range(depth)]
    ring._host_arrays = [host.numpy() for host in ring._hosts]
    ring._device = torch.zeros(capacity, dtype=torch.uint8)
    ring.device = types.SimpleNamespace(type="cuda")  # type: ignore[assignment]
    return ring


def test_uploads_keep_values_dtype_and_shape_each_at_an_aligned_offset():
    ring = cpu_staged_ring()
    ring.next_step()
    ids = ring.upload([1, 2, 3], torch.long)
    floats = ring.upload(np.stack([np.array([1.5, 2.5]), np.array([3.5, 4.5])]), torch.float32)
    strided = ring.upload(np.arange(10)[::3], torch.int32)
    empty = ring.upload([], torch.long)
    assert ids.tolist() == [1, 2, 3] and ids.dtype == torch.long
    assert floats.tolist() == [[1.5, 2.5], [3.5, 4.5]] and floats.dtype == torch.float32
    assert strided.tolist() == [0, 3, 6, 9] and strided.dtype == torch.int32
    assert empty.numel() == 0
    base = ring._device.data_ptr()
    assert all((t.data_ptr() - base) % ALIGN == 0 for t in (ids, floats, strided))


def test_the_next_step_writes_the_next_host_buffer_of_the_ring():
    ring = cpu_staged_ring(depth=2)
    ring.next_step()
    ring.upload([7, 7], torch.long)
    ring.next_step()
    ring.upload([9, 9], torch.long)
    assert ring._host_arrays[0][:16].view(np.int64).tolist() == [7, 7]
    assert ring._host_arrays[1][:16].view(np.int64).tolist() == [9, 9]
