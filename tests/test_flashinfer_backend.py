"""The FlashInfer attention backend: which backend --attention-backend picks and why (any machine), and on a CUDA
device with flashinfer importable, FlashInfer's attention against the torch reference and the engine's greedy
tokens against the Triton backend's, with CUDA graphs (skipped elsewhere, with the reason)."""

from __future__ import annotations

import random
import sys
import types

import numpy as np
import pytest
import torch

from gpu_worker.attention import (
    AttentionBackendUnavailable,
    BatchLayout,
    LayerAttention,
    TorchAttention,
    choose_attention_backend,
)
from gpu_worker.attention.flashinfer_backend import PagedSeqs, import_problem

LLAMA_LAYERS = [LayerAttention(32, 8, 128, 128**-0.5)] * 4


@pytest.fixture
def flashinfer_missing(monkeypatch):
    monkeypatch.setitem(sys.modules, "flashinfer", None)  # `import flashinfer` raises ImportError


@pytest.fixture
def flashinfer_present(monkeypatch):
    monkeypatch.setitem(sys.modules, "flashinfer", types.ModuleType("flashinfer"))


# ------------------------------------------------------------------------------------------- the choice


def test_auto_on_a_cpu_is_the_torch_reference_and_says_why():
    choice = choose_attention_backend("auto", "cpu", LLAMA_LAYERS, torch.float32)
    assert choice.name == "torch" and "CUDA" in choice.reason


def test_auto_on_cuda_is_flashinfer_where_it_imports_and_runs_the_model(flashinfer_present):
    choice = choose_attention_backend("auto", "cuda", LLAMA_LAYERS, torch.bfloat16)
    assert choice.name == "flashinfer" and "auto" in choice.reason


def test_auto_on_cuda_without_flashinfer_is_triton_and_says_why(flashinfer_missing):
    choice = choose_attention_backend("auto", "cuda", LLAMA_LAYERS, torch.bfloat16)
    assert choice.name == "triton" and "flashinfer is not importable" in choice.reason


@pytest.mark.parametrize(
    "layers, dtype, why",
    [
        (LLAMA_LAYERS, torch.float32, "float16 and bfloat16"),
        ([LayerAttention(4, 2, 16, 0.25)], torch.bfloat16, "head_dim 16"),
        ([LayerAttention(8, 8, 64, 0.1), LayerAttention(8, 8, 128, 0.1)], torch.bfloat16, "head shapes"),
    ],
)
def test_auto_on_cuda_is_triton_for_a_model_flashinfer_cannot_run(flashinfer_present, layers, dtype, why):
    choice = choose_attention_backend("auto", "cuda", layers, dtype)
    assert choice.name == "triton" and why in choice.reason


def test_sliding_windows_and_soft_caps_stay_on_flashinfer(flashinfer_present):
    gemma2 = [LayerAttention(8, 4, 256, 0.0625, 4096, 50.0), LayerAttention(8, 4, 256, 0.0625, None, 50.0)]
    assert choose_attention_backend("auto", "cuda", gemma2, torch.bfloat16).name == "flashinfer"


def test_an_fp8_kv_cache_falls_back_to_triton_and_says_so(flashinfer_present):
    choice = choose_attention_backend("auto", "cuda", LLAMA_LAYERS, torch.bfloat16, kv_cache_dtype="fp8")
    assert choice.name == "triton" and "--kv-cache-dtype fp8" in choice.reason


def test_flashinfer_asked_for_where_it_cannot_run_is_an_error_naming_why(flashinfer_missing):
    with pytest.raises(AttentionBackendUnavailable, match="flashinfer is not importable"):
        choose_attention_backend("flashinfer", "cuda", LLAMA_LAYERS, torch.bfloat16)
    with pytest.raises(AttentionBackendUnavailable, match="needs a CUDA device"):
        choose_attention_backend("flashinfer", "cpu", LLAMA_LAYERS, torch.bfloat16)


