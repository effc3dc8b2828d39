"""Attention through FlashInfer's paged kernels (flashinfer-python 0.7.2), reading our KV store in place.

A layer's store is K [num_blocks, block_size, Hkv, D] and V alike (kv_cache.py): FlashInfer's "NHD" layout,
handed over as a (k, v) pair. Where our kernels read block tables, FlashInfer reads each sequence's blocks in
CSR form (PagedSeqs), and its kernels are driven by a plan made on the host once per forward (plan(): which
tile computes what, copied to a workspace on the device) that every layer's run() reads:

    qo_indptr [S + 1]   each sequence's first query row in q         kv_indptr [S + 1]   its first entry in:
    kv_indices          the sequences' blocks, one after another     kv_last_page_len [S] tokens in its last block

Two wrappers, both on FlashInfer's FA2 kernels:
    BatchPrefillWithPagedKVCacheWrapper   causal; the prompt chunks of an eager step, and every sequence of a
                                          mixed graph's step (its decodes are one-query sequences)
    BatchDecodeWithPagedKVCacheWrapper    the decodes, tensor cores (a KV head's query group is one tile)
FA2 for both: the tensor-core decode is FA2's prefill kernel, so one JIT module per layer option serves every
step (FlashInfer compiles at first use: warm-up pays it, builder.py); FA3 (Hopper) would schedule each query
head apart, reading a GQA group's keys once per head for every decode of a mixed step.

A plan fixes a layer's options (sliding window, soft-cap, scale): a forward plans once per distinct option set
among the model's layers (a Variant) and each layer runs its own.

CUDA graphs: a wrapper per graph (FlashInfer fixes its batch size and the buffers its kernels read), planned
before each replay (prepare_replay), outside the capture. A decode graph's padding rows are one-token sequences
over block 0 (read only; their outputs are dropped); a mixed graph's sequences past the step's are empty, its
padding tokens in none (their outputs zeros). A mixed graph plans without split-KV, whose partials would need a
workspace sized for the graph's largest step (about 550 MB for a 16k-token step of Llama-3-8B).

plan() copies host memory to the device asynchronously (our index arrays; its own plan, from a pinned buffer it
reuses): with steps launched ahead (common/pipeline.py), each such buffer is a ring a step in flight deep.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from common.pipeline import host_ring_size
from gpu_worker.attention.base import AttentionBackend, BatchLayout, LayerAttention, StaticAttentionBuffers, Upload

FLOAT_WORKSPACE_BYTES = 256 * 2**20  # split-KV partials of decodes and eager prefills (vLLM's default size)
INT_WORKSPACE_BYTES = 8 * 2**20  # a plan; FlashInfer's own default
KERNELS = "fa2"
SUPPORTED_HEAD_DIMS = (64, 128, 256)  # what FlashInfer's FA2 kernels are built and tested for
SUPPORTED_DTYPES = (torch.float16, torch.bfloat16)

if TYPE_CHECKING:
    from gpu_worker.attention.triton_kernels import DecodeSlices

# A layer's options as forward receives them: (sliding_window, softcap, scale).
Variant = tuple[int | None, float | None, float]


def import_problem() -> str | None:
    """Why FlashInfer cannot be used in this process, or None. Imports it (the only place that does)."""
    try:
        import flashinfer  # noqa: F401
    except Exception as exc:  # not installed, or its import fails here (no CUDA toolkit, a torch it was not built for)
        return f"flashinfer is not importable ({type(exc).__name__}: {exc})"
    return None


def model_problem(layers: list[LayerAttention], dtype: torch.dtype) -> str | None:
    """Why FlashInfer cannot run this model's attention, or None. Sliding windows and soft-caps it runs."""
    if dtype not in SUPPORTED_DTYPES:
        return f"FlashInfer runs float16 and bfloat16, not {dtype}"
    shapes = {(layer.num_heads, layer.num_kv_heads, layer.head_dim) for layer in layers}
    if len(shapes) != 1:
        return f"layers of different head shapes {sorted(shapes)}"
    head_dim = layers[0].head_dim
    if head_dim not in SUPPORTED_HEAD_DIMS:
        return f"head_dim {head_dim} (FlashInfer: {', '.join(map(str, SUPPORTED_HEAD_DIMS))})"
    return None


