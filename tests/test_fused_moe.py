"""The fused mixture-of-experts kernels (gpu_worker/models/fused_moe.py) give the torch path's sums: each
token's k experts, weighted as Mixtral (renormalized, float32 weights) and Qwen3-MoE (neither) route them,
at decode and prefill sizes; they read only the picked experts, in shapes that do not depend on the routing
(so a CUDA graph replays them on any routing); and a tensor-parallel rank's share adds up to the whole.
No token count compiles a kernel after the warm-up's. Without CUDA they run in the Triton interpreter on CPU
(see test_triton_attention.py)."""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

pytest.importorskip("triton", reason="triton is not installed (pip install triton)")

from gpu_worker.models.fused_moe import Tiles, fused_experts, tiles_for  # noqa: E402
from gpu_worker.models.moe import SparseMoE  # noqa: E402
from gpu_worker.models.moe_sort import sort_by_expert  # noqa: E402
from gpu_worker.parallel import SINGLE, TensorParallel  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
HALF = torch.bfloat16 if DEVICE.type == "cuda" else torch.float16  # the interpreter has no bfloat16
HIDDEN, INTERMEDIATE = 48, 40  # neither a multiple of a tile: the kernels' edges are masked


def moe_layer(num_experts: int, top_k: int, style: str, dtype: torch.dtype, tp: TensorParallel = SINGLE):
    """A random layer with the router of `style`: "mixtral" or "qwen3_moe" (norm_topk_prob off)."""
    torch.manual_seed(0)
    moe = SparseMoE(
        HIDDEN,
        INTERMEDIATE,
        num_experts,
        top_k,
        tp,
        "silu",
        fused=False,
        renormalize=style == "mixtral",
        weights_in_model_dtype=style == "qwen3_moe",
    )
    for param in moe.parameters():
        torch.nn.init.normal_(param, std=0.3)
    return moe.to(DEVICE, dtype)


def tokens(n: int, dtype: torch.dtype, seed: int = 1) -> torch.Tensor:
    return torch.randn(n, HIDDEN, generator=torch.Generator().manual_seed(seed)).to(DEVICE, dtype)


def close(dtype: torch.dtype) -> dict:
    return {"rtol": 1e-5, "atol": 1e-5} if dtype == torch.float32 else {"rtol": 2e-2, "atol": 2e-2}


@pytest.mark.parametrize("num_tokens", [3, 40])  # a decode batch (16-row blocks) and a prefill (64-row blocks)
@pytest.mark.parametrize(("num_experts", "top_k"), [(4, 2), (6, 2), (8, 8)])
@pytest.mark.parametrize("style", ["mixtral", "qwen3_moe"])
@pytest.mark.parametrize("dtype", [torch.float32, HALF])
def test_fused_experts_give_the_routed_torch_sum(dtype, style, num_experts, top_k, num_tokens):
    moe = moe_layer(num_experts, top_k, style, dtype)
    x = tokens(num_tokens, dtype)
    ids, weights = moe.route(x)
    expected = moe.experts(x, ids, weights)
    got = fused_experts(x, moe.experts.gate_up_proj, moe.experts.down_proj, ids, weights)
    assert got.dtype == dtype
    torch.testing.assert_close(got, expected, **close(dtype))


@pytest.mark.parametrize("group_m", [0, 1, 3])  # 3: the last group of blocks is short
def test_every_program_order_gives_the_same_sum(group_m):
    moe = moe_layer(6, 2, "mixtral", torch.float32)
    x = tokens(30, torch.float32)
    ids, weights = moe.route(x)
    tiles = Tiles(block_m=16, block_n=16, block_k=16, num_warps=4, num_stages=2, group_m=group_m)
    got = fused_experts(x, moe.experts.gate_up_proj, moe.experts.down_proj, ids, weights, tiles=tiles)
    torch.testing.assert_close(got, moe.experts(x, ids, weights), **close(torch.float32))


def test_the_whole_layer_runs_fused_when_asked():
    moe = moe_layer(8, 2, "mixtral", torch.float32)
    x = tokens(5, torch.float32)
    expected = moe(x)
    moe.experts.fused = True
    torch.testing.assert_close(moe(x), expected, **close(torch.float32))


def test_the_experts_no_token_picked_are_never_read():
    """Their weights are NaN: a kernel that multiplied them, even by a zero routing weight, would return NaN."""
    moe = moe_layer(8, 2, "mixtral", torch.float32)
    x = tokens(3, torch.float32)
    ids, weights = moe.route(x)
    expected = moe.experts(x, ids, weights)
    unpicked = sorted(set(range(8)) - set(ids.flatten().tolist()))
    assert unpicked, "three tokens' top-2 leave some of 8 experts out"
    moe.experts.gate_up_proj.data[unpicked] = float("nan")
    moe.experts.down_proj.data[unpicked] = float("nan")
    got = fused_experts(x, moe.experts.gate_up_proj, moe.experts.down_proj, ids, weights)
    torch.testing.assert_close(got, expected, **close(torch.float32))


