"""What a headless node must agree with before its replicas may serve the frontend node's requests."""

from __future__ import annotations

from dataclasses import dataclass

from common.model_info import ModelInfo
from common.node_messages import NodeHello


def model_fingerprint(info: ModelInfo) -> str:
    """What makes two nodes' models the same to the router and the tokenizers (paths differ between hosts)."""
    return f"{info.model_type}, vocabulary {info.vocab_size}, context {info.max_model_len}"


@dataclass(frozen=True, slots=True)
class ClusterTerms:
    model: str
    block_size: int  # the routers hash prompts in blocks of the schedulers' size
    data_parallel_size: int
    tensor_parallel_size: int  # a replica's processes (their roles) are the same on every node
    remote_replicas: tuple[int, ...]  # the replicas headless nodes serve (the frontend node's are its own)

    def refusal(self, hello: NodeHello) -> str | None:
        """Why `hello`'s node may not join (None: it may)."""
        if hello.model != self.model:
            return f"it serves {hello.model!r}, the frontend node {self.model!r}"
        if hello.block_size != self.block_size:
            return f"its --block-size is {hello.block_size}, the frontend node's {self.block_size}"
        if hello.data_parallel_size != self.data_parallel_size:
            return (
                f"its --data-parallel-size is {hello.data_parallel_size}, the frontend node's {self.data_parallel_size}"
            )
        if hello.tensor_parallel_size != self.tensor_parallel_size:
            return (
                f"its --tensor-parallel-size is {hello.tensor_parallel_size}, "
                f"the frontend node's {self.tensor_parallel_size}"
            )
        foreign = sorted(set(hello.replicas) - set(self.remote_replicas))
        if foreign or not hello.replicas:
            return (
                f"it offers replicas {hello.replicas}; headless nodes serve {list(self.remote_replicas)} "
                "(--data-parallel-start-rank and --data-parallel-size-local)"
            )
        return None
