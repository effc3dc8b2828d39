"""The fp8 KV store's scales (--kv-cache-dtype fp8): one for K and one for V per layer, fixed at start-up.

Fixed, and per layer (not per head or token, not recomputed per step): the store's write and every read take
one float each, known before CUDA graphs are captured, and a token's stored bits never depend on the other
tokens of its step, so a request's output does not depend on its batch.

Calibrated, not vLLM's default 1.0: e4m3 keeps its 3 mantissa bits only within its normal range, 2^-6 to 448.
At scale 1.0 half of SmolLM2-135M's first-layer V entries (median |v| 0.016) lie below it, in subnormals spaced
2^-9 apart, while K entries reach 20 there and hundreds in other models (Qwen2's K bias); random weights' range
follows their initializer. So the worker runs one forward of CALIBRATION_TOKENS fixed pseudo-random token ids
(the same on every start and every rank: the same weights give the same scales; each tensor-parallel rank
calibrates its own heads) into a store in the model's dtype, and a layer's scale is its largest |K| (|V|) there
times HEADROOM / 448, rounded up to a power of two:
- HEADROOM: real prompts may reach past what the calibration saw (beyond 448 x scale an entry saturates). The
  normal range spans 2^15, so entries down to 2^-15 x 448 x scale (amax x HEADROOM / 2^15) keep full precision.
- a power of two: x / scale and q x scale are exact in any float format, so the torch backend (dequantizing
  into the model's dtype) and the Triton kernels (in float32) read the same values.
"""

from __future__ import annotations

import math

import torch

from gpu_worker.attention import AttentionBackend
from gpu_worker.kv_cache import FP8_MAX, PagedKVCache
from gpu_worker.probe_forward import probe_forward

CALIBRATION_TOKENS = 256
CALIBRATION_SEED = 0
# SmolLM2-135M in bfloat16: the largest |K| and |V| of 16 of benchmarks/quantization_quality.py's real prompts
# (and 16 generated tokens each) are within 1.6x of the calibration's, in every layer.
HEADROOM = 4.0


def calibrate_kv_scales(
    model: torch.nn.Module,
    attention: AttentionBackend,
    vocab_size: int,
    max_model_len: int,
    block_size: int,
    dtype: torch.dtype,
    device: torch.device,
) -> list[tuple[float, float]]:
    """Each layer's (K scale, V scale), from one forward in the model's `dtype`."""
    tokens = min(CALIBRATION_TOKENS, max_model_len)
    num_layers, kv_heads, head_dim = model.kv_shape
    cache = PagedKVCache(num_layers, -(-tokens // block_size), block_size, kv_heads, head_dim, dtype, device)
    ids = torch.randint(vocab_size, (tokens,), generator=torch.Generator().manual_seed(CALIBRATION_SEED))
    with torch.inference_mode():
        probe_forward(model, attention, cache, ids.to(device))
    amax = cache.data.abs().amax(dim=(2, 3, 4, 5)).float().cpu()  # [layers, 2]
    return [(scale_for(float(k)), scale_for(float(v))) for k, v in amax.tolist()]


def scale_for(amax: float) -> float:
    """The power of two that puts amax x HEADROOM at or under 448 x scale (1.0 for a layer that wrote zeros)."""
    if not amax > 0 or not math.isfinite(amax):
        return 1.0
    return 2.0 ** math.ceil(math.log2(amax * HEADROOM / FP8_MAX))
