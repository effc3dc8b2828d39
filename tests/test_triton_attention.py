"""TritonAttention against the torch reference, on random mixed batches.

Without CUDA the kernels run in the Triton interpreter on CPU. @triton.jit picks the interpreter when
a kernel is defined, so the switch is set here, before triton_kernels is imported; only this module
runs Triton kernels, so the setting leaking into the rest of the session changes nothing else.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass, replace

import numpy as np
import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

pytest.importorskip("triton", reason="triton is not installed (pip install triton)")

from gpu_worker.attention import (  # noqa: E402
    BatchLayout,
    TorchAttention,
    triton_kernels,  # noqa: E402
)
from gpu_worker.attention.triton_backend import TritonAttention  # noqa: E402
from gpu_worker.graph_capture import field_views, flat_size  # noqa: E402
from gpu_worker.host_copy import StagingRing  # noqa: E402
from gpu_worker.mixed_graphs import MixedStepLayout  # noqa: E402
from tests.test_host_copy import cpu_staged_ring  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
# On a CPU too, the device path: each step's uploads are views of one buffer that the next step's rewrite, so a
# test that keeps a step's metadata past the next build_metadata fails here as it would on a GPU.
STAGING = StagingRing(DEVICE, 1 << 24) if DEVICE.type == "cuda" else cpu_staged_ring(1 << 24)


def build_metadata(backend, layout, slots: torch.Tensor):
    STAGING.next_step()
    return backend.build_metadata(layout, slots.cpu().numpy(), STAGING.upload)


SCALE = 0.2


@dataclass
class Batch:
    layout: BatchLayout
    slots: torch.Tensor  # [T]
    qkv: torch.Tensor  # [T, Hq + 2 Hkv, D]: q, k and v are views into it, as a fused projection gives
    heads: int
    k_cache: torch.Tensor  # every slot random: the reference's store
    v_cache: torch.Tensor
    poisoned: torch.Tensor  # [num slots] True where no cached context lives: NaN in the Triton run

    def qkv_views(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        kv_heads = (self.qkv.shape[1] - self.heads) // 2
        return self.qkv.split([self.heads, kv_heads, kv_heads], dim=1)


def random_tables(context_lens: list[int], block_size: int, gen: torch.Generator) -> tuple[list[list[int]], int]:
    """Disjoint tables from a shuffled pool with spare blocks, so some blocks belong to nobody."""
    need = [-(-n // block_size) for n in context_lens]
    num_blocks = sum(need) + 4
    pool = torch.randperm(num_blocks, generator=gen).tolist()
    tables, used = [], 0
    for n in need:
        tables.append(pool[used : used + n])
        used += n
    return tables, num_blocks


def make_batch(
    layout: BatchLayout,
    num_blocks: int,
    block_size: int,
    heads: int,
    kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    gen: torch.Generator,
) -> Batch:
    slots, cached = [], set()
    for q_len, ctx, table in zip(layout.query_lens, layout.context_lens, layout.block_table.tolist()):
        flat = [table[p // block_size] * block_size + p % block_size for p in range(ctx)]
        slots += flat[ctx - q_len :]
        cached.update(flat[: ctx - q_len])
    poisoned = torch.ones(num_blocks * block_size, dtype=torch.bool)
    poisoned[sorted(cached - set(slots))] = False

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen).to(DEVICE, dtype)

    return Batch(
        layout,
        torch.tensor(slots),
        rand(len(slots), heads + 2 * kv_heads, head_dim),
        heads,
        rand(num_blocks, block_size, kv_heads, head_dim),
        rand(num_blocks, block_size, kv_heads, head_dim),
        poisoned.to(DEVICE),
    )


def mixed_batch(
    seqs: list[tuple[int, int]],
    block_size: int,
    heads: int,
    kv_heads: int,
    head_dim: int,
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
) -> Batch:
    """seqs: (cached tokens, new tokens) per sequence, multi-token ones first."""
    gen = torch.Generator().manual_seed(seed)
    context_lens = [cached + new for cached, new in seqs]
    tables, num_blocks = random_tables(context_lens, block_size, gen)
    query_lens = [new for _, new in seqs]
    layout = BatchLayout.build(query_lens, context_lens, tables, block_size)
    return make_batch(layout, num_blocks, block_size, heads, kv_heads, head_dim, dtype, gen)


def nan_filled_empty(monkeypatch: pytest.MonkeyPatch) -> None:
    """Fresh float tensors (outputs, split-KV partials) start as NaN, so any element never written shows."""
    real_empty, real_empty_like = torch.empty, torch.empty_like

    def poison(tensor: torch.Tensor) -> torch.Tensor:
        return tensor.fill_(float("nan")) if tensor.is_floating_point() else tensor

    monkeypatch.setattr(torch, "empty", lambda *a, **kw: poison(real_empty(*a, **kw)))
    monkeypatch.setattr(torch, "empty_like", lambda *a, **kw: poison(real_empty_like(*a, **kw)))


def run_reference(batch: Batch, **options) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """options: the layer's sliding_window and softcap."""
    backend = TorchAttention(batch.k_cache.shape[1])
    k_cache, v_cache = batch.k_cache.clone(), batch.v_cache.clone()
    q, k, v = batch.qkv_views()
    metadata = build_metadata(backend, batch.layout, batch.slots)
    out = backend.forward(q, k, v, k_cache, v_cache, metadata, SCALE, **options)
    return out, k_cache, v_cache


