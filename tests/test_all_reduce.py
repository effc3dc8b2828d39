"""The one-shot all-reduce over peer memory (gpu_worker/all_reduce.py, all_reduce_kernels.py): which tensors
it takes (the rest go to NCCL), that a CPU group never sets it up; its kernels on one rank in the Triton
interpreter (the epochs, one rank of two pushing, signalling and summing in rank order, the fused norm bit
for bit); and, on two GPUs, that it sums exactly as NCCL does, eagerly and replayed from a CUDA graph, and that
the fused norm equals all-reduce + norm."""

from __future__ import annotations

import os

import pytest
import torch
import torch.multiprocessing as mp

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

pytest.importorskip("triton", reason="triton is not installed (pip install triton)")

from gpu_worker.all_reduce import PeerAllReduce  # noqa: E402
from gpu_worker.all_reduce_kernels import PeerState, buffer_bytes  # noqa: E402
from gpu_worker.models import triton_ops  # noqa: E402

MAX_BYTES = 64 * 1024
PROGRAMS = 3
DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def one_rank_peer(max_bytes: int = MAX_BYTES) -> PeerAllReduce:
    """A group of one rank: the kernels run (in the interpreter without CUDA) and the rendezvous has no one to
    wait for."""
    memory = torch.zeros(2 * max_bytes + PROGRAMS * 4, dtype=torch.uint8, device=DEVICE)
    bases = torch.tensor([memory.data_ptr()], dtype=torch.int64, device=DEVICE)
    state = PeerState(0, 1, bases, bases + 2 * max_bytes, PROGRAMS, max_bytes)
    state.memory = memory
    return PeerAllReduce(state, max_bytes)


@pytest.fixture
def peer() -> PeerAllReduce:
    return one_rank_peer()


@pytest.mark.parametrize("batch", [1, 7, 8])
def test_it_takes_decode_sized_tensors(peer, batch):
    assert peer.takes(torch.empty(batch, 4096, dtype=torch.bfloat16))
    assert peer.takes(torch.empty(batch, 2048, dtype=torch.float32))


@pytest.mark.parametrize(
    ("tensor", "why"),
    [
        (torch.empty(9, 4096, dtype=torch.bfloat16), "larger than its buffer"),
        (torch.empty(4, 4096, dtype=torch.int32), "a dtype its kernel does not sum"),
        (torch.empty(4, 64, dtype=torch.bfloat16)[:, :32], "not contiguous"),
        (torch.empty(0, 4096, dtype=torch.bfloat16), "empty"),
    ],
)
def test_it_leaves_other_tensors_to_nccl(peer, tensor, why):
    assert not peer.takes(tensor), why


def test_a_cpu_group_has_no_peer_memory():
    assert PeerAllReduce.create(torch.device("cpu")) is None


def test_calls_count_epochs_per_program(peer):
    x = torch.randn(5, 700, device=DEVICE)
    for call in range(1, 4):
        assert torch.equal(peer(x * call), x * call)
        assert peer.state.epochs.tolist() == [call] * PROGRAMS


def test_rank_one_of_two_pushes_its_share_signals_and_sums_in_rank_order():
    """Rank 1's kernel alone (the interpreter runs one rank): rank 0 has already pushed y into rank 1's buffer
    and signalled. Rank 1 writes x into its slot of rank 0's buffer, for the call's parity, signals every one of
    rank 0's programs, and returns y + x summed in rank order (rank 0's first): the bits rank 0 gets too."""
    world, slot_elements = 2, MAX_BYTES // 4
    slots = buffer_bytes(world, MAX_BYTES)
    memories = [torch.zeros(slots + PROGRAMS * world * 4, dtype=torch.uint8, device=DEVICE) for _ in range(world)]
    bases = torch.tensor([m.data_ptr() for m in memories], dtype=torch.int64, device=DEVICE)
    state = PeerState(1, world, bases, bases + slots, PROGRAMS, MAX_BYTES)
    x, y = torch.randn(3, 500, device=DEVICE), torch.randn(3, 500, device=DEVICE)
    epoch, parity = 1, 1  # the first call
    buffers = [m[:slots].view(torch.float32).view(2, world, slot_elements) for m in memories]  # [parity][source]
    buffers[1][parity, 0, : y.numel()] = y.flatten()
    flags = [m[slots:].view(torch.int32).view(PROGRAMS, world) for m in memories]  # [program][source]
    flags[1][:, 0] = epoch
    got = state.sum(x)
    assert torch.equal(got, (y.float() + x.float()).to(x.dtype))
    assert torch.equal(buffers[0][parity, 1, : x.numel()], x.flatten())
    assert flags[0][:, 1].tolist() == [epoch] * PROGRAMS
    assert not buffers[0][1 - parity].any() and not buffers[0][parity, 0].any(), "only rank 1's slot, this parity"


