"""The one-shot all-reduce over peer memory (gpu_worker/all_reduce.py): which tensors it takes (the rest go
to NCCL), that a CPU group never sets it up, and, on two GPUs, that it sums exactly as NCCL does, eagerly and
replayed from a CUDA graph."""

from __future__ import annotations

import os

import pytest
import torch
import torch.multiprocessing as mp

from gpu_worker.all_reduce import PEER_DTYPES, PeerAllReduce

MAX_BYTES = 64 * 1024


@pytest.fixture
def peer() -> PeerAllReduce:
    """Its choice of tensors needs no GPU: buffers stand in for the rendezvoused ones."""
    buffers = {dtype: torch.empty(MAX_BYTES // dtype.itemsize, dtype=dtype) for dtype in PEER_DTYPES}
    return PeerAllReduce(buffers, group_name="0", max_bytes=MAX_BYTES)


@pytest.mark.parametrize("batch", [1, 7, 8])
def test_it_takes_decode_sized_tensors(peer, batch):
    assert peer.takes(torch.empty(batch, 4096, dtype=torch.bfloat16))
    assert peer.takes(torch.empty(batch, 2048, dtype=torch.float32))


@pytest.mark.parametrize(
    ("tensor", "why"),
    [
        (torch.empty(9, 4096, dtype=torch.bfloat16), "larger than its buffer"),
        (torch.empty(4, 4096, dtype=torch.float16), "a dtype its kernel does not sum"),
        (torch.empty(3, 1, dtype=torch.float32), "12 bytes: not a multiple of its 16-byte vectors"),
        (torch.empty(4, 64, dtype=torch.bfloat16)[:, :32], "not contiguous"),
        (torch.empty(65, dtype=torch.float32)[1:], "starting 4 bytes into its storage"),
        (torch.empty(0, 4096, dtype=torch.bfloat16), "empty"),
    ],
)
def test_it_leaves_other_tensors_to_nccl(peer, tensor, why):
    assert not peer.takes(tensor), why


def test_a_cpu_group_has_no_peer_memory():
    assert PeerAllReduce.create(torch.device("cpu")) is None


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