def test_the_server_refuses_flashinfer_it_cannot_run_before_starting_with_exit_2(capsys):
    from launch import parse_args

    with pytest.raises(SystemExit) as exited:
        parse_args(["--attention-backend", "flashinfer", "--device", "cpu"])
    assert exited.value.code == 2
    assert "--attention-backend flashinfer runs on CUDA only (--device cpu)" in capsys.readouterr().err


@pytest.mark.skipif(torch.cuda.is_available() and import_problem() is None, reason="flashinfer runs here")
def test_the_server_refuses_flashinfer_where_it_is_not_installed_or_there_is_no_gpu(capsys):
    from launch import parse_args

    with pytest.raises(SystemExit) as exited:
        parse_args(["--attention-backend", "flashinfer"])
    assert exited.value.code == 2
    err = capsys.readouterr().err
    assert "flashinfer package is not installed" in err or "no CUDA device is visible" in err


# ------------------------------------------------------------------------------------------- FlashInfer's CSR


def test_block_tables_become_flashinfers_page_lists():
    layout = BatchLayout.build([3, 1, 1], [20, 16, 1], [[7, 2, 9], [4, 5], [6]], block_size=16)
    seqs = PagedSeqs.of(layout.query_lens, layout.context_lens, layout.block_table, 16)
    assert seqs.qo_indptr.tolist() == [0, 3, 4, 5]
    assert seqs.kv_indptr.tolist() == [0, 2, 3, 4]  # blocks allocated ahead (9, 5) are not the contexts'
    assert seqs.kv_indices.tolist() == [7, 2, 4, 6]
    assert seqs.kv_last_page_len.tolist() == [4, 16, 1]


def test_a_graphs_padding_sequences_are_one_token_decodes_or_empty():
    seqs = PagedSeqs.of(np.array([1]), np.array([17]), np.array([[3, 8]], dtype=np.int32), 16)
    decodes = seqs.padded(2, one_token=True)
    assert decodes.qo_indptr.tolist() == [0, 1, 2, 3] and decodes.kv_indptr.tolist() == [0, 2, 3, 4]
    assert decodes.kv_indices.tolist() == [3, 8, 0, 0] and decodes.kv_last_page_len.tolist() == [1, 1, 1]
    empty = seqs.padded(2, one_token=False)
    assert empty.qo_indptr.tolist() == [0, 1, 1, 1] and empty.kv_indptr.tolist() == [0, 2, 2, 2]
    assert empty.kv_indices.tolist() == [3, 8] and empty.kv_last_page_len.tolist() == [1, 0, 0]


# ------------------------------------------------------------------------------------------- a stand-in FlashInfer


