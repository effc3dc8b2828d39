"""Host-to-device copies that neither wait for the device nor allocate (and the copy of results back: Readback).

`torch.tensor(values, device="cuda")` copies from pageable memory, which blocks the host until the
device has finished everything queued before it: with the next step launched while the previous one
runs, that is a stall per copy. Pinned memory makes the copy asynchronous, but allocating it per step
is slow, and a pinned buffer may be rewritten only once the copy out of it has run.

So: a ring of preallocated pinned buffers, one taken per step. At most PIPELINE_DEPTH launched steps
are unfinished (common/pipeline.py), and finishing a step waits for its tokens, which the device produces
after every copy that step made; a ring one longer than that never rewrites a buffer whose copy is pending.

    step k:  host ring[k % depth] ──copy──▶ device buffer (one; the device runs steps in order)
"""

from __future__ import annotations

import numpy as np
import torch

from common.pipeline import host_ring_size

NUMPY_DTYPES = {torch.long: np.int64, torch.int32: np.int32, torch.float32: np.float32, torch.bool: np.bool_}
ALIGN = 16  # bytes: Triton specializes kernels on 16-byte pointer alignment; every field starts aligned


class StagingRing:
    def __init__(self, device: torch.device, capacity_bytes: int, depth: int | None = None):
        """depth: host buffers in the ring; None: one per step in flight, plus the one being filled."""
        self.device = device
        self.capacity = capacity_bytes
        if depth is None:
            depth = host_ring_size()
        if device.type == "cuda":
            self._hosts = [torch.empty(capacity_bytes, dtype=torch.uint8, pin_memory=True) for _ in range(depth)]
            self._host_arrays = [host.numpy() for host in self._hosts]  # the same memory, written with numpy
            self._device = torch.empty(capacity_bytes, dtype=torch.uint8, device=device)
        self._turn = -1
        self._offset = 0

    def next_step(self) -> None:
        """Start staging a new step's inputs (in the next host buffer of the ring)."""
        self._turn += 1
        self._offset = 0

    def upload(self, values: np.ndarray | list, dtype: torch.dtype) -> torch.Tensor:
        """A device tensor holding `values`; the copy is queued, not waited for. The host side is numpy (a
        step makes several of these, and each torch call costs microseconds of host time): one torch copy
        and one view per upload."""
        if self.device.type != "cuda":
            return torch.as_tensor(np.asarray(values), dtype=dtype)
        array = np.asarray(values, dtype=NUMPY_DTYPES[dtype])
        start = self._offset
        end = start + array.nbytes
        if end > self.capacity:
            raise RuntimeError(f"step inputs need more than the {self.capacity} staging bytes")
        self._offset = -(-end // ALIGN) * ALIGN
        turn = self._turn % len(self._hosts)
        self._host_arrays[turn][start:end].view(array.dtype).reshape(array.shape)[...] = array
        target = self._device[start:end]
        target.copy_(self._hosts[turn][start:end], non_blocking=True)
        return target.view(dtype).view(array.shape)


class Readback:
    """The other way: a step's results queued for copying to pinned host memory, one event saying they all
    landed. The sampled tokens land in a ring of pinned buffers, one per step in flight and one more, so that
    the common step allocates nothing; what few requests ask for (logprobs) gets pinned memory of its own. On
    a CPU the results are on the host already."""

    def __init__(self, device: torch.device, max_samples: int):
        """max_samples: the most tokens a step samples."""
        self.device = device
        pinned = device.type == "cuda"
        self._token_hosts = [
            torch.empty(max_samples, dtype=torch.long, pin_memory=pinned) for _ in range(host_ring_size())
        ]
        self._token_turn = 0

    def copy(
        self, tensors: list[torch.Tensor], tokens_first: bool
    ) -> tuple[list[torch.Tensor], torch.cuda.Event | None]:
        """The host tensors the results will be in (the sampled tokens first, when tokens_first), and the event
        after their copies (None: nothing to wait for)."""
        if self.device.type != "cuda" or not tensors:
            return tensors, None
        hosts = [torch.empty(t.shape, dtype=t.dtype, pin_memory=True) for t in tensors[tokens_first:]]
        if tokens_first:
            self._token_turn = (self._token_turn + 1) % len(self._token_hosts)
            hosts.insert(0, self._token_hosts[self._token_turn][: len(tensors[0])])
        for host, tensor in zip(hosts, tensors):
            host.copy_(tensor, non_blocking=True)
        event = torch.cuda.Event()
        event.record()
        return hosts, event
