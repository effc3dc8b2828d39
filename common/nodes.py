"""Tensor parallelism across nodes: which ranks run where, and the flags that say so (vLLM's names).

    node 0 (the server)                                   node 1 (--headless)
    launch.py: frontends, tokenizer workers, scheduler    launch.py --headless: GPU workers only
      gpu_worker       global rank 0 ──plan bytes (gloo broadcast)──▶ gpu_worker-rank{L}...
      gpu_worker-rank1 ... rank L-1 (IPC relay, as on one node)        global ranks L ... 2L-1
                 └──────────── one torch.distributed group, rendezvous at --master-addr:--master-port ────────────┘

With --tensor-parallel-size T over --nnodes N, every node runs L = T / N ranks: node r the global ranks
r·L ... r·L + L-1, rank g on its node's cuda:(g mod L). The launcher of node 0 hosts the rendezvous store (a
torch.distributed TCPStore at --master-port); every rank meets there, and the launchers watch each other through
it (common/node_heartbeat.py).
"""

from __future__ import annotations

import argparse
import ipaddress
import socket
from dataclasses import dataclass

from common.flags import PARALLEL, flag_group

DEFAULT_MASTER_ADDR = "127.0.0.1"
DEFAULT_MASTER_PORT = 29501  # vLLM's


@dataclass(frozen=True, slots=True)
class Nodes:
    """The nodes one tensor-parallel group spans, and this node's place among them."""

    nnodes: int = 1
    node_rank: int = 0
    master_addr: str = DEFAULT_MASTER_ADDR
    master_port: int = DEFAULT_MASTER_PORT

    @property
    def multi_node(self) -> bool:
        return self.nnodes > 1

    def ranks_per_node(self, tensor_parallel_size: int) -> int:
        return tensor_parallel_size // self.nnodes

    def local_ranks(self, tensor_parallel_size: int) -> range:
        """The global ranks this node runs."""
        per_node = self.ranks_per_node(tensor_parallel_size)
        return range(self.node_rank * per_node, (self.node_rank + 1) * per_node)

    def local_index(self, rank: int, tensor_parallel_size: int) -> int:
        """Global rank `rank`'s device on its node: cuda:(rank mod ranks per node)."""
        return rank % self.ranks_per_node(tensor_parallel_size)

    def remote_ranks(self, tensor_parallel_size: int) -> list[int]:
        """The ranks on nodes other than rank 0's: they get each plan by broadcast, not through a local socket."""
        return list(range(self.ranks_per_node(tensor_parallel_size), tensor_parallel_size))

    def node_of(self, rank: int, tensor_parallel_size: int) -> int:
        return rank // self.ranks_per_node(tensor_parallel_size)

    @property
    def master(self) -> str:
        return f"{self.master_addr}:{self.master_port}"

    @property
    def loopback(self) -> bool:
        """Every node on this host (the master a loopback address): gloo and NCCL must use the loopback interface,
        whatever the hostname resolves to."""
        try:
            return ipaddress.ip_address(socket.gethostbyname(self.master_addr)).is_loopback
        except (OSError, ValueError):
            return False

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> Nodes:
        return cls(args.nnodes, args.node_rank, args.master_addr, args.master_port)


ONE_NODE = Nodes()


def add_tensor_parallel_node_args(parser: argparse.ArgumentParser) -> None:
    parallel = flag_group(parser, PARALLEL)
    parallel.add_argument(
        "--nnodes",
        type=int,
        default=1,
        help="nodes the tensor-parallel ranks span, --tensor-parallel-size / N ranks on each: node 0 runs the "
        "server, every other node `launch.py MODEL --headless --node-rank R` with the same flags",
    )
    parallel.add_argument("--node-rank", type=int, default=0, help="this node's place among --nnodes (0: the server)")
    parallel.add_argument(
        "--master-addr",
        default=DEFAULT_MASTER_ADDR,
        help="node 0's address, where every rank meets (torch.distributed's rendezvous store, hosted by node 0's "
        "launcher)",
    )
    parallel.add_argument(
        "--master-port", type=int, default=DEFAULT_MASTER_PORT, help="node 0's port for the rendezvous store"
    )
    # --headless: launch_cluster.py (one flag for a node of tensor-parallel ranks and a node of replicas), which
    # also holds the one check that these flags and the data-parallel ones fit together (check_node_flags).