class StandInWrapper:
    """FlashInfer's paged wrappers as their documentation states them, in float32 torch on any device: plan() takes
    the CSR page lists (held as planned; in CUDA-graph mode under the same constraints: the batch size fixed at
    construction, no more query rows than the first plan's, kv indices within the buffer), run() attends causally
    aligned to each sequence's end, a query at position p seeing keys [p - window_left, p], scores soft-capped."""

    decode = False

    def __init__(self, workspace, kv_layout, use_cuda_graph=False, use_tensor_cores=False, backend="auto", **buffers):
        assert kv_layout == "NHD" and backend == "fa2" and (use_tensor_cores or not self.decode)
        self.graph = use_cuda_graph
        self.buffers = buffers
        self.max_rows = None

    def plan(self, *args, **options):
        if self.decode:
            kv_indptr, indices, last, heads, kv_heads, head_dim, page = args
            qo_indptr = torch.arange(len(last) + 1)
        else:
            qo_indptr, kv_indptr, indices, last, heads, kv_heads, head_dim, page = args
            assert options["causal"]
        if self.graph:
            fixed = next(b for name, b in self.buffers.items() if "last_page_len" in name)
            indices_buffer = next(b for name, b in self.buffers.items() if "indices" in name)
            assert len(last) == len(fixed) and len(indices) <= len(indices_buffer)
            self.max_rows = int(qo_indptr[-1]) if self.max_rows is None else self.max_rows
            assert int(qo_indptr[-1]) <= self.max_rows
        self.seqs = [x.tolist() for x in (qo_indptr, kv_indptr, indices, last)]
        self.page, self.options = page, options

    def run(self, q, kv, out):
        k_cache, v_cache = kv
        qo_indptr, kv_indptr, indices, last = self.seqs
        if self.decode:
            assert q.shape[0] == len(last)
        window, cap, scale = (self.options[k] for k in ("window_left", "logits_soft_cap", "sm_scale"))
        for i in range(len(last)):
            pages = indices[kv_indptr[i] : kv_indptr[i + 1]]
            kv_len = (len(pages) - 1) * self.page + last[i] if pages else 0
            keys = k_cache[pages].flatten(0, 1)[:kv_len].float()
            values = v_cache[pages].flatten(0, 1)[:kv_len].float()
            group = q.shape[1] // keys.shape[1]
            keys, values = keys.repeat_interleave(group, 1), values.repeat_interleave(group, 1)
            rows = range(qo_indptr[i], qo_indptr[i + 1])
            for j, row in enumerate(rows):
                p = kv_len - len(rows) + j
                scores = torch.einsum("hd,nhd->hn", q[row].float(), keys[: p + 1]) * scale
                if cap:
                    scores = cap * torch.tanh(scores / cap)
                if window >= 0:
                    scores[:, : max(0, p - window)] = float("-inf")
                out[row] = torch.einsum("hn,nhd->hd", scores.softmax(-1), values[: p + 1]).to(out.dtype)


class StandInDecode(StandInWrapper):
    decode = True


@pytest.fixture
def stand_in_flashinfer(monkeypatch):
    """FlashInferAttention on a CPU: the stand-in wrappers, and index_copy_ for the Triton K/V store kernel."""
    from gpu_worker.attention import flashinfer_backend

    module = types.ModuleType("flashinfer")
    module.BatchPrefillWithPagedKVCacheWrapper = StandInWrapper
    module.BatchDecodeWithPagedKVCacheWrapper = StandInDecode
    monkeypatch.setitem(sys.modules, "flashinfer", module)

    def store_kv(k, v, k_cache, v_cache, slots):
        k_cache.view(-1, *k_cache.shape[2:]).index_copy_(0, slots.long(), k)
        v_cache.view(-1, *v_cache.shape[2:]).index_copy_(0, slots.long(), v)

    kernels = types.SimpleNamespace(store_kv=store_kv, DecodeSlices=lambda *fields: fields)
    monkeypatch.setattr(flashinfer_backend, "_triton_kernels", lambda: kernels)