def run_triton(
    batch: Batch, monkeypatch: pytest.MonkeyPatch, **options
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Caches NaN wherever no cached context lives, outputs NaN until written."""
    backend = TritonAttention(batch.k_cache.shape[1], batch.k_cache.shape[2])
    k_cache, v_cache = (_poison_slots(c, batch.poisoned) for c in (batch.k_cache, batch.v_cache))
    q, k, v = batch.qkv_views()
    metadata = build_metadata(backend, batch.layout, batch.slots)
    with monkeypatch.context() as patch:
        nan_filled_empty(patch)
        out = backend.forward(q, k, v, k_cache, v_cache, metadata, SCALE, **options)
    return out, k_cache, v_cache


def _poison_slots(cache: torch.Tensor, poisoned: torch.Tensor) -> torch.Tensor:
    cache = cache.clone()
    cache.view(-1, *cache.shape[2:])[poisoned] = float("nan")
    return cache


def assert_matches_reference(batch: Batch, monkeypatch: pytest.MonkeyPatch, tol: float = 1e-5, **options) -> None:
    out, k_cache, v_cache = run_triton(batch, monkeypatch, **options)
    ref_out, ref_k, ref_v = run_reference(batch, **options)
    torch.testing.assert_close(out.float(), ref_out.float(), rtol=tol, atol=tol)
    # Written slots hold the new K/V; every other poisoned slot is untouched.
    written = torch.zeros_like(batch.poisoned)
    written[batch.slots.to(DEVICE)] = True
    for cache, ref in ((k_cache, ref_k), (v_cache, ref_v)):
        expected = _poison_slots(ref, batch.poisoned & ~written)
        torch.testing.assert_close(cache, expected, rtol=0, atol=0, equal_nan=True)


# (cached, new): prefill chunks of different lengths (one spanning several query tiles, some after
# cached context), then decodes, one of them a one-token prompt with nothing cached.
MIXED = [(0, 70), (40, 33), (100, 2), (19, 16), (0, 1), (20, 1), (150, 1), (63, 1)]


@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (8, 2)], ids=["mha", "gqa"])
@pytest.mark.parametrize("block_size", [16, 8])
def test_mixed_batch_matches_reference(heads, kv_heads, block_size, monkeypatch):
    assert_matches_reference(mixed_batch(MIXED, block_size, heads, kv_heads, head_dim=32), monkeypatch)


def test_prefill_only_and_decode_only_batches_match_reference(monkeypatch):
    assert_matches_reference(mixed_batch([(30, 45), (0, 9)], 16, 4, 2, 32, seed=1), monkeypatch)
    assert_matches_reference(mixed_batch([(30, 1), (0, 1), (77, 1)], 16, 4, 2, 32, seed=2), monkeypatch)


@pytest.mark.parametrize("block_size", [1, 128])
def test_extreme_block_sizes_match_reference(block_size, monkeypatch):
    assert_matches_reference(mixed_batch([(20, 30), (140, 1)], block_size, 4, 2, 32, seed=3), monkeypatch)


@pytest.mark.parametrize("head_dim", [64, 80])
def test_head_dims_match_reference(head_dim, monkeypatch):
    """64 is the common case; 80 is not a power of two, so it is padded and masked."""
    assert_matches_reference(mixed_batch([(17, 20), (50, 1), (3, 1)], 16, 4, 2, head_dim, seed=4), monkeypatch)


def test_half_precision_matches_reference(monkeypatch):
    # The interpreter's tl.dot mishandles bfloat16, so on CPU the half-precision case is float16.
    dtype = torch.bfloat16 if DEVICE.type == "cuda" else torch.float16
    batch = mixed_batch(MIXED, 16, 8, 2, 32, dtype=dtype, seed=5)
    assert_matches_reference(batch, monkeypatch, tol=2e-2)


def slid_past(batch: Batch, window: int) -> Batch:
    """The batch with every slot that all of a sequence's queries have slid past poisoned (NaN), as a block
    freed and reused by another request would hold anything: a kernel must never read one."""
    poisoned = batch.poisoned.clone()
    for q_len, ctx, table in zip(batch.layout.query_lens, batch.layout.context_lens, batch.layout.block_table):
        block_size = batch.k_cache.shape[1]
        for position in range(max(0, int(ctx - q_len) - window + 1)):
            poisoned[int(table[position // block_size]) * block_size + position % block_size] = True
    return Batch(batch.layout, batch.slots, batch.qkv, batch.heads, batch.k_cache, batch.v_cache, poisoned)


# Windows shorter than a key tile, one tile, and not a multiple of either tile or block size.
@pytest.mark.parametrize("window", [1, 5, 64, 100])
def test_sliding_window_matches_reference_and_reads_nothing_slid_past(window, monkeypatch):
    batch = mixed_batch(MIXED + [(700, 1)], 16, 8, 2, 32, seed=11)
    assert_matches_reference(slid_past(batch, window), monkeypatch, sliding_window=window)


def test_logit_softcap_matches_reference(monkeypatch):
    assert_matches_reference(mixed_batch(MIXED, 16, 8, 2, 32, seed=12), monkeypatch, softcap=1.5)


def test_sliding_window_with_softcap_matches_reference(monkeypatch):
    batch = mixed_batch(MIXED + [(300, 1)], 8, 4, 2, 32, seed=13)
    assert_matches_reference(slid_past(batch, 40), monkeypatch, sliding_window=40, softcap=2.0)


def test_the_reference_window_leaves_a_query_its_last_window_keys():
    """transformers' rule: query at position p sees keys p - window + 1 .. p. With all values but one zero,
    the output is nonzero exactly where that key is visible."""
    block_size, window, ctx = 4, 3, 10
    layout = BatchLayout.build([ctx], [ctx], [[0, 1, 2]], block_size)
    backend = TorchAttention(block_size)
    q = torch.randn(ctx, 1, 8, device=DEVICE)  # where the metadata is staged (STAGING uploads to DEVICE)
    k = torch.randn(ctx, 1, 8, device=DEVICE)
    v = torch.zeros(ctx, 1, 8, device=DEVICE)
    v[4] = 1.0
    caches = [torch.zeros(3, block_size, 1, 8, device=DEVICE) for _ in range(2)]
    metadata = build_metadata(backend, layout, torch.arange(ctx))
    out = backend.forward(q, k, v, *caches, metadata, SCALE, sliding_window=window)
    sees_key_4 = (out[:, 0, 0] != 0).tolist()
    assert sees_key_4 == [4 <= p < 4 + window for p in range(ctx)]


def test_sequence_reads_prefix_written_in_the_same_forward(monkeypatch):
    """B shares A's first two blocks (a prefix-cache hit) while A is still computing them: A's K/V must
    reach the store before B attends."""
    block_size = 16
    layout = BatchLayout.build(
        query_lens=[40, 8], context_lens=[40, 40], block_tables=[[3, 0, 5], [3, 0, 1]], block_size=block_size
    )
    gen = torch.Generator().manual_seed(6)
    assert_matches_reference(make_batch(layout, 6, block_size, 4, 2, 32, torch.float32, gen), monkeypatch)


def test_long_decode_contexts_are_split_and_match_reference(monkeypatch):
    """Few sequences with long contexts are cut into several slices, merged; the short one is one slice."""
    seqs = [(699, 1), (529, 1), (89, 1)]
    batch = mixed_batch(seqs, 16, 4, 2, 32, seed=7)
    counts = TritonAttention(16, num_kv_heads=2).decode_slices(batch.layout.context_lens).counts
    assert counts[0] > 1 and counts[1] > 1 and counts[2] == 1
    assert_matches_reference(batch, monkeypatch)


LAYER_OPTIONS = [
    pytest.param({}, id="plain"),
    pytest.param({"sliding_window": 100, "softcap": 3.0}, id="window-softcap"),
]


@pytest.mark.parametrize("options", LAYER_OPTIONS)
@pytest.mark.parametrize("slice_len", [64, 128, 320, 4096])
def test_decode_result_does_not_depend_on_the_slice_length(slice_len, options, monkeypatch):
    """With a window, slices wholly before it see nothing and weigh nothing."""
    batch = mixed_batch([(300, 1), (40, 1), (511, 1)], 16, 8, 2, 32, seed=8)
    backend = TritonAttention(16)
    metadata = build_metadata(backend, batch.layout, batch.slots)
    q, k, v = batch.qkv_views()
    k_cache, v_cache = batch.k_cache.clone(), batch.v_cache.clone()
    triton_kernels.store_kv(k, v, k_cache, v_cache, metadata.slot_mapping)
    slices = triton_kernels.decode_slices(batch.layout.context_lens, 2, 132, slice_len=slice_len)

    def on_device(values) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.int32, device=DEVICE)

    with monkeypatch.context() as patch:
        nan_filled_empty(patch)
        out = torch.empty_like(q)
        triton_kernels.decode_attention(
            q,
            out,
            k_cache,
            v_cache,
            metadata.block_tables,
            metadata.context_lens,
            SCALE,
            on_device([0, 0, 3, slices.slice_len]),
            on_device(slices.seqs),
            on_device(slices.starts),
            triton_kernels.decode_merge_counts(3, 2, DEVICE),
            **options,
        )
    torch.testing.assert_close(out, run_reference(batch, **options)[0], rtol=1e-5, atol=1e-5)


# (cached, new) decodes and, at slices of 64 tokens, how many slices each context is cut into.
DECODE_CUTS = [
    pytest.param([(40, 1), (63, 1), (0, 1), (17, 1)], [1, 1, 1, 1], id="none-cut"),
    pytest.param([(40, 1), (300, 1), (63, 1), (200, 1)], [1, 5, 1, 4], id="some-cut"),
    pytest.param([(100, 1), (300, 1), (450, 1), (129, 1)], [2, 5, 8, 3], id="all-cut"),
]


def graph_sized_decode_launch(
    batch: Batch,
    slice_len: int,
    padding_tokens: int,
    monkeypatch: pytest.MonkeyPatch,
    tiles: triton_kernels.DecodeTiles | None = None,
) -> tuple[Callable[[], torch.Tensor], torch.Tensor]:
    """The batch's decodes (every sequence one) in a launch sized for a larger step, as a CUDA graph launches
    them: 16 slices -1 and stale slice starts past the step's, merge counters for twice its decodes,
    padding_tokens rows of q after its queries. Returns a launch (a layer's decode; outputs and partials NaN
    until written) and the merge counters every launch uses. Its block tables and context lengths are copies, as
    a graph's static inputs are its own: build_metadata's are views of the staging buffer, which the next step's
    (the reference's) rewrites."""
    kv_heads = batch.k_cache.shape[2]
    backend = TritonAttention(16, kv_heads)
    metadata = build_metadata(backend, batch.layout, batch.slots)
    block_tables, context_lens = metadata.block_tables.clone(), metadata.context_lens.clone()
    q, k, v = batch.qkv_views()
    k_cache, v_cache = batch.k_cache.clone(), batch.v_cache.clone()
    triton_kernels.store_kv(k, v, k_cache, v_cache, metadata.slot_mapping)
    padding = torch.randn(padding_tokens, *q.shape[1:], generator=torch.Generator().manual_seed(2))
    q = torch.cat([q, padding.to(DEVICE, q.dtype)])
    num_decodes = len(batch.layout.context_lens)
    slices = triton_kernels.decode_slices(batch.layout.context_lens, kv_heads, 132, slice_len=slice_len)
    stale_starts = np.arange(num_decodes) * 7 + 10**6  # a larger step's, never read

    def on_device(values) -> torch.Tensor:
        return torch.tensor(np.asarray(values), dtype=torch.int32, device=DEVICE)

    span = on_device([0, 0, num_decodes, slice_len])
    slice_seqs = on_device(np.concatenate([slices.seqs, np.full(16, -1, np.int32)]))
    slice_starts = on_device(np.concatenate([slices.starts, stale_starts]))
    merge_counts = triton_kernels.decode_merge_counts(2 * num_decodes, kv_heads, DEVICE)

    def launch() -> torch.Tensor:
        with monkeypatch.context() as patch:
            nan_filled_empty(patch)
            out = torch.empty_like(q)
            triton_kernels.decode_attention(
                q,
                out,
                k_cache,
                v_cache,
                block_tables,
                context_lens,
                SCALE,
                span,
                slice_seqs,
                slice_starts,
                merge_counts,
                tiles=tiles,
            )
        return out

    return launch, merge_counts


@pytest.mark.parametrize("seq_major", [False, True], ids=["heads-in-turn", "slices-heads-together"])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (8, 2)], ids=["mha", "gqa"])
@pytest.mark.parametrize("seqs,cuts", DECODE_CUTS)
def test_a_graph_sized_decode_launch_merges_its_cut_contexts_and_leaves_its_counters_zero(
    seqs, cuts, heads, kv_heads, head_dim, seq_major, monkeypatch
):
    """Two launches with the same counters (two layers of one step) each give the reference's outputs, write
    no padding row and leave every counter zero, in either launch order."""
    batch = mixed_batch(seqs, 16, heads, kv_heads, head_dim, seed=14)
    slices = triton_kernels.decode_slices(batch.layout.context_lens, kv_heads, 132, slice_len=64)
    assert slices.counts.tolist() == cuts
    tiles = replace(triton_kernels.decode_tiles(head_dim, False), seq_major=seq_major)
    launch, merge_counts = graph_sized_decode_launch(batch, 64, 3, monkeypatch, tiles)
    reference = run_reference(batch)[0]
    for _ in range(2):
        out = launch()
        torch.testing.assert_close(out[: len(seqs)], reference, rtol=1e-5, atol=1e-5)
        assert out[len(seqs) :].isnan().all()
        assert not merge_counts.any()


