"""Engine configuration: the knobs the scheduler and the GPU worker both read, and their CLI flags."""

from __future__ import annotations

import argparse
from dataclasses import dataclass, fields

from common.flags import CACHE, LIMITS, MODEL, PARALLEL, SCHEDULER, flag_group

# 256 KiB: a large tool set or schema is tens of KiB; 8,000 choices are about 230 KB. Compiled grammars grow
# with their source (those 8,000 choices: 36 MB of token masks), so this bounds what one request can make the
# scheduler hold, and the grammar cache (256 MiB) still keeps several of the largest.
MAX_GRAMMAR_BYTES = 256 * 2**10


@dataclass(slots=True)
class EngineConfig:
    model: str = ""  # a folder (after model_source.resolve_model) holding config.json and tokenizer files
    # "auto": read the checkpoint; "dummy": random weights from the config; "null": no model at all, every step
    # returns placeholder tokens at once (the serving path's own ceiling: gpu_worker/null_runner.py)
    load_format: str = "auto"
    dtype: str = "auto"  # "auto": bfloat16 on CUDA, float32 on CPU
    # "fp8": the decoder layers' projections quantized at load to float8 e4m3, activations per token at each
    # matmul (gpu_worker/models/fp8.py); None: every weight in `dtype`
    quantization: str | None = None
    device: str = "auto"  # "auto": cuda when available, else cpu
    seed: int = 0  # dummy weights and the seeds of unseeded requests
    block_size: int = 16
    # The paged KV store's element type: "auto" the model's dtype; "fp8" / "fp8_e4m3" float8 e4m3 with one fixed
    # scale per layer for K and for V (gpu_worker/kv_scales.py)
    kv_cache_dtype: str = "auto"
    num_kv_blocks: int | None = None  # None: sized from free memory
    gpu_memory_utilization: float = 0.90
    cpu_kv_cache_gib: float = 2.0
    max_model_len: int | None = None  # None: the model's own context length
    # None: decided for the device by the GPU worker (gpu_worker/limits.py), which reports them in its
    # WorkerReady; the scheduler plans with what the worker decided.
    max_num_seqs: int | None = None  # running requests (the decode batch)
    max_num_batched_tokens: int | None = None  # prompt tokens computed per step; "auto": see below
    # "auto" (--max-num-batched-tokens auto): the budget adapts, up to the worker's default, so that a step
    # mixing prompts with decodes takes at most target_itl_ms (scheduler/prefill_budget.py). None (neither flag
    # value given): the worker decides, adaptive on a GPU (gpu_worker/limits.py); offline.LLM takes the fixed one.
    adaptive_prefill_budget: bool | None = None
    target_itl_ms: float = 50.0
    max_prefill_requests: int | None = None  # requests admitted per step; None: no limit beyond max_num_seqs
    enable_prefix_caching: bool = True
    enable_chunked_prefill: bool = True
    max_waiting_requests: int = 4096  # beyond this the scheduler refuses new requests (HTTP 503)
    # "fcfs": waiting requests are admitted, and running ones preempted newest first, in arrival order;
    # "priority": by each request's priority (lower first, as vLLM), then arrival (scheduler/waiting_queue.py).
    scheduling_policy: str = "fcfs"
    # A request without max_tokens generates at most this many (and never past the context); None: up to the
    # context, as vLLM. The server's flag defaults to SERVER_DEFAULT_MAX_TOKENS.
    default_max_tokens: int | None = None
    attention_backend: str = "auto"  # "auto" | "triton" | "flashinfer" | "torch" (gpu_worker/attention: the choice)
    enforce_eager: bool = False  # CUDA only: no CUDA graphs for decode
    tensor_parallel_size: int = 1  # GPU worker ranks, one device each, sharing one model (gpu_worker/parallel.py)
    # Structured output (scheduler/grammars.py): a grammar's source beyond this many bytes is refused where the
    # request enters; one that takes longer to compile is refused and its compile worker replaced.
    max_grammar_bytes: int = MAX_GRAMMAR_BYTES
    grammar_compile_timeout: float = 10.0  # seconds of the compile's CPU time (scheduler/compile_budget.py)

    def __post_init__(self) -> None:
        if self.max_num_batched_tokens == "auto":  # (the flag's spelling, or LLM(max_num_batched_tokens="auto"))
            self.max_num_batched_tokens = None
            self.adaptive_prefill_budget = True
        elif self.max_num_batched_tokens is not None:
            self.adaptive_prefill_budget = False  # a number is a fixed budget

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> EngineConfig:
        return cls(**{f.name: getattr(args, f.name) for f in fields(cls) if hasattr(args, f.name)})