def cpu_step(seqs, heads=4, kv_heads=2, head_dim=8, block_size=4, seed=0):
    """A step's layout over a shuffled pool of blocks (block 0 left to padding), its new tokens' slots, q/k/v
    views of one fused projection and random caches, in float32 on the CPU."""
    rng = random.Random(seed)
    contexts = [cached + new for cached, new in seqs]
    need = [-(-n // block_size) for n in contexts]
    pool = list(range(1, sum(need) + 3))
    rng.shuffle(pool)
    tables = [pool[sum(need[:i]) : sum(need[: i + 1])] for i in range(len(seqs))]
    layout = BatchLayout.build([new for _, new in seqs], contexts, tables, block_size)
    slots = []
    for (cached, new), table in zip(seqs, tables):
        slots += [table[p // block_size] * block_size + p % block_size for p in range(cached, cached + new)]
    gen = torch.Generator().manual_seed(seed)
    qkv = torch.randn(len(slots), heads + 2 * kv_heads, head_dim, generator=gen)
    cache = torch.randn(2, len(pool) + 1, block_size, kv_heads, head_dim, generator=gen)
    return layout, np.array(slots), qkv.split([heads, kv_heads, kv_heads], dim=1), cache


def reference(layout, slots, qkv, cache, scale, **options):
    backend = TorchAttention(cache.shape[2])
    k_cache, v_cache = cache.clone().unbind(0)
    metadata = backend.build_metadata(layout, slots, lambda values, dtype: torch.as_tensor(values, dtype=dtype))
    return backend.forward(*qkv, k_cache, v_cache, metadata, scale, **options), k_cache


def stand_in_backend(options, scale=0.3):
    from gpu_worker.attention.flashinfer_backend import FlashInferAttention

    layers = [LayerAttention(4, 2, 8, scale, options.get("sliding_window"), options.get("softcap"))]
    return FlashInferAttention(4, layers, torch.float32, torch.device("cpu"))


CPU_SEQS = [(0, 9), (6, 5), (13, 11), (0, 1), (3, 1), (21, 1), (8, 1)]  # (cached, new): chunks, then decodes
OPTIONS = [{}, {"sliding_window": 6}, {"softcap": 0.5}]


@pytest.mark.parametrize("options", OPTIONS, ids=["plain", "window", "softcap"])
def test_an_eager_step_plans_chunks_and_decodes_apart_and_attends_as_the_reference(stand_in_flashinfer, options):
    layout, slots, qkv, cache = cpu_step(CPU_SEQS)
    expected, expected_store = reference(layout, slots, qkv, cache, 0.3, **options)
    backend = stand_in_backend(options)
    k_cache, v_cache = cache.clone().unbind(0)
    metadata = backend.build_metadata(layout, slots, lambda values, dtype: torch.as_tensor(values, dtype=dtype))
    assert (metadata.prefill_rows, metadata.decode_first, metadata.decode_count) == (25, 25, 4)
    out = backend.forward(*qkv, k_cache, v_cache, metadata, 0.3, **options)
    torch.testing.assert_close(out, expected)
    assert torch.equal(k_cache, expected_store)


def graph_buffers(tokens: int, seqs: int, slots: np.ndarray, decode_only: bool):
    """A graph's static attention buffers as the graph classes make them, only the slots filled (the rest is
    the Triton kernels'): padding tokens write slot 0 (block 0)."""
    from gpu_worker.attention.base import StaticAttentionBuffers

    slot_mapping = torch.zeros(tokens, dtype=torch.int32)
    slot_mapping[: len(slots)] = torch.as_tensor(slots)
    unused = torch.zeros(0, dtype=torch.int32)
    return StaticAttentionBuffers(
        slot_mapping, torch.zeros(seqs, dtype=torch.int32), unused, unused.view(2, 0), unused, unused, unused,
        unused.view(0, 0), seqs, padding_outside_sequences=not decode_only, decode_only=decode_only,
    )  # fmt: skip


@pytest.mark.parametrize("options", OPTIONS, ids=["plain", "window", "softcap"])
def test_a_decode_graph_replans_each_step_padded_to_its_batch(stand_in_flashinfer, options):
    decodes = [(0, 1), (3, 1), (21, 1), (8, 1), (40, 1)]
    layout, slots, (q, k, v), cache = cpu_step(decodes)
    expected, _ = reference(layout, slots, (q, k, v), cache, 0.3, **options)
    backend = stand_in_backend(options)
    metadata = backend.static_metadata(graph_buffers(8, 8, slots, decode_only=True), max_context=64)
    backend.prepare_replay(metadata, layout)
    padded = [torch.cat([x, torch.zeros(3, *x.shape[1:])]) for x in (q, k, v)]  # the graph's 8 rows
    out = backend.forward(*padded, *cache.clone().unbind(0), metadata, 0.3, **options)
    torch.testing.assert_close(out[:5], expected)


@pytest.mark.parametrize("options", OPTIONS, ids=["plain", "window", "softcap"])
def test_a_mixed_graph_replans_each_step_over_every_sequence_and_zeros_its_padding(stand_in_flashinfer, options):
    layout, slots, (q, k, v), cache = cpu_step(CPU_SEQS)
    expected, _ = reference(layout, slots, (q, k, v), cache, 0.3, **options)
    backend = stand_in_backend(options)
    metadata = backend.static_metadata(graph_buffers(48, 8, slots, decode_only=False), max_context=64)
    backend.prepare_replay(metadata, layout)
    padded = [torch.cat([x, torch.randn(48 - len(x), *x.shape[1:])]) for x in (q, k, v)]
    out = backend.forward(*padded, *cache.clone().unbind(0), metadata, 0.3, **options)
    torch.testing.assert_close(out[:29], expected)
    assert not out[29:].any()


def test_a_layer_runs_the_plan_of_its_own_window_and_soft_cap(stand_in_flashinfer):
    """Gemma 2: sliding and global layers alternate; each forward plans both and each layer runs its own."""
    from gpu_worker.attention.flashinfer_backend import FlashInferAttention

    layers = [LayerAttention(4, 2, 8, 0.3, 6, 0.5), LayerAttention(4, 2, 8, 0.3, None, 0.5)]
    backend = FlashInferAttention(4, layers, torch.float32, torch.device("cpu"))
    layout, slots, qkv, cache = cpu_step(CPU_SEQS)
    metadata = backend.build_metadata(layout, slots, lambda values, dtype: torch.as_tensor(values, dtype=dtype))
    for window in (6, None):
        expected, _ = reference(layout, slots, qkv, cache, 0.3, sliding_window=window, softcap=0.5)
        out = backend.forward(*qkv, *cache.clone().unbind(0), metadata, 0.3, sliding_window=window, softcap=0.5)
        torch.testing.assert_close(out, expected)


# ------------------------------------------------------------------------------------------- on a GPU

needs_flashinfer = pytest.mark.skipif(
    not torch.cuda.is_available() or import_problem() is not None,
    reason="needs a CUDA device and flashinfer importable: "
    + ("no CUDA device" if not torch.cuda.is_available() else str(import_problem())),
)
SEQS = [(0, 37), (40, 17), (300, 64), (0, 1), (5, 1), (700, 1), (33, 1)]  # (cached, new): chunks, then decodes


def random_step(seqs, heads, kv_heads, head_dim, block_size=16, seed=0):
    """A step's layout over a shuffled pool of blocks, its new tokens' slots, random q/k/v (views of one fused
    projection, as the models pass them) and random caches."""
    rng = random.Random(seed)
    contexts = [cached + new for cached, new in seqs]
    need = [-(-n // block_size) for n in contexts]
    pool = list(range(sum(need) + 3))
    rng.shuffle(pool)
    tables = [pool[sum(need[:i]) : sum(need[: i + 1])] for i in range(len(seqs))]
    layout = BatchLayout.build([new for _, new in seqs], contexts, tables, block_size)
    slots = []
    for (cached, new), table in zip(seqs, tables):
        slots += [table[p // block_size] * block_size + p % block_size for p in range(cached, cached + new)]
    gen = torch.Generator("cuda").manual_seed(seed)
    qkv = torch.randn(len(slots), heads + 2 * kv_heads, head_dim, generator=gen, device="cuda").bfloat16()
    cache = torch.randn(2, len(pool), block_size, kv_heads, head_dim, generator=gen, device="cuda").bfloat16()
    return layout, np.array(slots), qkv.split([heads, kv_heads, kv_heads], dim=1), cache


@needs_flashinfer
@pytest.mark.parametrize(
    "heads, kv_heads, head_dim, window, softcap",
    [(4, 1, 64, None, None), (4, 1, 64, 24, None), (4, 1, 64, None, 2.0), (32, 8, 128, None, None)],
)
def test_attention_matches_the_torch_reference(heads, kv_heads, head_dim, window, softcap):
    """An eager step: prompt chunks (some after cached context) through the prefill wrapper, decodes through the
    decode one, on the KV store in place; the new K/V land in the store."""
    from gpu_worker.attention.flashinfer_backend import FlashInferAttention
    from gpu_worker.host_copy import StagingRing

    scale = head_dim**-0.5
    layers = [LayerAttention(heads, kv_heads, head_dim, scale, window, softcap)]
    layout, slots, (q, k, v), cache = random_step(SEQS, heads, kv_heads, head_dim)
    staging = StagingRing(torch.device("cuda"), 1 << 20)
    outs = {}
    for name, backend in [
        ("reference", TorchAttention(16)),
        ("flashinfer", FlashInferAttention(16, layers, torch.bfloat16, torch.device("cuda"))),
    ]:
        staging.next_step()
        k_cache, v_cache = cache.clone().unbind(0)
        metadata = backend.build_metadata(layout, slots, staging.upload)
        outs[name] = backend.forward(
            q, k, v, k_cache, v_cache, metadata, scale, sliding_window=window, softcap=softcap
        ).float()
        outs[name + " store"] = k_cache
    reference, ours = outs["reference"], outs["flashinfer"]
    assert ((ours - reference).norm() / reference.norm()).item() < 1e-2
    assert torch.equal(outs["flashinfer store"], outs["reference store"])


def greedy_tokens(folder, backend: str, enforce_eager: bool) -> list[list[int]]:
    """Greedy tokens of a batch decoding while prompts of many lengths arrive (prefill alone, beside decodes,
    chunked): decode and mixed steps, replayed from graphs unless enforce_eager."""
    from common.sampling_params import SamplingParams
    from offline import LLM
    from tests.tiny_models import random_prompts

    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    config = dict(device="cuda", dtype="bfloat16", max_num_seqs=8, max_num_batched_tokens=128)
    with LLM(str(folder), attention_backend=backend, enforce_eager=enforce_eager, **config) as llm:
        assert type(llm.runner.attention).__name__ == {"triton": "TritonAttention"}.get(backend, "FlashInferAttention")
        assert (llm.runner.graphs is None) == enforce_eager
        rids, outputs = [], {}
        lengths = iter([3, 300, 5, 9, 70, 17, 2, 33, 129, 4, 64, 40])
        for arrivals in (1, 2, 3, 1, 2, 3):
            for prompt in random_prompts(arrivals, [next(lengths) for _ in range(arrivals)], vocab=512, seed=arrivals):
                rids.append(llm.add_request(prompt, params))
            for _ in range(3):
                batch = llm.step()
                for rid, token in zip(batch.rids, batch.token_ids) if batch is not None else ():
                    outputs.setdefault(rid, []).append(token)
        while llm.scheduler.has_unfinished():
            batch = llm.step()
            for rid, token in zip(batch.rids, batch.token_ids) if batch is not None else ():
                outputs.setdefault(rid, []).append(token)
    return [outputs[rid] for rid in rids]


@needs_flashinfer
@pytest.mark.parametrize("kind", ["llama", "mistral", "gemma2"])  # plain; a sliding window; soft-caps, two windows
@pytest.mark.parametrize("enforce_eager", [False, True], ids=["graphs", "eager"])
def test_greedy_tokens_follow_the_triton_backend_in_bfloat16(kind, enforce_eager, tmp_path):
    """Both backends read the same KV store in bf16 with float32 softmax; they differ in rounding only, which can
    flip a near-tie now and then, and a flipped token changes the rest of its request. So: each request's tokens
    and Triton's share a long common start (3/4 of them on average; a wrong mask or page shares almost none)."""
    from tests.tiny_models import build_model

    folder = build_model(kind, tmp_path / kind, head_dim=64)  # a head size FlashInfer runs
    theirs = greedy_tokens(folder, "triton", enforce_eager)
    ours = greedy_tokens(folder, "flashinfer", enforce_eager)
    common = [next((i for i, (a, b) in enumerate(zip(x, y)) if a != b), len(x)) for x, y in zip(ours, theirs)]
    assert sum(common) >= 0.75 * sum(len(t) for t in theirs), (common, ours, theirs)
