"""launch.py's part for data parallelism across hosts: the node flags (vLLM's names), the one check that every
node flag fits together (check_node_flags: these and the tensor-parallel ones of common/nodes.py), and the
frontend node's view of the replicas that headless nodes serve.

    frontend node:  python launch.py -dp 4 --data-parallel-size-local 2 --data-parallel-address 10.0.0.1 ...
                    replicas 0-1 here, 2-3 on headless nodes, which join through the node link (node_link/)
    headless node:  python launch.py -dp 4 --data-parallel-size-local 2 --data-parallel-start-rank 2 \\
                        --data-parallel-address 10.0.0.1 --headless ...
                    replicas 2-3, no HTTP, no tokenizer workers: its schedulers' tokens go to the frontend node's

A remote replica serves once its node has joined (NodeJoin), late or again after a restart; it is out once
its node is lost (NodeLost): the routers are told as for a local replica's failure (common/engine_replica.py).
"""

from __future__ import annotations

import argparse
import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from common.cluster_secret import CurveKeys
    from common.node_messages import JoinedReplica

log = logging.getLogger("launcher")
DEFAULT_RPC_PORT = 29550  # vLLM's --data-parallel-rpc-port default


def add_node_args(parser: argparse.ArgumentParser) -> None:
    from common.flags import NODES, flag_group

    nodes = flag_group(parser, NODES)
    nodes.add_argument(
        "--data-parallel-size-local",
        "-dpl",
        type=int,
        default=None,
        help="engine replicas on this node (default: every replica from --data-parallel-start-rank on); on the "
        "frontend node, fewer than --data-parallel-size leaves the rest to headless nodes",
    )
    nodes.add_argument(
        "--data-parallel-start-rank",
        "-dpr",
        type=int,
        default=0,
        help="the first replica this node serves (a headless node's: the frontend node serves from 0)",
    )
    nodes.add_argument(
        "--data-parallel-address",
        "-dpa",
        default="127.0.0.1",
        help="the frontend node's address: it listens there for headless nodes, which connect to it",
    )
    nodes.add_argument(
        "--data-parallel-rpc-port",
        "-dpp",
        type=int,
        default=DEFAULT_RPC_PORT,
        help="the frontend node's TCP port for headless nodes (the only port data parallelism opens)",
    )
    nodes.add_argument(
        "--headless",
        action="store_true",
        help="no HTTP, no tokenizer workers: serve engine replicas for a frontend node elsewhere (with the "
        "data-parallel flags), or, with --nnodes and --node-rank above 0, this node's tensor-parallel ranks of "
        "node 0's engine",
    )
    nodes.add_argument(
        "--cluster-secret-file",
        default=None,
        help="a file holding the secret every node shares (default: $CLEARSERVE_CLUSTER_SECRET); every socket "
        "between hosts is CurveZMQ with keys derived from it, and a node with another is refused",
    )