# Batch limits left to the device (the GPU worker decides with these: gpu_worker/limits.py). Measured on an H100
# (docs/benchmarks.md, "Batch limits"): when prefill steps ran eagerly they cost ~12 ms of host time each
# whatever their size, so a larger budget took fewer of them (W1's TTFT p50 131 -> 74 ms from 4,096 to 16,384
# tokens); they now replay CUDA graphs, and the budget mostly bounds how long one step holds the decodes back.
# 512 running requests where the KV store holds them at a typical length. A CPU computes a step's tokens one
# core-second at a time: the smaller limits keep steps short.
CPU_MAX_NUM_SEQS = 256
CPU_MAX_NUM_BATCHED_TOKENS = 4096
GPU_MAX_NUM_BATCHED_TOKENS = 16384
GPU_MAX_NUM_SEQS = 512
GPU_TYPICAL_REQUEST_TOKENS = 2048  # "holds N requests": N of this length (or the context, if shorter)


def _budget(text: str) -> int | str:
    if text == "auto":
        return text
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number of tokens or 'auto', not {text!r}") from None


# A chat request that leaves out max_tokens should finish in seconds on a CPU, not run to an 8k context.
SERVER_DEFAULT_MAX_TOKENS = 512

# vLLM's other names for the dtypes.
DTYPE_ALIASES = {"half": "float16", "float": "float32", "bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    d = EngineConfig()
    model, parallel, cache = flag_group(parser, MODEL), flag_group(parser, PARALLEL), flag_group(parser, CACHE)
    scheduler, limits = flag_group(parser, SCHEDULER), flag_group(parser, LIMITS)
    model.add_argument(
        "--load-format",
        choices=["auto", "dummy", "null"],
        default=d.load_format,
        help="'dummy' builds random weights from the config (benchmarks); 'null' runs no model: placeholder "
        "tokens at once, to measure the serving path alone",
    )
    model.add_argument(
        "--dtype",
        type=lambda name: DTYPE_ALIASES.get(name, name),
        choices=["auto", "float32", "bfloat16", "float16"],
        default=d.dtype,
        help="weights and activations ('half' and 'float', vLLM's spellings, mean float16 and float32; "
        "auto: bfloat16 on CUDA, float32 on CPU)",
    )
    model.add_argument(
        "--quantization",
        "-q",
        choices=["fp8"],
        default=d.quantization,
        help="fp8: the decoder layers' linear weights quantized at load to float8 e4m3 with one scale per output "
        "channel, activations per token at each matmul (Hopper's FP8 matmul on CUDA, emulated on a CPU); "
        "embeddings and the head stay in --dtype (default: none, the weights in --dtype; a checkpoint saved in FP8 "
        "with per-channel, per-tensor or block scales is served as fp8 without it)",
    )
    model.add_argument("--device", choices=["auto", "cpu", "cuda"], default=d.device, help="auto: cuda when available")
    model.add_argument("--seed", type=int, default=d.seed, help="random weights and unseeded requests")
    cache.add_argument("--block-size", type=int, default=d.block_size, help="tokens per KV block")
    cache.add_argument(
        "--kv-cache-dtype",
        choices=["auto", "fp8", "fp8_e4m3"],
        default=d.kv_cache_dtype,
        help="the KV store's element type: auto, the model's dtype; fp8 (fp8_e4m3), float8 e4m3 with one scale per "
        "layer for K and for V, calibrated at start-up: twice the blocks of bfloat16 in the same memory",
    )
    cache.add_argument(
        "--num-kv-blocks",
        "--num-gpu-blocks-override",
        type=int,
        default=d.num_kv_blocks,
        help="KV blocks to allocate (default: sized from free memory, see --gpu-memory-utilization and "
        "--cpu-kv-cache-gib)",
    )
    cache.add_argument(
        "--gpu-memory-utilization",
        type=float,
        default=d.gpu_memory_utilization,
        help="CUDA: the share of the GPU's memory the server may fill (weights, activations, KV store); the KV "
        "store is sized to what the rest leave",
    )
    cache.add_argument(
        "--cpu-kv-cache-gib",
        type=float,
        default=d.cpu_kv_cache_gib,
        help="KV store size, in GiB, on a CPU device when --num-kv-blocks is not given",
    )
    model.add_argument(
        "--max-model-len",
        type=int,
        default=d.max_model_len,
        help="context length, prompt and generated tokens together (default: the model's own)",
    )
    scheduler.add_argument(
        "--max-num-seqs",
        type=int,
        default=d.max_num_seqs,
        help=f"running requests (decode batch); default: {GPU_MAX_NUM_SEQS} on a GPU whose KV store holds that many "
        f"requests of {GPU_TYPICAL_REQUEST_TOKENS} tokens, else {CPU_MAX_NUM_SEQS}",
    )
    scheduler.add_argument(
        "--max-num-batched-tokens",
        type=_budget,
        default=d.max_num_batched_tokens,
        help=f"prompt tokens computed per step; auto: up to {GPU_MAX_NUM_BATCHED_TOKENS} on a GPU "
        f"({CPU_MAX_NUM_BATCHED_TOKENS} on a CPU), as many as keep a step mixing prompts with decodes within "
        "--target-itl-ms (measured as the server runs); default: auto on a GPU (offline.LLM: the fixed "
        f"{GPU_MAX_NUM_BATCHED_TOKENS}), {CPU_MAX_NUM_BATCHED_TOKENS} on a CPU",
    )
    scheduler.add_argument(
        "--target-itl-ms",
        type=float,
        default=d.target_itl_ms,
        help="--max-num-batched-tokens auto: the step time (each decode's inter-token latency) to stay within",
    )
    scheduler.add_argument(
        "--max-prefill-requests",
        type=int,
        default=d.max_prefill_requests,
        help="requests admitted per step (default: no limit beyond --max-num-seqs)",
    )
    cache.add_argument(
        "--enable-prefix-caching",
        action=argparse.BooleanOptionalAction,
        default=d.enable_prefix_caching,
        help="share the KV blocks of common prompt prefixes",
    )
    cache.add_argument("--no-prefix-cache", dest="enable_prefix_caching", action="store_false", help=argparse.SUPPRESS)
    scheduler.add_argument(
        "--enable-chunked-prefill",
        action=argparse.BooleanOptionalAction,
        default=d.enable_chunked_prefill,
        help="split long prompts over steps within --max-num-batched-tokens",
    )
    scheduler.add_argument(
        "--no-chunked-prefill", dest="enable_chunked_prefill", action="store_false", help=argparse.SUPPRESS
    )
    scheduler.add_argument(
        "--max-waiting-requests",
        type=int,
        default=d.max_waiting_requests,
        help="requests waiting to be admitted; a request beyond them gets a 503",
    )
    scheduler.add_argument(
        "--scheduling-policy",
        choices=["fcfs", "priority"],
        default=d.scheduling_policy,
        help="fcfs: requests are served in arrival order; priority: by their 'priority' field (lower first), then "
        "arrival, and short of KV blocks the lowest-priority running request is preempted",
    )
    limits.add_argument(
        "--default-max-tokens",
        type=int,
        default=SERVER_DEFAULT_MAX_TOKENS,
        help="most tokens a request without max_tokens generates (chat, or completions with max_tokens null); "
        "0: up to the rest of the context, as vLLM",
    )
    model.add_argument(
        "--attention-backend",
        choices=["auto", "triton", "flashinfer", "torch"],
        default=d.attention_backend,
        help="triton: the paged Triton kernels (CUDA); flashinfer: FlashInfer's paged kernels (CUDA, the "
        "flashinfer-python package; float16/bfloat16, head_dim 64/128/256); torch: scaled_dot_product_attention "
        "over the paged KV store, the reference (any device); auto: flashinfer on CUDA where it runs the model, "
        "else triton, torch elsewhere (the GPU worker logs which and why)",
    )
    model.add_argument(
        "--enforce-eager", action="store_true", help="CUDA: run every step op by op, without CUDA graphs"
    )
    limits.add_argument(
        "--max-grammar-bytes",
        type=int,
        default=d.max_grammar_bytes,
        help="structured output: the largest grammar source (JSON schema, regex, choices, EBNF) accepted, in bytes; "
        "larger ones get a 400 naming the field",
    )
    limits.add_argument(
        "--grammar-compile-timeout",
        type=float,
        default=d.grammar_compile_timeout,
        help="structured output: seconds of CPU one grammar may take to compile (in the scheduler's compile worker, "
        "off its loop, on cycles serving leaves idle); past it the request gets a 400 naming the field and the worker "
        "is replaced; a request whose grammar is not ready 10x as long after its arrival (queued behind other "
        "grammars, or starved of CPU) gets a 503",
    )
    parallel.add_argument(
        "--tensor-parallel-size",
        "-tp",
        type=int,
        default=d.tensor_parallel_size,
        help="GPU worker processes, one GPU each (cuda:0 ...), each holding 1/N of the model's heads and "
        "vocabulary; on a CPU they share it (gloo)",
    )


def attention_backend_problem(backend: str, device: str) -> str | None:
    """Why --attention-backend `backend` cannot run on --device `device`, as far as can be told before any process
    starts (the GPU worker decides the rest, with the model: gpu_worker/attention); None: no objection. Imports
    torch only for an explicit triton or flashinfer, and flashinfer never (its import is the worker's)."""
    if backend not in ("triton", "flashinfer"):
        return None
    flag = f"--attention-backend {backend}"
    if device == "cpu":
        return f"{flag} runs on CUDA only (--device cpu)"
    if backend == "flashinfer":
        import importlib.util

        if importlib.util.find_spec("flashinfer") is None:
            return f"{flag}: the flashinfer package is not installed (pip install flashinfer-python)"
    import torch

    if not torch.cuda.is_available():
        return f"{flag} runs on CUDA only, and no CUDA device is visible"
    return None