NORM_STYLES = {"llama": {"offset": 0.0, "scale_in_float32": False}, "gemma": {"offset": 1.0, "scale_in_float32": True}}


@pytest.mark.parametrize("quantize", [False, True])
@pytest.mark.parametrize("style", NORM_STYLES.values(), ids=NORM_STYLES.keys())
def test_the_sum_ending_in_the_norm_is_the_norm_of_the_sum_bit_for_bit(peer, style, quantize):
    gen = torch.Generator().manual_seed(0)
    x, residual, weight = (torch.randn(*shape, generator=gen).to(DEVICE) for shape in [(7, 600), (7, 600), (600,)])
    assert peer.takes_rows(x, residual)
    expected_residual = residual.clone()
    if quantize:
        expected = triton_ops.add_rms_norm_fp8(x, weight, 1e-6, expected_residual, **style)
    else:
        expected = triton_ops.add_rms_norm(x, weight, 1e-6, expected_residual, **style)
    got = peer.sum_add_rms_norm(x, residual, weight, 1e-6, quantize=quantize, **style)
    assert torch.equal(residual, expected_residual)
    if quantize:
        assert torch.equal(got.values.view(torch.uint8), expected.values.view(torch.uint8))
        assert torch.equal(got.scales, expected.scales)
    else:
        assert torch.equal(got, expected)


def test_rows_too_wide_for_one_program_are_summed_then_normed_apart():
    peer, x = one_rank_peer(max_bytes=256 * 1024), torch.empty(1, 32768)
    assert peer.takes(x) and not peer.takes_rows(x, torch.empty_like(x))


def _rank_sums(rank: int, size: int, tmp: str, failures) -> None:
    import torch.distributed as dist

    from gpu_worker.parallel import close_tensor_parallel, init_tensor_parallel

    tp = init_tensor_parallel(rank, size, os.path.join(tmp, "store"), "cuda")
    try:
        assert tp.peer is not None, "two GPUs of one host set up peer memory"
        gen = torch.Generator(device="cuda").manual_seed(rank)
        for dtype in (torch.bfloat16, torch.float32):
            for batch in (1, 3, 64, 256):
                x = torch.randn(batch, 4096, dtype=dtype, device="cuda", generator=gen)
                expected = x.clone()
                dist.all_reduce(expected)
                if not tp.peer.takes(x):
                    continue
                assert torch.equal(tp.all_reduce(x.clone()), expected), (dtype, batch)
                graph, static_in = torch.cuda.CUDAGraph(), x.clone()
                torch.cuda.synchronize()
                with torch.cuda.graph(graph):
                    static_out = tp.all_reduce(static_in)
                static_in.copy_(x)
                graph.replay()
                torch.cuda.synchronize()
                assert torch.equal(static_out, expected), ("graph", dtype, batch)
                # The fused form: what the all-reduce and then the norm kernel give, in a graph replayed twice.
                weight = torch.randn(4096, dtype=dtype, device="cuda", generator=gen)
                residual = torch.randn(batch, 4096, dtype=dtype, device="cuda", generator=gen)
                want_residual = residual.clone()
                want = triton_ops.add_rms_norm(expected, weight, 1e-5, want_residual)
                static_residual = residual.clone()
                fused_graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(fused_graph):
                    fused = tp.peer.sum_add_rms_norm(
                        static_in, static_residual, weight, 1e-5, offset=0.0, scale_in_float32=False, quantize=False
                    )
                for _ in range(2):
                    static_residual.copy_(residual)
                    fused_graph.replay()
                torch.cuda.synchronize()
                assert torch.equal(static_residual, want_residual), ("fused residual", dtype, batch)
                assert torch.equal(fused, want), ("fused norm", dtype, batch)
    except AssertionError as exc:
        failures.put(f"rank {rank}: {exc}")
    finally:
        close_tensor_parallel(tp)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")
def test_on_two_gpus_one_shot_sums_as_nccl_does_eagerly_and_in_a_graph(tmp_path):
    failures = mp.get_context("spawn").SimpleQueue()
    mp.spawn(_rank_sums, args=(2, str(tmp_path), failures), nprocs=2)
    reported = []
    while not failures.empty():
        reported.append(failures.get())
    assert reported == []