@dataclass(slots=True)
class PagedSeqs:
    """Sequences in FlashInfer's CSR form, on the host (int32)."""

    qo_indptr: np.ndarray  # [S + 1]
    kv_indptr: np.ndarray  # [S + 1]
    kv_indices: np.ndarray  # [kv_indptr[-1]]
    kv_last_page_len: np.ndarray  # [S], 1..block_size (0 for a sequence without keys)

    @classmethod
    def of(
        cls, query_lens: np.ndarray, context_lens: np.ndarray, block_table: np.ndarray, block_size: int
    ) -> PagedSeqs:
        """block_table [S, >= blocks of the longest context]: each row's first blocks are its context's."""
        contexts = np.asarray(context_lens, dtype=np.int64)
        pages = -(-contexts // block_size)
        used = np.arange(block_table.shape[1]) < pages[:, None]
        return cls(
            _offsets(query_lens),
            _offsets(pages),
            block_table[used].astype(np.int32),  # row by row: each sequence's blocks in order
            np.where(pages > 0, contexts - (pages - 1) * block_size, 0).astype(np.int32),
        )

    def padded(self, count: int, one_token: bool) -> PagedSeqs:
        """`count` sequences more: one query over one key in block 0 each (one_token), else no query and no key."""
        if not count:
            return self
        n = int(one_token)
        return PagedSeqs(
            np.concatenate([self.qo_indptr, self.qo_indptr[-1] + n * np.arange(1, count + 1, dtype=np.int32)]),
            np.concatenate([self.kv_indptr, self.kv_indptr[-1] + n * np.arange(1, count + 1, dtype=np.int32)]),
            np.concatenate([self.kv_indices, np.zeros(n * count, dtype=np.int32)]),
            np.concatenate([self.kv_last_page_len, np.full(count, n, dtype=np.int32)]),
        )


def _triton_kernels() -> Any:
    """Our K/V store kernel (FlashInfer reads the store, the layers write it), imported when the backend is made,
    as flashinfer is: choosing a backend (model_problem, import_problem) imports this module on any machine."""
    from gpu_worker.attention import triton_kernels

    return triton_kernels


def _offsets(lengths: np.ndarray) -> np.ndarray:
    out = np.zeros(len(lengths) + 1, dtype=np.int32)
    np.cumsum(lengths, out=out[1:])
    return out


@dataclass(slots=True)
class GraphShape:
    """A graph's fixed sizes, which every replay's plan pads to."""

    seqs: int
    tokens: int


@dataclass(slots=True)
class FlashInferMetadata:
    slot_mapping: torch.Tensor  # [T] int32, each new token's KV slot
    # Rows [0, prefill_rows) of q run through the prefill wrappers, rows [decode_first, + decode_count) through
    # the decode ones (a role without wrappers has none).
    prefill: dict[Variant, Any]
    prefill_rows: int
    decode: dict[Variant, Any]
    decode_first: int
    decode_count: int
    zero_padding: bool  # whether rows outside every sequence (a mixed graph's padding) get zeros
    graph: GraphShape | None = None  # a graph's (static_metadata): what prepare_replay pads each step to


class _HostStaging:
    """The index arrays a forward's plans read: pinned host memory (a ring: a step in flight's copies are
    queued, not done) and, for kv_indices, which the plans take from the device (from the host they would wait
    for it), one device buffer rewritten each step after the previous step's kernels in stream order."""

    def __init__(self, device: torch.device):
        self.device = device
        self._pinned = device.type == "cuda"  # (a CPU, in tests: plain memory)
        self._slots = [torch.empty(0, dtype=torch.int32) for _ in range(host_ring_size())]
        self._arrays = [slot.numpy() for slot in self._slots]  # the same memory, written with numpy (cheaper)
        self._turn = 0
        self._offset = 0
        self._device_indices = torch.empty(0, dtype=torch.int32, device=device)
        self._device_offset = 0

    def next_step(self) -> None:
        self._turn = (self._turn + 1) % len(self._slots)
        self._offset = 0
        self._device_offset = 0

    def host(self, array: np.ndarray) -> torch.Tensor:
        """A pinned copy of `array` (int32), valid until this slot comes round again."""
        end = self._offset + len(array)
        slot = self._slots[self._turn]
        if end > len(slot):
            # A larger slot; the old one's pending copies keep it alive (torch's pinned allocator tracks them).
            slot = torch.empty(max(2 * end, 4096), dtype=torch.int32, pin_memory=self._pinned)
            self._slots[self._turn], self._arrays[self._turn] = slot, slot.numpy()
        self._arrays[self._turn][self._offset : end] = array
        view = slot[self._offset : end]
        self._offset = end
        return view

    def device_indices(self, indices: np.ndarray) -> torch.Tensor:
        end = self._device_offset + len(indices)
        if end > len(self._device_indices):
            self._device_indices = torch.empty(max(2 * end, 4096), dtype=torch.int32, device=self.device)
        view = self._device_indices[self._device_offset : end]
        view.copy_(self.host(indices), non_blocking=True)
        self._device_offset = end
        return view


class _Workspaces:
    """The device memory the wrappers plan into and run from. One float workspace for every wrapper (a forward's
    launches run one after another). A plan's int workspace per role and variant, shared by that role's wrappers
    of every graph: a step plans each (role, variant) once and replays one graph. plan() fills it by an
    asynchronous copy from a pinned buffer, a ring of them per (role, variant)."""

    def __init__(self, device: torch.device, keys: list[tuple[str, Variant]]):
        self.float = torch.zeros(FLOAT_WORKSPACE_BYTES, dtype=torch.uint8, device=device)  # zeros: FlashInfer asks
        self._int = {key: torch.zeros(INT_WORKSPACE_BYTES, dtype=torch.uint8, device=device) for key in keys}
        pinned = device.type == "cuda"
        self._pinned = {
            key: [
                torch.zeros(INT_WORKSPACE_BYTES, dtype=torch.uint8, pin_memory=pinned) for _ in range(host_ring_size())
            ]
            for key in keys
        }
        self._turn = dict.fromkeys(keys, 0)

    def adopt(self, wrapper: Any, key: tuple[str, Variant]) -> None:
        # Private attributes of FlashInfer 0.7.2's wrappers: reset_workspace_buffer() would allocate pinned memory
        # anew each time, and per wrapper, 8 MiB of each per graph.
        wrapper._int_workspace_buffer = self._int[key]

    def before_plan(self, wrapper: Any, key: tuple[str, Variant]) -> None:
        ring = self._pinned[key]
        self._turn[key] = (self._turn[key] + 1) % len(ring)
        wrapper._pin_memory_int_workspace_buffer = ring[self._turn[key]]


@dataclass(slots=True)
class _Shapes:
    num_heads: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype
    block_size: int
    variants: list[Variant] = field(default_factory=list)


class FlashInferAttention(AttentionBackend):
    supports_cuda_graphs = True

    def __init__(self, block_size: int, layers: list[LayerAttention], dtype: torch.dtype, device: torch.device):
        """layers: the model's (model_problem(layers, dtype) must be None); device: a CUDA one."""
        super().__init__(block_size)
        import flashinfer

        self._flashinfer = flashinfer
        self._kernels = _triton_kernels()
        first = layers[0]
        variants = sorted({(la.sliding_window, la.softcap, la.scale) for la in layers}, key=repr)
        self.shapes = _Shapes(first.num_heads, first.num_kv_heads, first.head_dim, dtype, block_size, variants)
        self.device = device
        roles = ("prefill", "decode")
        self.workspaces = _Workspaces(device, [(role, v) for role in roles for v in variants])
        self.staging = _HostStaging(device)
        self._eager = {role: {v: self._wrapper(role, v, None, None) for v in variants} for role in roles}
        self._graph_indices = torch.empty(0, dtype=torch.int32, device=device)

    # --------------------------------------------------------------------------------------- wrappers and plans

    def _wrapper(self, role: str, variant: Variant, graph: GraphShape | None, indices: torch.Tensor | None) -> Any:
        """A wrapper of `role` for eager steps (graph None) or for a graph's steps (its own fixed buffers, the
        graphs' shared kv_indices)."""
        fi, ws = self._flashinfer, self.workspaces.float
        if role == "decode":
            if graph is None:
                wrapper = fi.BatchDecodeWithPagedKVCacheWrapper(ws, "NHD", use_tensor_cores=True, backend=KERNELS)
            else:
                wrapper = fi.BatchDecodeWithPagedKVCacheWrapper(
                    ws,
                    "NHD",
                    use_cuda_graph=True,
                    use_tensor_cores=True,
                    paged_kv_indptr_buffer=self._int32(graph.seqs + 1),
                    paged_kv_indices_buffer=indices,
                    paged_kv_last_page_len_buffer=self._int32(graph.seqs),
                    backend=KERNELS,
                )
        elif graph is None:
            wrapper = fi.BatchPrefillWithPagedKVCacheWrapper(ws, "NHD", backend=KERNELS)
        else:
            wrapper = fi.BatchPrefillWithPagedKVCacheWrapper(
                ws,
                "NHD",
                use_cuda_graph=True,
                qo_indptr_buf=self._int32(graph.seqs + 1),
                paged_kv_indptr_buf=self._int32(graph.seqs + 1),
                paged_kv_indices_buf=indices,
                paged_kv_last_page_len_buf=self._int32(graph.seqs),
                backend=KERNELS,
            )
        self.workspaces.adopt(wrapper, (role, variant))
        return wrapper

    def _int32(self, n: int) -> torch.Tensor:
        return torch.zeros(n, dtype=torch.int32, device=self.device)

    def _plan(self, role: str, wrappers: dict[Variant, Any], seqs: PagedSeqs, split_kv: bool = True) -> None:
        """Plan every variant's wrapper of `role` for `seqs` (staged in this step's slot)."""
        s = self.shapes
        kv_indptr = self.staging.host(seqs.kv_indptr)
        last_page_len = self.staging.host(seqs.kv_last_page_len)
        indices = self.staging.device_indices(seqs.kv_indices)
        qo_indptr = self.staging.host(seqs.qo_indptr) if role == "prefill" else None
        for (window, softcap, scale), wrapper in wrappers.items():
            options = dict(
                window_left=window - 1 if window else -1,  # FlashInfer's window counts the keys before the query
                logits_soft_cap=softcap or 0.0,
                sm_scale=scale,
                q_data_type=s.dtype,
                kv_data_type=s.dtype,
                non_blocking=True,
            )
            self.workspaces.before_plan(wrapper, (role, (window, softcap, scale)))
            if role == "decode":
                wrapper.plan(
                    kv_indptr,
                    indices,
                    last_page_len,
                    s.num_heads,
                    s.num_kv_heads,
                    s.head_dim,
                    s.block_size,
                    **options,
                )
            else:
                wrapper.plan(
                    qo_indptr,
                    kv_indptr,
                    indices,
                    last_page_len,
                    s.num_heads,
                    s.num_kv_heads,
                    s.head_dim,
                    s.block_size,
                    causal=True,
                    disable_split_kv=not split_kv,
                    **options,
                )

    # --------------------------------------------------------------------------------------- eager steps

    def build_metadata(self, layout: BatchLayout, slot_mapping: np.ndarray, upload: Upload) -> FlashInferMetadata:
        num_pre, num_seqs = layout.num_prefill_seqs, len(layout.query_lens)
        prefill_rows = int(layout.query_lens[:num_pre].sum())
        self.staging.next_step()
        for role, rows in (("prefill", slice(0, num_pre)), ("decode", slice(num_pre, num_seqs))):
            if rows.stop > rows.start:
                seqs = PagedSeqs.of(
                    layout.query_lens[rows], layout.context_lens[rows], layout.block_table[rows], self.block_size
                )
                self._plan(role, self._eager[role], seqs)
        return FlashInferMetadata(
            slot_mapping=upload(slot_mapping, torch.int32),
            prefill=self._eager["prefill"] if num_pre else {},
            prefill_rows=prefill_rows,
            decode=self._eager["decode"] if num_pre < num_seqs else {},
            decode_first=prefill_rows,
            decode_count=num_seqs - num_pre,
            zero_padding=False,
        )

    # --------------------------------------------------------------------------------------- CUDA graphs

    def decode_slice_capacity(self, decode_programs: int) -> int:
        return 0  # the graphs' Triton decode-slice fields: unused here

    def decode_slices(self, context_lens: np.ndarray, capacity: int | None = None) -> DecodeSlices:
        return self._kernels.DecodeSlices(
            0, np.zeros(0, dtype=np.int32), np.zeros(len(context_lens) + 1, dtype=np.int32)
        )

    def static_metadata(self, buffers: StaticAttentionBuffers, max_context: int) -> FlashInferMetadata:
        """The graph's wrappers, planned once for a step of padding alone: the first plan of a graph's prefill
        wrapper fixes the most query rows its replays may plan, so it holds every token of the graph."""
        graph = GraphShape(seqs=buffers.context_lens.shape[0], tokens=buffers.slot_mapping.shape[0])
        pages = max(graph.seqs * -(-max_context // self.block_size), -(-graph.tokens // self.block_size))
        if len(self._graph_indices) < pages:  # graphs are captured largest first: usually one buffer for all
            self._graph_indices = torch.zeros(pages, dtype=torch.int32, device=self.device)
        role = "decode" if buffers.decode_only else "prefill"
        wrappers = {v: self._wrapper(role, v, graph, self._graph_indices) for v in self.shapes.variants}
        metadata = FlashInferMetadata(
            slot_mapping=buffers.slot_mapping,
            prefill={} if buffers.decode_only else wrappers,
            prefill_rows=0 if buffers.decode_only else graph.tokens,
            decode=wrappers if buffers.decode_only else {},
            decode_first=0,
            decode_count=graph.seqs if buffers.decode_only else 0,
            zero_padding=buffers.padding_outside_sequences,
            graph=graph,
        )
        self.staging.next_step()
        if buffers.decode_only:
            self._plan("decode", wrappers, _NO_SEQS.padded(graph.seqs, one_token=True))
        else:
            pages_all = -(-graph.tokens // self.block_size)
            every_token = PagedSeqs(
                np.array([0, graph.tokens], dtype=np.int32),
                np.array([0, pages_all], dtype=np.int32),
                np.zeros(pages_all, dtype=np.int32),
                np.array([graph.tokens - (pages_all - 1) * self.block_size], dtype=np.int32),
            )
            self._plan("prefill", wrappers, every_token.padded(graph.seqs - 1, one_token=False), split_kv=False)
        if self.device.type == "cuda":
            # Graphs are captured one after another with no step finishing in between: without this wait, a later
            # graph's plans could reuse this plan's pinned buffers before their copies ran (the runner's steps
            # keep the rings' discipline, start-up does not).
            torch.cuda.synchronize(self.device)
        return metadata

    def prepare_replay(self, metadata: FlashInferMetadata, layout: BatchLayout) -> None:
        graph = metadata.graph
        assert graph is not None, "prepare_replay takes a graph's metadata (static_metadata)"
        seqs = PagedSeqs.of(layout.query_lens, layout.context_lens, layout.block_table, self.block_size)
        padding = graph.seqs - len(layout.query_lens)
        self.staging.next_step()
        if metadata.decode:
            self._plan("decode", metadata.decode, seqs.padded(padding, one_token=True))
        else:
            self._plan("prefill", metadata.prefill, seqs.padded(padding, one_token=False), split_kv=False)

    # --------------------------------------------------------------------------------------- every layer

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        metadata: FlashInferMetadata,
        scale: float,
        *,
        sliding_window: int | None = None,
        softcap: float | None = None,
        kv_scales: tuple[float, float] = (1.0, 1.0),
    ) -> torch.Tensor:
        # kv_scales: an fp8 store is never read by this backend (choose_attention_backend picks Triton for it).
        self._kernels.store_kv(k, v, k_cache, v_cache, metadata.slot_mapping)
        new = torch.zeros if metadata.zero_padding else torch.empty
        out = new(q.shape, dtype=q.dtype, device=q.device)
        variant = (sliding_window or None, softcap or None, scale)
        if metadata.prefill:
            rows = metadata.prefill_rows
            metadata.prefill[variant].run(q[:rows], (k_cache, v_cache), out=out[:rows])
        if metadata.decode:
            rows = slice(metadata.decode_first, metadata.decode_first + metadata.decode_count)
            metadata.decode[variant].run(q[rows], (k_cache, v_cache), out=out[rows])
        return out


_NO_SEQS = PagedSeqs(np.zeros(1, np.int32), np.zeros(1, np.int32), np.zeros(0, np.int32), np.zeros(0, np.int32))
