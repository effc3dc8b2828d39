"""Tensor parallelism: the ranks' process group and its collectives (the layers that use them:
models/parallel_layers.py). Where a forward communicates, Megatron-style:

    embedding   each rank holds a contiguous share of the vocabulary rows; an id outside it looks up
                zeros; one all-reduce sums the shares                                       (all-reduce 1)
    each layer  qkv, gate/up: column-parallel: a rank computes its own heads (q and kv alike) and its
                share of the MLP's width, no communication
                attention output, down projection: row-parallel: partial sums over a rank's inputs,
                one all-reduce each, then the bias (once)                                   (all-reduce 2, 3)
    head        each rank the logits of its vocabulary rows; one all-gather gives every rank all of them,
                so every rank samples the same tokens from the same numbers

A group of size 1 (SINGLE) communicates nothing: TP=1 runs the same code.
The process group is torch.distributed's default group: gloo on a CPU, NCCL on CUDA (rank r on cuda:r, after the
GPUs of the engine replicas before its own; across nodes, on its node's cuda:(r mod ranks per node):
common/nodes.py). On CUDA the small all-reduces (a decode step's) go one-shot over NVLink peer memory instead
of NCCL's ring (gpu_worker/all_reduce.py; within one host only).
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from common.model_info import shard_size
from common.nodes import ONE_NODE, Nodes
from gpu_worker.all_reduce import PEER_ALL_REDUCE_MAX_BYTES, PeerAllReduce


@dataclass(frozen=True, slots=True)
class TensorParallel:
    rank: int = 0
    size: int = 1
    # CUDA: the one-shot all-reduce for small tensors (gpu_worker/all_reduce.py); None: NCCL or gloo for all.
    peer: PeerAllReduce | None = field(default=None, compare=False, repr=False)

    def shard(self, total: int, what: str) -> int:
        """Each rank's share of `total` (heads, features); an error naming both numbers if it does not divide."""
        return shard_size(total, self.size, what)

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum over the ranks: `x` itself, summed in place, or (one-shot over peer memory) a new tensor."""
        if self.size == 1:
            return x
        if self.peer is not None and self.peer.takes(x):
            return self.peer(x)
        dist.all_reduce(x)
        return x

    def all_gather_columns(self, x: torch.Tensor) -> torch.Tensor:
        """[n, c] on each rank -> [n, size * c], rank r's columns at [r*c, (r+1)*c)."""
        if self.size == 1:
            return x
        n, c = x.shape
        gathered = x.new_empty(self.size * n, c)
        _all_gather_single(gathered, x.contiguous())
        return gathered.view(self.size, n, c).permute(1, 0, 2).reshape(n, self.size * c)

    def min(self, value: int, device: torch.device) -> int:
        """The smallest of every rank's `value` (NCCL reduces device tensors only)."""
        if self.size == 1:
            return value
        t = torch.tensor([value], dtype=torch.long, device=device)
        dist.all_reduce(t, op=dist.ReduceOp.MIN)
        return int(t.item())


SINGLE = TensorParallel()


@dataclass(frozen=True, slots=True)
class UnreducedSum:
    """A row-parallel projection's output before its all-reduce, handed to the residual norm that reads it
    (models/norms.py), which sums it: on CUDA with peer memory, in the norm's own kernel (all_reduce.py)."""

    partial: torch.Tensor
    tp: TensorParallel

    def summed(self) -> torch.Tensor:
        return self.tp.all_reduce(self.partial)


# One tensor in, one out (capturable in a CUDA graph with NCCL); torch 2.13 renamed it.
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def init_tensor_parallel(
    rank: int,
    size: int,
    init_file: str,
    device_type: str,
    device_index: int | None = None,
    nodes: Nodes = ONE_NODE,
    peer_max_bytes: int = PEER_ALL_REDUCE_MAX_BYTES,
) -> TensorParallel:
    """Join the group of `size` ranks that meet at `init_file` (a file:// store no other run uses), or, across
    nodes, at node 0's store (common/nodes.py). Blocks until every rank has joined. device_index: this rank's GPU
    (default: cuda:rank; an engine replica's ranks take the GPUs after the previous replicas'). peer_max_bytes:
    the largest all-reduce that goes one-shot over peer memory (a benchmark's, to find where NCCL wins)."""
    if size == 1:
        return SINGLE
    if device_type == "cuda":
        index = rank if device_index is None else device_index
        visible = torch.cuda.device_count()
        if visible <= index:
            raise RuntimeError(
                f"--tensor-parallel-size {size} needs a GPU per rank: rank {rank} wants cuda:{index}, {visible} visible"
            )
        torch.cuda.set_device(index)
        backend = "nccl"
    else:
        backend = "gloo"
    if sys.platform.startswith("linux") and (not nodes.multi_node or nodes.loopback):
        # Every rank is on this host: loopback, not whatever interface the hostname resolves to (if any). Across
        # hosts the interface is the user's to name where the hostname's is not it (docs/deployment.md).
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
        if nodes.multi_node:
            os.environ.setdefault("NCCL_SOCKET_IFNAME", "lo")
    if nodes.multi_node:
        store = dist.TCPStore(nodes.master_addr, nodes.master_port, is_master=False)  # waits for node 0 (300 s)
        dist.init_process_group(backend, store=dist.PrefixStore("tensor-parallel/", store), rank=rank, world_size=size)
    else:
        dist.init_process_group(backend, init_method=f"file://{init_file}", rank=rank, world_size=size)
    peer = PeerAllReduce.create(torch.device("cuda", index), peer_max_bytes) if backend == "nccl" else None
    return TensorParallel(rank, size, peer)


def dist_backend(tp: TensorParallel) -> str | None:
    """The group's backend, "nccl" or "gloo"; None for a group of one (no process group)."""
    return dist.get_backend() if tp.size > 1 and dist.is_initialized() else None


def close_tensor_parallel(tp: TensorParallel) -> None:
    """Leave the group. With NCCL every rank must call it (the teardown flushes the communicators together)."""
    if tp.size > 1 and dist.is_initialized():
        dist.destroy_process_group()