def check_node_flags(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """The one check that the node flags fit together, both kinds: a node of data-parallel replicas
    (--data-parallel-*, --headless) and a node of one engine's tensor-parallel ranks (--nnodes, --node-rank,
    --master-port, common/nodes.py; --headless again). Resolves --data-parallel-size-local's default; where they
    do not fit, one line and exit 2. Expects --data-parallel-size and --tensor-parallel-size at least 1."""
    size, start = args.data_parallel_size, args.data_parallel_start_rank
    if args.data_parallel_size_local is None:
        args.data_parallel_size_local = size - start
    local, tp = args.data_parallel_size_local, args.tensor_parallel_size
    if not args.headless and start != 0:
        parser.error("--data-parallel-start-rank is a headless node's (the frontend node serves from replica 0)")
    if args.headless and local < 1:
        parser.error("--headless needs at least one replica (--data-parallel-size-local)")
    if local < 0 or start < 0 or start + local > size:
        parser.error(
            f"replicas {start} to {start + local - 1} (--data-parallel-start-rank, --data-parallel-size-local) "
            f"are not within --data-parallel-size {size}"
        )
    if args.nnodes < 1:
        parser.error("--nnodes must be at least 1")
    if not 0 <= args.node_rank < args.nnodes:
        parser.error(f"--node-rank {args.node_rank} must be below --nnodes {args.nnodes} (0 is the server)")
    if tp % args.nnodes:
        parser.error(
            f"--tensor-parallel-size {tp} must be divisible by --nnodes {args.nnodes} (as many ranks on each node)"
        )
    if not 0 < args.master_port < 65536:
        parser.error(f"--master-port {args.master_port} is not a port")
    if args.nnodes > 1 and args.node_rank > 0 and not args.headless:
        parser.error(f"--node-rank {args.node_rank} needs --headless (only node 0 runs the server)")
    if args.nnodes > 1 and args.headless and args.node_rank == 0:
        parser.error("--headless runs a node other than 0: give its --node-rank (node 0 runs the server)")
    if args.nnodes > 1 and size > 1:
        parser.error("--nnodes above 1 spans one engine's tensor-parallel ranks: --data-parallel-size must be 1")


def across_hosts(args: argparse.Namespace) -> bool:
    """Engine replicas on several hosts (a node of one engine's tensor-parallel ranks, --nnodes, is not one:
    its ranks meet through torch.distributed, common/nodes.py)."""
    return (args.headless and args.nnodes == 1) or args.data_parallel_size_local < args.data_parallel_size


class NodeRefusedError(RuntimeError):
    """The frontend node refused this headless node (other terms, or another cluster secret)."""


def cluster_keys(args: argparse.Namespace) -> CurveKeys | None:
    """The CurveZMQ keys, where replicas live on several hosts (None where all are here). Raises
    ClusterSecretError where the secret is missing: no socket between hosts without one."""
    from common.cluster_secret import derive_curve_keys, read_cluster_secret

    if not across_hosts(args):
        return None
    return derive_curve_keys(read_cluster_secret(args.cluster_secret_file))


def link_endpoint(args: argparse.Namespace) -> str:
    host = args.data_parallel_address
    return (
        f"tcp://[{host}]:{args.data_parallel_rpc_port}"
        if ":" in host
        else f"tcp://{host}:{args.data_parallel_rpc_port}"
    )


def local_replicas(args: argparse.Namespace):
    """This node's engine replicas (global indices, named as among all of them)."""
    from common.engine_replica import EngineReplica

    start, size = args.data_parallel_start_rank, args.data_parallel_size
    return [EngineReplica(index, size, start) for index in range(start, start + args.data_parallel_size_local)]


@dataclass
class RemoteReplicas:
    """The frontend node's replicas on headless nodes: which exist, which have joined (and serve)."""

    roles: dict[int, list[str]]  # every remote replica's processes
    joined: dict[int, JoinedReplica] = field(default_factory=dict)
    events: object = None  # the node link's socket to the launcher (zmq.Socket), bound by bind_events

    @classmethod
    def of(cls, args: argparse.Namespace, ranks: int) -> RemoteReplicas:
        from common.engine_replica import EngineReplica

        size = args.data_parallel_size
        remote = range(args.data_parallel_size_local, size)
        return cls({index: EngineReplica(index, size).roles(ranks) for index in remote})

    def bind_events(self, endpoints) -> None:
        import zmq

        from common.transport import pull_socket

        self.events = pull_socket(zmq.Context.instance(), endpoints.node_events)

    def link_process(self, args: argparse.Namespace, keys: CurveKeys, config, info, tail: tuple) -> tuple:
        """The node link's target and arguments (node_link/head.py)."""
        from common.node_messages import NodeWelcome
        from node_link import head
        from node_link.terms import ClusterTerms, model_fingerprint

        terms = ClusterTerms(
            model_fingerprint(info),
            config.block_size,
            args.data_parallel_size,
            config.tensor_parallel_size,
            tuple(self.roles),
        )
        welcome = NodeWelcome(args.tokenizer_workers, args.api_server_count)
        run_dir, log_level, parent_pid = tail[:3]
        return head.main, (
            keys,
            link_endpoint(args),
            terms,
            welcome,
            self.roles,
            args.watchdog_timeout,
            run_dir,
            log_level,
            parent_pid,
        )

    def take_events(self, timeout_ms: int = 0) -> list:
        """What the node link said since the last call (NodeJoin, NodeLost), waiting up to `timeout_ms` for the
        first."""
        import zmq

        from common.transport import recv

        out: list = []
        while self.events.poll(timeout_ms if not out else 0):  # type: ignore[attr-defined]
            out.append(recv(self.events, zmq.NOBLOCK))  # type: ignore[arg-type]
        return out

    def close(self) -> None:
        if self.events is not None:
            self.events.close(linger=0)  # type: ignore[attr-defined]
