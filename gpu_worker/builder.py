"""The GPU worker, built once, then run (model_runner.py): everything a step uses is decided and allocated here.

    device ─▶ model (weights) ─▶ [fp8 KV scales (kv_scales.py)] ─▶ KV store (kv_sizing.py) ─▶ limits (limits.py)
           ─▶ CUDA graphs ─▶ staging ─▶ warm-up

The KV store is sized before the limits are decided (the seats depend on what it holds), and the graphs are
captured after it (their memory pool is what the sizing left room for).
"""

from __future__ import annotations

import logging
import math

import torch

from common.config import EngineConfig
from common.messages import WorkerLimits
from common.model_info import ModelInfo
from common.pipeline import max_live_mirrors
from common.sampling_params import MAX_LOGIT_BIAS, MAX_STOP_TOKEN_IDS
from common.startup import PhaseClock
from gpu_worker.attention import AttentionBackend, choose_attention_backend, make_attention_backend
from gpu_worker.cuda_graphs import DecodeGraphs
from gpu_worker.eager_forward import EagerForward
from gpu_worker.graph_capture import StepGraphs
from gpu_worker.host_copy import StagingRing
from gpu_worker.kv_cache import FP8, PagedKVCache, resolve_kv_cache_dtype
from gpu_worker.kv_scales import calibrate_kv_scales
from gpu_worker.kv_sizing import size_kv_store
from gpu_worker.limits import decide_limits, most_seats, prompt_budget
from gpu_worker.model_loader import load_model, resolve_dtype
from gpu_worker.model_runner import ModelRunner
from gpu_worker.parallel import SINGLE, TensorParallel
from gpu_worker.request_mirrors import RequestMirrors
from gpu_worker.warm_up import WARM_UP_REQUESTS, warm_up

log = logging.getLogger(__name__)