@pytest.mark.skipif(DEVICE.type != "cuda", reason="the interpreter runs a launch's programs one after another")
def test_cut_contexts_merge_to_the_same_bits_whichever_of_their_slices_finishes_last(monkeypatch):
    """On a GPU the slices of a context finish in any order and the last merges them; it reads them in order, so
    every launch gives the same bits, and none reads a partial before it is written (NaN until then)."""
    rng = np.random.default_rng(15)
    seqs = [(int(n), 1) for n in rng.integers(100, 1500, size=48)]
    batch = mixed_batch(seqs, 16, 16, 4, 128, seed=15)
    launch, merge_counts = graph_sized_decode_launch(batch, 64, 0, monkeypatch)
    first = launch()
    torch.testing.assert_close(first, run_reference(batch)[0], rtol=1e-5, atol=1e-5)
    for _ in range(50):
        assert torch.equal(launch(), first)
    assert not merge_counts.any()


def slice_counts(contexts, num_kv_heads: int, capacity: int | None = None) -> np.ndarray:
    return triton_kernels.decode_slices(np.asarray(contexts), num_kv_heads, 132, capacity).counts


def test_decode_slices_split_only_where_the_gpu_would_otherwise_idle_or_wait():
    assert (slice_counts([700] * 256, num_kv_heads=12) == 1).all()  # GPU already full: nothing to merge
    assert (slice_counts([200, 200], num_kv_heads=8) == 1).all()  # contexts too short to be worth it
    assert (slice_counts([4096] * 32, num_kv_heads=8) > 1).all()  # few long ones: every SM gets work
    assert slice_counts([1 << 20], num_kv_heads=1)[0] == triton_kernels.MAX_SPLITS


