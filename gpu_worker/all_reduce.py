"""The decode step's all-reduces on CUDA, one-shot over NVLink peer memory: every rank writes its tensor into its
slot of every other rank's buffer (torch's symmetric memory), and in the same kernel, once they have written
theirs, sums every rank's, in rank order, so that every rank holds the same bits (the kernels:
all_reduce_kernels.py, one program per SM). NCCL's ring takes several steps per all-reduce, each a few
microseconds of latency; a decode step of an 8B model holds 65 all-reduces of a few KiB to 2 MiB, where that
latency, not the bandwidth, is what they cost. Where the sum feeds a residual add and an RMSNorm (every
row-parallel projection of the Llama-style layers: models/norms.py), the same kernel ends in the norm, and the sum
is never written.

    x (this rank) --one kernel: write into the peers' buffers, rendezvous, sum every rank's [, + residual, norm]--> out

NCCL stays for tensors above PEER_ALL_REDUCE_MAX_BYTES (the ring's bandwidth wins there), for dtypes or
layouts the kernel lacks, and wherever the buffers could not be set up (no peer access, ranks on different
hosts, an older torch): then every rank uses NCCL, agreed at start. The buffers are allocated once, here,
before any CUDA graph is captured; a captured all-reduce replays its one kernel on them. NVLink multicast (the
symm_mem "multimem" operations) is never used: it is off on the machines this runs on, and one-shot needs none.
"""

from __future__ import annotations

import logging
import os
import socket
import zlib
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

if TYPE_CHECKING:  # the kernels import Triton: only a CUDA group with peer memory loads them
    from gpu_worker.all_reduce_kernels import PeerState
    from gpu_worker.models import fp8

log = logging.getLogger(__name__)

# One-shot moves every rank's whole tensor to every peer, so its cost grows with size x ranks while NCCL's ring
# moves 2(n-1)/n of it. On two H100s (benchmarks/tensor_parallel.py prints both for these sizes) one-shot, then
# reading the peers' copies, took 14 / 22 / 37 µs at 2 / 4 / 8 MiB against NCCL's 36 / 41 / 55: 8 MiB covers a
# decode batch of 1,024 at Llama-3-8B's hidden size and of 512 at the 70B's. Writing into the peers' buffers
# instead: 5.2-6.5 µs against reading's 7.6-8.2 for 8-512 KiB (two H200s, one call).
PEER_ALL_REDUCE_MAX_BYTES = 8 * 2**20
# The dtypes the kernels sum (in float32, rounded once).
PEER_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
# The fused sum-and-norm keeps a row in one program's registers (models/triton_ops.py's norm does too).
PEER_NORM_MAX_COLUMNS = 16384
_SEVERAL_HOSTS = "the ranks are on more than one host"
# A process that set up symmetric memory for one group (an offline.LLM with tensor parallelism, closed, then
# another in the same process) does not do it again: torch keeps the first group's state per process and a
# second rendezvous under the new group hung on two H100s (the second TP=2 engine of one test process).
_EARLIER_GROUP = "this process set up peer memory for an earlier group"
_peer_memory_group: str | None = None  # the one group this process set up peer memory for


class PeerAllReduce:
    """One-shot all-reduce of tensors up to `max_bytes` through peer-readable buffers (all_reduce_kernels.PeerState),
    set up by `create`."""

    def __init__(self, state: PeerState, max_bytes: int):
        self.state = state
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

        from gpu_worker.all_reduce_kernels import PeerState, buffer_bytes

        global _peer_memory_group
        rank, world = dist.get_rank(), dist.get_world_size()
        # The same grid on every rank (its programs pair up across ranks): the fewest SMs of any rank's GPU.
        programs = torch.tensor([torch.cuda.get_device_properties(device).multi_processor_count], device=device)
        dist.all_reduce(programs, op=dist.ReduceOp.MIN)
        flag_bytes = int(programs.item()) * world * 4
        # The slots (a rank's, for each parity), then the flags: one allocation, one rendezvous.
        slots = buffer_bytes(world, max_bytes)
        memory = symm_mem.empty(slots + flag_bytes, dtype=torch.uint8, device=device)
        handle = symm_mem.rendezvous(memory, dist.group.WORLD.group_name)
        memory[slots:].zero_()
        torch.cuda.synchronize(device)
        _every_rank_agrees(True, device)  # a barrier: every rank's flags are zero before any rank's first signal
        bases = torch.tensor(handle.buffer_ptrs, dtype=torch.int64, device=device)
        state = PeerState(rank, world, bases, bases + slots, int(programs.item()), max_bytes)
        state.memory = memory
        _peer_memory_group = dist.group.WORLD.group_name
        return cls(state, max_bytes)

    def _sums_correctly(self, device: torch.device) -> bool:
        rank, size = dist.get_rank(), dist.get_world_size()
        x = torch.full((4096,), float(rank + 1), device=device)
        return bool(torch.all(self(x) == size * (size + 1) / 2).item())

    def takes(self, x: torch.Tensor) -> bool:
        """Whether `x` goes one-shot: small enough, a dtype the kernel sums, contiguous (the same on every
        rank: the same model code makes the same shapes)."""
        return x.dtype in PEER_DTYPES and 0 < x.numel() * x.element_size() <= self.max_bytes and x.is_contiguous()

    def takes_rows(self, x: torch.Tensor, residual: torch.Tensor) -> bool:
        """Whether the sum of rows `x` [T, N] can end in the residual add and norm in the same kernel."""
        return (
            self.takes(x)
            and x.dim() == 2
            and x.shape[1] <= PEER_NORM_MAX_COLUMNS
            and residual.shape == x.shape
            and residual.dtype == x.dtype
            and residual.stride(1) == 1
        )

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """The sum over the ranks of `x` (which `takes`), as a new tensor; `x` is left as it was."""
        return self.state.sum(x)

    def sum_add_rms_norm(
        self,
        x: torch.Tensor,
        residual: torch.Tensor,
        weight: torch.Tensor,
        eps: float,
        offset: float,
        scale_in_float32: bool,
        quantize: bool,
    ) -> fp8.Activation:
        """The norm of residual + (sum over the ranks of `x`), with that sum added into `residual` (rows that
        `takes_rows`): what all-reducing x and then models/triton_ops.add_rms_norm give, bit for bit."""
        if quantize:
            from gpu_worker.models import fp8
            from gpu_worker.models.fp8_triton import empty_rows

            values, scales = empty_rows(x.shape[0], x.shape[1], x.device)
            self.state.sum_add_rms_norm(x, residual, weight, eps, values, scales, offset, scale_in_float32)
            return fp8.QuantizedRows(values, scales, x.dtype)
        out = torch.empty_like(x)
        self.state.sum_add_rms_norm(x, residual, weight, eps, out, None, offset, scale_in_float32)
        return out


def _unavailable_reason(device: torch.device) -> str | None:
    same_host = _same_host(device)  # first: a collective every rank joins
    try:
        import torch.distributed._symmetric_memory as symm_mem
    except ImportError:
        symm_mem = None
    if symm_mem is None or not hasattr(symm_mem, "empty"):
        return f"torch {torch.__version__} has no symmetric memory"
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