@pytest.mark.parametrize(("num_tokens", "num_experts"), [(1, 6), (5, 6), (33, 6), (700, 8)])  # 700: many chunks
def test_pairs_sort_into_blocks_of_one_expert_each_in_shapes_that_ignore_the_routing(num_tokens, num_experts):
    top_k, block_m = 2, 16
    spread = torch.stack([torch.randperm(num_experts)[:top_k] for _ in range(num_tokens)]).to(DEVICE)
    crowded = torch.tensor([[0, 1]] * num_tokens, device=DEVICE)  # every token on the same two experts
    shapes = set()
    for ids in (spread, crowded):
        rows, block_experts = sort_by_expert(ids, num_experts, block_m)
        shapes.add((rows.shape, block_experts.shape))
        num_pairs = ids.numel()
        real = rows[rows < num_pairs]
        assert sorted(real.tolist()) == list(range(num_pairs)), "every pair once"
        for block, expert in enumerate(block_experts.tolist()):
            pairs = rows[block * block_m : (block + 1) * block_m]
            pairs = pairs[pairs < num_pairs]
            if expert == num_experts:
                assert pairs.numel() == 0, "an unused block holds only padding"
            else:
                assert pairs.numel() > 0 and (ids.flatten()[pairs] == expert).all()
                assert (pairs.diff() > 0).all(), "an expert's pairs in their order"
        assert (block_experts.diff() >= 0).all(), "blocks in expert order, the unused ones last"
    assert len(shapes) == 1


def test_decode_batches_take_small_blocks_and_prefills_large_ones():
    assert tiles_for(num_pairs=8 * 64, num_experts=128).block_m == 16
    assert tiles_for(num_pairs=2 * 4096, num_experts=8).block_m == 64


def test_tensor_parallel_ranks_shares_add_up_to_the_whole_layer():
    """Each rank holds every expert's half of the intermediate width; their fused shares, summed (the
    all-reduce), give the unsplit layer's output."""
    whole = moe_layer(4, 2, "mixtral", torch.float32)
    x = tokens(6, torch.float32)
    ids, weights = whole.route(x)
    shares = []
    for rank in range(2):
        part = moe_layer(4, 2, "mixtral", torch.float32, TensorParallel(rank, 2))
        part.experts.load("gate_up_proj", whole.experts.gate_up_proj.data)
        part.experts.load("down_proj", whole.experts.down_proj.data)
        shares.append(fused_experts(x, part.experts.gate_up_proj, part.experts.down_proj, ids, weights))
    torch.testing.assert_close(shares[0] + shares[1], whole.experts(x, ids, weights), **close(torch.float32))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a CUDA device")
def test_a_captured_graph_replays_the_experts_of_a_new_routing():
    moe = moe_layer(8, 2, "qwen3_moe", torch.bfloat16)
    x = tokens(4, torch.bfloat16)
    ids, weights = moe.route(x)
    experts = moe.experts
    fused_experts(x, experts.gate_up_proj, experts.down_proj, ids, weights)  # compile before capturing
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fused_experts(x, experts.gate_up_proj, experts.down_proj, ids, weights)
    x.copy_(tokens(4, torch.bfloat16, seed=2))
    new_ids, new_weights = moe.route(x)
    assert not torch.equal(new_ids, ids)
    ids.copy_(new_ids)
    weights.copy_(new_weights)
    graph.replay()
    torch.testing.assert_close(out, experts(x, new_ids, new_weights), **close(torch.bfloat16))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="compiles happen on CUDA (the interpreter compiles nothing)")
def test_one_decode_and_one_prefill_size_build_every_kernel_a_token_count_needs(monkeypatch):
    """A compile mid-serving stalls every request: after a 2-token and a 600-token call, no token count compiles."""
    triton = pytest.importorskip("triton")
    if not hasattr(getattr(triton, "knobs", None), "runtime"):
        pytest.skip(f"Triton {triton.__version__} has no compile hook to observe")
    moe = moe_layer(8, 2, "mixtral", torch.bfloat16)
    experts = moe.experts

    def run(num_tokens: int) -> None:
        x = tokens(num_tokens, torch.bfloat16)
        fused_experts(x, experts.gate_up_proj, experts.down_proj, *moe.route(x))

    run(2)
    run(600)
    compiled: list[str] = []
    monkeypatch.setattr(triton.knobs.runtime, "jit_cache_hook", lambda *, repr, **_: compiled.append(repr))
    for num_tokens in (1, 3, 16, 17, 64, 65, 100, 512, 1000):
        run(num_tokens)
    assert compiled == []
