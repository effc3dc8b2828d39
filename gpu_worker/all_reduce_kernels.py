"""The one-shot all-reduce's kernels (Triton, CUDA; the set-up and the choice of tensors: all_reduce.py).

Every rank runs the same grid of `programs` persistent programs; program p of every rank owns the same share of
the tensor (chunks, or rows, p, p + programs, ...). Every rank's peer-readable buffer has a slot per rank. One call:

    push    program p writes its share of this rank's input into this rank's slot of every other rank's buffer
            (stores over NVLink: posted, where a read waits for its round trip)
    signal  it writes the call's epoch into program p's flag on every other rank (release, system scope)
    wait    it spins until every other rank's program p has written that epoch into its own flags (acquire)
    sum     it sums its share in rank order, this rank's input read where it is, the others' from this rank's
            own buffer (local memory), in float32: every rank gets the same bits; the fused form then adds the
            residual and takes the RMSNorm of the row, as the norm kernel does (models/triton_ops.py:
            add_rms_norm_row), so the sum is never written

Program p waits only for the other ranks' programs p, which wrote only the share that program p reads, so one
rendezvous per program is the whole barrier: no grid-wide synchronisation, no second kernel. The grid is one
program per SM, so every program is resident at once and none waits for a program that cannot start.

Epochs instead of flags reset to zero: program p keeps its count of calls in this rank's memory (`epochs`),
the same on every rank because every rank makes the same calls with the same grid. A call reads its epoch
from there, so a CUDA graph replays with fresh epochs. Two sets of slots alternate by the epoch's parity: a rank
starts call n + 1 only after its call n, which waited for every other rank's signal of call n, so every rank has
read the slots of call n - 1 (its sum of call n - 1 came before its signal of call n) when call n + 1 writes them.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from gpu_worker.models.fp8 import FP8_MAX, MIN_SCALE
from gpu_worker.models.triton_ops import add_rms_norm_row

# Elements per chunk of the flat sum: 8 KiB of bfloat16, 16 bytes per thread with 4 warps.
_CHUNK = 4096


@triton.jit
def _rendezvous(flag_bases_ptr, program, epoch, RANK: tl.constexpr, WORLD: tl.constexpr):
    """Signal this program's epoch to every other rank and wait for theirs (see the module's docstring). The
    atomics are on scalars: one thread of the program does each."""
    tl.debug_barrier()  # every thread's copy is issued before one thread's release makes it visible
    for rank in tl.static_range(WORLD):
        if rank != RANK:  # rank r's flag for (program, this rank): written by this rank only
            theirs = tl.load(flag_bases_ptr + rank).to(tl.pointer_type(tl.int32)) + program * WORLD + RANK
            tl.atomic_xchg(theirs, epoch, sem="release", scope="sys")
    mine = tl.load(flag_bases_ptr + RANK).to(tl.pointer_type(tl.int32)) + program * WORLD
    for rank in tl.static_range(WORLD):
        if rank != RANK:
            seen = tl.atomic_add(mine + rank, 0, sem="acquire", scope="sys")
            while seen < epoch:  # at least the epoch: a faster rank may already have signalled its next call
                seen = tl.atomic_add(mine + rank, 0, sem="acquire", scope="sys")
    tl.debug_barrier()  # every thread reads the other ranks' buffers after the acquire


@triton.jit
def _slot(buffer_bases_ptr, owner, source, parity, slot_elements, WORLD: tl.constexpr, element_ty: tl.constexpr):
    """Where rank `owner`'s buffer holds rank `source`'s share for calls of this parity."""
    # 16-byte aligned (the allocation, and each slot a multiple of 16 bytes): said, so that a pointer loaded
    # from memory still gets 16-byte vector loads and stores, not one per element.
    offset = (parity * WORLD + source).to(tl.int64) * slot_elements
    return tl.multiple_of(tl.load(buffer_bases_ptr + owner).to(tl.pointer_type(element_ty)) + offset, 16)


@triton.jit
def _push(values, offsets, mask, buffer_bases_ptr, parity, slot_elements, RANK: tl.constexpr, WORLD: tl.constexpr):
    """This rank's values into its slot of every other rank's buffer."""
    for rank in tl.static_range(WORLD):
        if rank != RANK:
            theirs = _slot(buffer_bases_ptr, rank, RANK, parity, slot_elements, WORLD, values.dtype)
            tl.store(theirs + offsets, values, mask=mask)


@triton.jit
def _sum_in_rank_order(
    mine, x_offsets, offsets, mask, buffer_bases_ptr, parity, slot_elements, RANK: tl.constexpr, WORLD: tl.constexpr
):
    """float32 sum over the ranks, in rank order: this rank's from its input (`mine` + x_offsets), the others'
    from this rank's buffer (.cg: written by other GPUs, not to be read from this SM's L1)."""
    total = tl.zeros(offsets.shape, dtype=tl.float32)
    for rank in tl.static_range(WORLD):
        if rank == RANK:
            total += tl.load(mine + x_offsets, mask=mask, other=0.0).to(tl.float32)
        else:
            source = _slot(buffer_bases_ptr, RANK, rank, parity, slot_elements, WORLD, mine.dtype.element_ty)
            total += tl.load(source + offsets, mask=mask, other=0.0, cache_modifier=".cg").to(tl.float32)
    return total


@triton.jit
def _sum_kernel(
    x_ptr,
    out_ptr,
    buffer_bases_ptr,
    flag_bases_ptr,
    epochs_ptr,
    numel,
    slot_elements,
    RANK: tl.constexpr,
    WORLD: tl.constexpr,
    PROGRAMS: tl.constexpr,
    CHUNK: tl.constexpr,
):
    program = tl.program_id(0)
    epoch = tl.load(epochs_ptr + program) + 1
    parity = epoch % 2
    lanes = tl.arange(0, CHUNK)
    for start in range(program * CHUNK, numel, PROGRAMS * CHUNK):
        offsets = start + lanes
        mask = offsets < numel
        _push(tl.load(x_ptr + offsets, mask=mask), offsets, mask, buffer_bases_ptr, parity, slot_elements, RANK, WORLD)
    _rendezvous(flag_bases_ptr, program, epoch, RANK, WORLD)
    tl.store(epochs_ptr + program, epoch)
    for start in range(program * CHUNK, numel, PROGRAMS * CHUNK):
        offsets = start + lanes
        mask = offsets < numel
        total = _sum_in_rank_order(x_ptr, offsets, offsets, mask, buffer_bases_ptr, parity, slot_elements, RANK, WORLD)
        tl.store(out_ptr + offsets, total.to(x_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _sum_add_rms_norm_kernel(
    x_ptr,
    residual_ptr,
    out_ptr,
    scale_ptr,
    weight_ptr,
    buffer_bases_ptr,
    flag_bases_ptr,
    epochs_ptr,
    rows,
    slot_elements,
    eps,
    stride_x,
    stride_r,
    stride_o,
    fp8_max,
    inv_fp8_max,
    min_scale,
    N: tl.constexpr,
    N_PAD: tl.constexpr,
    OFFSET: tl.constexpr,
    SCALE_IN_FP32: tl.constexpr,
    QUANTIZE: tl.constexpr,
    RANK: tl.constexpr,
    WORLD: tl.constexpr,
    PROGRAMS: tl.constexpr,
):
    program = tl.program_id(0)
    epoch = tl.load(epochs_ptr + program) + 1
    parity = epoch % 2
    element_ty = x_ptr.dtype.element_ty
    cols = tl.arange(0, N_PAD)
    mask = cols < N
    for row in range(program, rows, PROGRAMS):
        values = tl.load(x_ptr + row * stride_x + cols, mask=mask)
        _push(values, row * N + cols, mask, buffer_bases_ptr, parity, slot_elements, RANK, WORLD)
    _rendezvous(flag_bases_ptr, program, epoch, RANK, WORLD)
    tl.store(epochs_ptr + program, epoch)
    for row in range(program, rows, PROGRAMS):
        total = _sum_in_rank_order(
            x_ptr, row * stride_x + cols, row * N + cols, mask, buffer_bases_ptr, parity, slot_elements, RANK, WORLD
        )
        add_rms_norm_row(
            total.to(element_ty),  # the all-reduce's result, rounded as the unfused all-reduce returns it
            row,
            residual_ptr,
            out_ptr,
            scale_ptr,
            weight_ptr,
            eps,
            stride_r,
            stride_o,
            fp8_max,
            inv_fp8_max,
            min_scale,
            cols,
            mask,
            N,
            True,
            OFFSET,
            SCALE_IN_FP32,
            QUANTIZE,
        )


def buffer_bytes(world: int, slot_bytes: int) -> int:
    """A rank's peer-readable buffer: a slot of slot_bytes per rank, for each of the two parities."""
    return 2 * world * slot_bytes


