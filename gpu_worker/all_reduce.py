"""The decode step's all-reduces on CUDA, one-shot over NVLink peer memory: every rank writes its tensor into a
buffer the other ranks' GPUs can read (torch's symmetric memory), and one kernel per rank loads every rank's
copy and sums them, in rank order, so that every rank holds the same bits. NCCL's ring takes several steps per
all-reduce, each a few microseconds of latency; a decode step of an 8B model holds 65 all-reduces of a few
KiB to 2 MiB, where that latency, not the bandwidth, is what they cost.

    x (this rank) ──one kernel: copy into peer buffer, barrier, load every rank's, sum──▶ out (new tensor)

NCCL stays for tensors above PEER_ALL_REDUCE_MAX_BYTES (the ring's bandwidth wins there), for dtypes or
layouts the kernel lacks (float16, unaligned sizes), and wherever the buffers could not be set up (no peer
access, ranks on different hosts, an older torch): then every rank uses NCCL, agreed at start. The buffers
are allocated once, here, before any CUDA graph is captured; a captured all-reduce replays its one kernel on
them. NVLink multicast (the symm_mem "multimem" operations) is never used: it is off on the machines this
runs on, and one-shot needs none.
"""

from __future__ import annotations

import logging
import os
import socket
import zlib

import torch
import torch.distributed as dist

log = logging.getLogger(__name__)

# One-shot reads every peer's whole tensor, so its cost grows with size x ranks while NCCL's ring moves
# 2(n-1)/n of it: past a few MiB the ring wins. 2 MiB covers decode batches up to 256 at hidden size 4096 in
# bf16 (benchmarks/tensor_parallel.py prints both latencies for these sizes; move this to where they cross).
PEER_ALL_REDUCE_MAX_BYTES = 2 * 2**20
# The dtypes torch's one-shot kernel sums (one buffer each).
PEER_DTYPES = (torch.bfloat16, torch.float32)
_SEVERAL_HOSTS = "the ranks are on more than one host"
# A process that set up symmetric memory for one group (an offline.LLM with tensor parallelism, closed, then
# another in the same process) does not do it again: torch keeps the first group's state per process and a
# second rendezvous under the new group hung on two H100s (the second TP=2 engine of one test process).
_EARLIER_GROUP = "this process set up peer memory for an earlier group"
_peer_memory_group: str | None = None  # the one group this process set up peer memory for
_ALIGNMENT = 16  # bytes: the kernel's vector width; the input and the buffer view must both be aligned to it


class PeerAllReduce:
    """One-shot all-reduce through symmetric-memory buffers of `max_bytes` per dtype, set up by `create`."""

    def __init__(self, buffers: dict[torch.dtype, torch.Tensor], group_name: str, max_bytes: int):
        self.buffers = buffers
        self.group_name = group_name
        self.max_bytes = max_bytes

    @classmethod
    def create(cls, device: torch.device, max_bytes: int = PEER_ALL_REDUCE_MAX_BYTES) -> PeerAllReduce | None:
        """The buffers, rendezvoused with every rank of the default group, or None on every rank (with the
        reason logged) if any rank could not set them up or a test sum came out wrong. Collective: every
        rank calls it, after init_process_group."""
        if device.type != "cuda":  # every rank's device is of one type: no rank needs to be asked
            return None
        reason = _unavailable_reason(device)
        if reason is None and _peer_memory_group is not None:
            reason = _EARLIER_GROUP
        peer = None
        # Agreed before the rendezvous, a collective that waits forever for a rank that skips it.
        if _every_rank_agrees(reason is None, device):
            try:
                peer = cls._rendezvous(device, max_bytes)
            except Exception as exc:  # noqa: BLE001 (any failure: NCCL serves instead)
                reason = f"symmetric memory could not be set up ({type(exc).__name__}: {exc})"
        # Agreed before the first one-shot sum, which would wait forever for a rank without buffers.
        if _every_rank_agrees(reason is None, device) and peer is not None:
            if _every_rank_agrees(peer._sums_correctly(device), device):
                log.info("all-reduce: one-shot over peer memory up to %d KiB, NCCL above", max_bytes // 1024)
                return peer
            reason = "a test all-reduce over peer memory came out wrong on some rank"
        # A warning where peer memory should have worked (one host): the decode step pays NCCL's latency.
        (log.info if reason in (_SEVERAL_HOSTS, _EARLIER_GROUP) else log.warning)(
            "all-reduce: NCCL only (%s)", reason or "another rank could not set up peer memory"
        )
        return None

    @classmethod
    def _rendezvous(cls, device: torch.device, max_bytes: int) -> PeerAllReduce:
        # Multicast objects are never needed here (no multimem operations); don't let rendezvous create them.
        os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
        import torch.distributed._symmetric_memory as symm_mem

        global _peer_memory_group
        group_name = dist.group.WORLD.group_name
        buffers = {}
        for dtype in PEER_DTYPES:
            buffer = symm_mem.empty(max_bytes // dtype.itemsize, dtype=dtype, device=device)
            symm_mem.rendezvous(buffer, group_name)
            buffers[dtype] = buffer
        _peer_memory_group = group_name
        return cls(buffers, group_name, max_bytes)

    def _sums_correctly(self, device: torch.device) -> bool:
        rank, size = dist.get_rank(), dist.get_world_size()
        x = torch.full((4096,), float(rank + 1), device=device)
        return bool(torch.all(self(x) == size * (size + 1) / 2).item())

    def takes(self, x: torch.Tensor) -> bool:
        """Whether `x` goes one-shot: small enough, a dtype the kernel sums, contiguous and 16-byte aligned
        (the same on every rank: the same model code makes the same shapes)."""
        nbytes = x.numel() * x.element_size()
        return (
            x.dtype in self.buffers
            and 0 < nbytes <= self.max_bytes
            and nbytes % _ALIGNMENT == 0
            and x.storage_offset() * x.element_size() % _ALIGNMENT == 0
            and x.is_contiguous()
        )

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """The sum over the ranks of `x` (which `takes`), as a new tensor; `x` is left as it was."""
        out = torch.empty_like(x)
        buffer = self.buffers[x.dtype][: x.numel()]
        torch.ops.symm_mem.one_shot_all_reduce_copy_out(buffer, x.view(-1), "sum", self.group_name, out.view(-1))
        return out


def _unavailable_reason(device: torch.device) -> str | None:
    same_host = _same_host(device)  # first: a collective every rank joins
    if not hasattr(torch.ops.symm_mem, "one_shot_all_reduce_copy_out"):
        return f"torch {torch.__version__} has no symm_mem.one_shot_all_reduce_copy_out"
    if not same_host:
        return _SEVERAL_HOSTS
    return None


def _same_host(device: torch.device) -> bool:
    """Peer memory is one host's: compare a hash of every rank's host name (the smallest and the largest)."""
    name = zlib.crc32(socket.gethostname().encode())
    low = torch.tensor([name], dtype=torch.long, device=device)
    high = low.clone()
    dist.all_reduce(low, op=dist.ReduceOp.MIN)
    dist.all_reduce(high, op=dist.ReduceOp.MAX)
    return bool(low.item() == high.item())


def _every_rank_agrees(ok: bool, device: torch.device) -> bool:
    flag = torch.tensor([int(ok)], dtype=torch.long, device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MIN)
    return bool(flag.item())