def build_worker(
    config: EngineConfig,
    info: ModelInfo,
    phases: PhaseClock | None = None,
    tp: TensorParallel = SINGLE,
    device_index: int = 0,
) -> ModelRunner:
    """A runner ready for the first plan: warmed up (warm_up.py), so no request pays for a kernel compile.
    `phases`: log each start-up phase (weights, KV store, CUDA graphs, warm-up) there, with a progress bar for
    the weights (the server's worker); None: quiet (tests, the offline engine). `tp`: the runner is one rank of
    a tensor-parallel group (gpu_worker/parallel.py): it holds that rank's share of the weights and of the KV
    heads, and runs every plan in step with the other ranks. `device_index`: the GPU to run on (an engine
    replica's rank's own: gpu_worker/process.py)."""
    device = resolve_device(config.device, device_index)
    on_gpu = device.type == "cuda"
    dtype = resolve_dtype(config.dtype, device)
    # On CUDA the models' elementwise ops are fused Triton kernels whichever kernels attend; the torch
    # backend is the reference throughout.
    model = load_model(
        config.model,
        config.load_format,
        dtype,
        device,
        config.seed,
        progress=phases is not None,
        fused_kernels=on_gpu and config.attention_backend != "torch",
        tp=tp,
        quantization=config.quantization,
    )
    if phases is not None:
        params = sum(p.numel() for p in model.parameters())
        what = "random weights" if config.load_format == "dummy" else "weights loaded"
        phases.done(f"{what}: {params / 1e6:.0f}M parameters, {dtype} on {device}")
    num_layers, kv_heads, head_dim = model.kv_shape  # this rank's KV heads
    kv_dtype = resolve_kv_cache_dtype(config.kv_cache_dtype, dtype)
    choice = choose_attention_backend(
        config.attention_backend, device.type, model.attention_layers, dtype, kv_cache_dtype=config.kv_cache_dtype
    )
    log.info("attention backend: %s (%s)", choice.name, choice.reason)
    attention = make_attention_backend(choice.name, device, config.block_size, model.attention_layers, dtype)
    kv_scales = None
    if kv_dtype == FP8:
        check_fp8_kv_supported(choice.name, device)
        kv_scales = calibrate_kv_scales(
            model, attention, info.vocab_size, info.max_model_len, config.block_size, dtype, device
        )
    captures_graphs = on_gpu and attention.supports_cuda_graphs and not config.enforce_eager
    # Every rank must have every block the scheduler hands out: the smallest store of any rank.
    num_kv_blocks = tp.min(
        config.num_kv_blocks
        or size_kv_store(
            config,
            info,
            model,
            attention,
            device,
            kv_dtype,
            kv_scales,
            most_seats(config, on_gpu),
            prompt_budget(config, on_gpu),
            captures_graphs,
        ),
        device,
    )
    limits = decide_limits(config, info, on_gpu, num_kv_blocks)
    # One block more than the scheduler is told of: a scratch block for padding rows (graphs, padded eager steps).
    kv_cache = PagedKVCache(
        num_layers, num_kv_blocks + 1, config.block_size, kv_heads, head_dim, kv_dtype, device, kv_scales
    )
    if phases is not None:
        gib = kv_cache.data.numel() * kv_cache.data.element_size() / 2**30
        what = f"{num_kv_blocks} blocks of {config.block_size} tokens, {gib:.2f} GiB"
        if kv_scales is not None:
            exponents = [int(math.log2(s)) for pair in kv_scales for s in pair]
            what += f", float8 e4m3 (scales 2^{min(exponents)} to 2^{max(exponents)})"
        phases.done(f"KV store: {what}")
    # A slot per live mirror (seated or finishing: common/pipeline.py), and warm-up's requests.
    num_slots = max(max_live_mirrors(limits.max_num_seqs), WARM_UP_REQUESTS)
    last_tokens = torch.zeros(num_slots + 1, dtype=torch.long, device=device)  # + a sink for rows sampling nothing
    graphs = None
    if captures_graphs:
        graphs = capture_graphs(model, attention, kv_cache, limits, info, last_tokens)
        if phases is not None:
            mixed, decode = graphs.mixed.buckets, graphs.decode.buckets
            phases.done(
                f"CUDA graphs captured: {len(mixed)} for steps of {mixed[0]}-{mixed[-1]} tokens, "
                f"{len(decode)} for decode batches of {decode[0]}-{decode[-1]}"
            )
    table_width = -(-info.max_model_len // config.block_size)
    staging = StagingRing(device, staging_bytes(limits, info, table_width))
    runner = ModelRunner(
        info,
        limits,
        model,
        attention,
        RequestMirrors(num_slots, table_width, config.block_size, model.vocab_size, device),
        last_tokens,
        staging,
        EagerForward(model, attention, kv_cache, staging, last_tokens, scratch_block=num_kv_blocks),
        graphs,
        dtype,
    )
    warm_up(runner, config.block_size)  # every rank runs the same warm-up plans: their collectives pair up
    if phases is not None:
        phases.done("warmed up: every kind of step ran once")
    return runner


def check_fp8_kv_supported(backend: str, device: torch.device) -> None:
    """Triton converts to and from float8 e4m3 on GPUs of compute capability 8.9 or more (Ada, Hopper)."""
    if backend == "triton" and torch.cuda.get_device_capability(device) < (8, 9):
        name = torch.cuda.get_device_name(device)
        raise RuntimeError(
            f"--kv-cache-dtype fp8 with the Triton attention backend needs a GPU of compute capability 8.9 or more; "
            f"{name} has {torch.cuda.get_device_capability(device)} (--attention-backend torch runs it anywhere)"
        )


def resolve_device(name: str, index: int = 0) -> torch.device:
    """`index`: which GPU "cuda" means (an engine replica's rank's); a CPU has one device."""
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if name == "cuda":
        visible = torch.cuda.device_count()
        if index >= visible:
            raise RuntimeError(
                f"this GPU worker runs on cuda:{index} (one GPU per engine replica and tensor-parallel rank), "
                f"but {visible} GPU(s) are visible"
            )
        device = torch.device("cuda", index)
        torch.cuda.set_device(device)  # what runs on "the current device" (graph pools, Triton launches) too
        return device
    return torch.device(name)


def capture_graphs(
    model: torch.nn.Module,
    attention: AttentionBackend,
    kv_cache: PagedKVCache,
    limits: WorkerLimits,
    info: ModelInfo,
    last_tokens: torch.Tensor,
) -> StepGraphs:
    """Every step's graphs, in one memory pool (they never run at once), the largest activations first (a full
    prompt budget), so that the decode graphs reuse their memory."""
    # Imported only here: it builds on the Triton kernels, which the CPU path never loads.
    from gpu_worker.mixed_graphs import MixedGraphs

    pool = torch.cuda.graph_pool_handle()
    scratch_block = limits.num_kv_blocks
    seats = limits.max_num_seqs
    mixed = MixedGraphs(
        model,
        attention,
        kv_cache,
        limits.max_num_batched_tokens + seats,
        seats,
        info.max_model_len,
        scratch_block=scratch_block,
        last_tokens=last_tokens,
        pool=pool,
    )
    decode = DecodeGraphs(
        model,
        attention,
        kv_cache,
        seats,
        info.max_model_len,
        scratch_block=scratch_block,
        last_tokens=last_tokens,
        pool=pool,
    )
    return StepGraphs(decode, mixed)


def staging_bytes(limits: WorkerLimits, info: ModelInfo, table_width: int) -> int:
    """The most bytes one step copies to the device (host_copy.StagingRing), by what it copies. T: the most tokens
    a step computes (the prompt budget and a token per seat); S: the seats; W: a request's most blocks.

        per token     48   its id, position, KV slot and row (int64 each, eager; the graphs stage theirs apart),
                           and for prompt logprobs the scored id and its row (two int64 more)
        per sequence  8 (W + 16)   its block-table row (int32, in a table of power-of-two width: under 2 W
                           columns), and 16 int64-sized fields of attention metadata and of the step's rows
                           (context length, query start, prefill tiles, decode slices, logit row, pending row
                           and slot, last-token slot)
        per sample    20 per bias entry (logit_bias, and min_tokens' masked EOS and stop ids: row and id int64,
                           value float32), 128 + 16 of sampling parameters and rows (temperature, top-p/k,
                           min-p, seed, output index, penalties, logprob rows), V / 8 of structured output's bitmask
        per step      64 KiB: every copy starts 16-byte aligned (ALIGN), a few dozen of them
    """
    tokens, seqs = limits.max_num_batched_tokens + limits.max_num_seqs, limits.max_num_seqs
    bias_entries = MAX_LOGIT_BIAS + MAX_STOP_TOKEN_IDS + len(info.eos_token_ids)
    per_token = 32 + 16
    per_sequence = 8 * (table_width + 16)
    per_sample = 20 * bias_entries + 128 + info.vocab_size // 8 + 16
    return per_token * tokens + seqs * (per_sequence + per_sample) + 2**16