class PeerState:
    """What one rank's kernels need: every rank's buffer and flags (addresses, as int64 on the device), this
    rank's epochs, and the grid. A buffer holds buffer_bytes(world, slot_bytes): [parity][source rank][slot]."""

    def __init__(
        self,
        rank: int,
        world: int,
        buffer_bases: torch.Tensor,
        flag_bases: torch.Tensor,
        programs: int,
        slot_bytes: int,
    ):
        self.rank = rank
        self.world = world
        self.buffer_bases = buffer_bases
        self.flag_bases = flag_bases
        self.programs = programs
        self.slot_bytes = slot_bytes
        self.epochs = torch.zeros(programs, dtype=torch.int32, device=buffer_bases.device)
        self.memory: torch.Tensor | None = None  # the buffers' allocation, where this rank's were allocated here

    def _common(self) -> dict:
        return {
            "RANK": self.rank,
            "WORLD": self.world,
            "PROGRAMS": self.programs,
        }

    def sum(self, x: torch.Tensor) -> torch.Tensor:
        """The sum over the ranks of x (contiguous, at most slot_bytes), as a new tensor."""
        out = torch.empty_like(x)
        _sum_kernel[(self.programs,)](
            x,
            out,
            self.buffer_bases,
            self.flag_bases,
            self.epochs,
            x.numel(),
            self.slot_bytes // x.element_size(),
            CHUNK=_CHUNK,
            num_warps=4,
            **self._common(),
        )
        return out

    def sum_add_rms_norm(
        self,
        x: torch.Tensor,
        residual: torch.Tensor,
        weight: torch.Tensor,
        eps: float,
        out: torch.Tensor,
        scales: torch.Tensor | None,
        offset: float,
        scale_in_float32: bool,
    ) -> None:
        """residual += sum over the ranks of x [rows, N]; out = RMSNorm(residual) (quantized, with scales)."""
        rows, n = x.shape
        n_pad = triton.next_power_of_2(n)
        _sum_add_rms_norm_kernel[(self.programs,)](
            x,
            residual,
            out,
            scales,
            weight,
            self.buffer_bases,
            self.flag_bases,
            self.epochs,
            rows,
            self.slot_bytes // x.element_size(),
            eps,
            x.stride(0),
            residual.stride(0),
            out.stride(0),
            FP8_MAX,
            1.0 / FP8_MAX,
            MIN_SCALE,
            N=n,
            N_PAD=n_pad,
            OFFSET=offset,
            SCALE_IN_FP32=scale_in_float32,
            QUANTIZE=scales is not None,
            # As models/triton_ops.py launches the norm: the same warps sum the mean square in the same order.
            num_warps=4,
            enable_fp_fusion=False,
            **self._common(),
        )