def test_one_long_decode_among_short_ones_is_cut_to_their_length():
    # 64 requests decoding short contexts beside one that just prefilled 7,000 tokens: a step lasts as long as
    # its longest program, so the long context is spread over as many programs as its length asks for.
    slices = triton_kernels.decode_slices(np.array([500] * 64 + [7000]), 3, 132)
    counts = slices.counts
    assert slices.slice_len <= 512
    assert counts[-1] == -(-7000 // slices.slice_len) and (counts[:-1] <= 2).all()
    # The long one launches first: the short ones fill the GPU beside it and the launch ends on them.
    assert slices.seqs.tolist() == [64] * counts[-1] + np.repeat(np.arange(64), counts[:-1]).tolist()


def test_decodes_launch_longest_first_each_one_s_slices_together():
    contexts = np.array([90, 700, 300, 700, 5])
    slices = triton_kernels.decode_slices(contexts, 8, 132, slice_len=256)
    assert slices.counts.tolist() == [1, 3, 2, 3, 1]
    assert slices.seqs.tolist() == [1, 1, 1, 3, 3, 3, 2, 2, 0, 4]  # ties keep their order
    assert slices.starts.tolist() == [8, 0, 6, 3, 9, 10]  # each one's first slice; then how many in all


def test_decode_slices_always_fit_the_launch_a_graph_sized_for_its_decodes():
    rng = np.random.default_rng(0)
    for decodes in (1, 7, 64, 512):
        capacity = triton_kernels.decode_slice_capacity(decodes)
        for top in (2, 300, 8192, 1 << 17):
            contexts = rng.integers(1, top, size=decodes, endpoint=True)
            for kv_heads in (1, 3, 12):
                assert slice_counts(contexts, kv_heads, capacity).sum() <= capacity


def test_block_table_width_is_a_power_of_two_covering_every_context():
    # The first table lists a block beyond its context (allocated ahead): it is left out.
    layout = BatchLayout.build(
        query_lens=[1, 1], context_lens=[33, 70], block_tables=[[1, 2, 3, 9], [4, 5, 6, 7, 8]], block_size=16
    )
    assert layout.num_prefill_seqs == 0
    assert layout.block_table.tolist() == [[1, 2, 3, 0, 0, 0, 0, 0], [4, 5, 6, 7, 8, 0, 0, 0]]
    assert layout.slot_mapping(np.array([32, 69]), 16).tolist() == [3 * 16 + 0, 8 * 16 + 5]
    metadata = build_metadata(TritonAttention(16), layout, torch.tensor([32, 69]))
    assert metadata.block_tables.tolist() == layout.block_table.tolist()


@pytest.mark.parametrize(
    "seqs,max_context",
    [
        pytest.param(MIXED, 256, id="prefills-and-decodes-unsplit"),
        pytest.param(MIXED, 2048, id="prefills-and-decodes-split-kv"),
        pytest.param(MIXED[:4], 256, id="prefills-only-unsplit"),
        pytest.param(MIXED[:4], 2048, id="prefills-only-split-kv"),
        pytest.param(MIXED + [(1500, 1)], 2048, id="a-long-decode-in-slices"),
    ],
)
def test_a_step_in_a_graph_buckets_static_inputs_matches_reference(seqs, max_context, monkeypatch):
    """A step written into the static inputs a mixed-step CUDA graph reads (mixed_graphs.py), over fields
    holding garbage (a larger step's values), with every launch sized for the bucket: the real tokens'
    outputs and K/V are the reference's; padding tokens output zeros and write nothing but the scratch slot."""
    block_size, heads, kv_heads, head_dim = 16, 8, 2, 32
    batch = mixed_batch(seqs, block_size, heads, kv_heads, head_dim, seed=9)
    num_tokens, layout = len(batch.slots), batch.layout
    owned = set(layout.block_table.ravel().tolist())
    scratch = next(b for b in range(batch.k_cache.shape[0]) if b not in owned)
    backend = TritonAttention(block_size, kv_heads)
    step_layout = MixedStepLayout(
        max_tokens=300,
        max_seqs=12,
        table_width=max_context // block_size,
        scratch_slot=scratch * block_size,
        attention=backend,
    )
    flat = torch.full((flat_size(step_layout.shapes),), 10**6, dtype=torch.int32)  # read anywhere, it would fault
    last_rows = np.cumsum(layout.query_lens) - 1
    host = field_views(step_layout.shapes, flat.numpy())
    bucket = step_layout.fill(
        host,
        np.zeros(num_tokens, np.int64),
        np.zeros(num_tokens, np.int64),
        batch.slots.numpy(),
        layout,
        last_rows,
        np.zeros(0, np.int64),
        np.zeros(0, np.int64),
    )
    assert bucket > num_tokens  # 121 to 126 tokens in the 128-token bucket
    num_decodes = len(seqs) - layout.num_prefill_seqs
    slices_of_each = np.bincount(host["slice_seqs"][: host["slice_starts"][num_decodes]], minlength=num_decodes)
    assert (slices_of_each > 1).any() == (max(seqs)[0] > 1000)  # only the long decode is cut
    metadata = backend.static_metadata(
        step_layout.attention_buffers(field_views(step_layout.shapes, flat.to(DEVICE)), bucket), max_context
    )
    padding = torch.randn(bucket - num_tokens, *batch.qkv.shape[1:], generator=torch.Generator().manual_seed(1))
    qkv = torch.cat([batch.qkv, padding.to(DEVICE, batch.qkv.dtype)])
    q, k, v = qkv.split([heads, kv_heads, kv_heads], dim=1)
    k_cache, v_cache = (_poison_slots(c, batch.poisoned) for c in (batch.k_cache, batch.v_cache))
    with monkeypatch.context() as patch:
        nan_filled_empty(patch)
        out = backend.forward(q, k, v, k_cache, v_cache, metadata, SCALE)

    ref_out, ref_k, ref_v = run_reference(batch)
    torch.testing.assert_close(out[:num_tokens], ref_out, rtol=1e-5, atol=1e-5)
    assert torch.equal(out[num_tokens:], torch.zeros_like(out[num_tokens:]))
    written = torch.zeros_like(batch.poisoned)
    written[batch.slots.to(DEVICE)] = True
    others = torch.ones(k_cache.shape[0], dtype=torch.bool)
    others[scratch] = False
    for cache, ref in ((k_cache, ref_k), (v_cache, ref_v)):
        expected = _poison_slots(ref, batch.poisoned & ~written)
        torch.testing.assert_close(cache[others], expected[others], rtol=0, atol=0, equal_nan=True)


@pytest.mark.parametrize("options", LAYER_OPTIONS)
@pytest.mark.parametrize("num_splits", [1, 2, 3, 8])
def test_prefill_result_does_not_depend_on_the_number_of_splits(num_splits, options, monkeypatch):
    """Chunks of long prompts (one whose tiles straddle a slice boundary on the causal diagonal, one with
    fewer key tiles than slices): every slice count gives the reference's output."""
    batch = mixed_batch([(600, 70), (35, 20)], 16, 8, 2, 32, seed=10)
    backend = TritonAttention(16)
    metadata = build_metadata(backend, batch.layout, batch.slots)
    q, k, v = batch.qkv_views()
    k_cache, v_cache = batch.k_cache.clone(), batch.v_cache.clone()
    triton_kernels.store_kv(k, v, k_cache, v_cache, metadata.slot_mapping)
    with monkeypatch.context() as patch:
        nan_filled_empty(patch)
        out = torch.empty_like(q)
        triton_kernels.prefill_attention(
            q,
            out,
            k_cache,
            v_cache,
            metadata.block_tables,
            metadata.context_lens,
            metadata.query_starts,
            metadata.prefill_tiles,
            SCALE,
            num_splits,
            **options,
        )
    torch.testing.assert_close(out, run_reference(batch, **options)[0], rtol=1e-5, atol=1e-5)


def test_prefill_split_heuristic_splits_a_chunk_of_a_long_prompt_only():
    splits = triton_kernels.prefill_num_splits
    assert splits(num_tiles=8, num_heads=9, max_context=7000, num_sms=132) > 1  # a 512-token chunk, 7k context
    assert splits(num_tiles=8, num_heads=9, max_context=200, num_sms=132) == 1  # short context: nothing to split
    assert splits(num_tiles=256, num_heads=12, max_context=16384, num_sms=132) == 1  # GPU already full
