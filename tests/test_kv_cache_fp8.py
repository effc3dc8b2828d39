"""--kv-cache-dtype fp8: the paged KV store in float8 e4m3 with one fixed scale per layer for K and for V.

Quantization rounds to e4m3 within its precision and saturates; the scales are powers of two calibrated at
start-up; the store holds twice bfloat16's blocks in the same memory; the Triton kernels (the Triton
interpreter on a CPU) store the bits torch stores and attend as the torch backend does over the same store, and
both stay within e4m3's precision of attention over a full-precision store; the engine and the server run with
it; a bad value is refused as argparse refuses one.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton_kernels is imported: see test_triton_attention

pytest.importorskip("triton", reason="triton is not installed (pip install triton)")

import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from common.config import EngineConfig  # noqa: E402
from common.model_info import ModelInfo  # noqa: E402
from common.sampling_params import SamplingParams  # noqa: E402
from gpu_worker.attention import TorchAttention  # noqa: E402
from gpu_worker.attention import triton_kernels as kernels  # noqa: E402
from gpu_worker.attention.triton_backend import TritonAttention  # noqa: E402
from gpu_worker.kv_cache import FP8, FP8_MAX, dequantize, quantize  # noqa: E402
from gpu_worker.kv_scales import HEADROOM, calibrate_kv_scales, scale_for  # noqa: E402
from gpu_worker.kv_sizing import size_kv_store  # noqa: E402
from gpu_worker.model_loader import load_model  # noqa: E402
from offline import LLM  # noqa: E402
from tests.server_process import ROOT, ServerProcess, free_port  # noqa: E402
from tests.test_triton_attention import MIXED, SCALE, Batch, build_metadata, mixed_batch  # noqa: E402
from tests.tiny_models import random_prompts  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
E4M3_HALF_ULP = 2.0**-4  # relative rounding error of a normal e4m3 number (3 mantissa bits)
E4M3_SUBNORMAL_HALF_STEP = 2.0**-10  # absolute, in units of the scale: subnormals are spaced 2^-9
E4M3_NAN = 0x7F
KV_SCALES = (2.0**-4, 2.0**-3)  # K's and V's differ, so that a swap shows; N(0, 1) entries stay far from 448
# Attention over an e4m3 store against a full-precision one (N(0, 1) queries, keys and values, up to 150 keys):
# the outputs' relative error (Frobenius) stays under this. Each entry is off by at most 2^-4 relative, and
# the errors of many entries average out in the softmax's weighted sums.
FP8_ATTENTION_RELATIVE_ERROR = 0.05
needs_fp8_triton = pytest.mark.skipif(
    torch.cuda.is_available() and torch.cuda.get_device_capability() < (8, 9),
    reason="Triton's float8 e4m3 conversions need a GPU of compute capability 8.9 or more",
)


def relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.float() - want.float()).norm() / want.float().norm()).item()


def test_quantize_rounds_to_the_nearest_e4m3_value_in_units_of_the_scale():
    x = torch.randn(4096, generator=torch.Generator().manual_seed(0)) * torch.logspace(-4, 1, 4096)
    q = quantize(x, 0.25)
    assert q.dtype == FP8
    back = dequantize(q, 0.25, torch.float32)
    assert ((back - x).abs() <= x.abs() * E4M3_HALF_ULP + 0.25 * E4M3_SUBNORMAL_HALF_STEP).all()


def test_entries_beyond_the_scales_range_saturate_rather_than_becoming_nan():
    back = dequantize(quantize(torch.tensor([1e6, -1e6, 500.0]), 1.0), 1.0, torch.float32)
    assert back.tolist() == [FP8_MAX, -FP8_MAX, FP8_MAX]


@pytest.mark.parametrize("amax", [1e-3, 0.6, 20.0, 3000.0])
def test_a_scale_is_the_power_of_two_that_leaves_headroom_over_the_calibrated_largest_entry(amax):
    scale = scale_for(amax)
    assert scale == 2.0 ** round(torch.log2(torch.tensor(scale)).item())
    assert amax * HEADROOM <= FP8_MAX * scale < 2 * amax * HEADROOM


def test_a_layer_that_wrote_only_zeros_gets_scale_one():
    assert scale_for(0.0) == 1.0


def test_calibration_gives_each_layer_scales_covering_its_entries_the_same_on_every_start(tiny_llama):
    model = load_model(str(tiny_llama), "auto", torch.float32, torch.device("cpu"))
    attention = TorchAttention(16)
    scales = calibrate_kv_scales(model, attention, 512, 512, 16, torch.float32, torch.device("cpu"))
    assert len(scales) == model.kv_shape[0]
    assert scales == calibrate_kv_scales(model, attention, 512, 512, 16, torch.float32, torch.device("cpu"))
    assert all(k == scale_for(k * FP8_MAX / HEADROOM) and v > 0 for k, v in scales)


def test_the_store_holds_twice_bfloat16s_blocks_in_the_same_memory(tiny_llama):
    model = load_model(str(tiny_llama), "auto", torch.bfloat16, torch.device("cpu"))
    info = ModelInfo.from_folder(tiny_llama)
    config = EngineConfig(model=str(tiny_llama), cpu_kv_cache_gib=0.001)
    cpu, attention = torch.device("cpu"), TorchAttention(config.block_size)

    def blocks(kv_dtype: torch.dtype) -> int:
        return size_kv_store(config, info, model, attention, cpu, kv_dtype, None, 1000, 512)

    assert blocks(FP8) == 2 * blocks(torch.bfloat16) > 0


# ------------------------------------------------------------------------- attention over an e4m3 store


def fp8_caches(batch: Batch) -> tuple[torch.Tensor, torch.Tensor]:
    """The batch's cached context as an e4m3 store holds it, in units of KV_SCALES."""
    return quantize(batch.k_cache, KV_SCALES[0]), quantize(batch.v_cache, KV_SCALES[1])


def attend(backend, batch: Batch, k_cache: torch.Tensor, v_cache: torch.Tensor, **options) -> torch.Tensor:
    """options: the layer's sliding_window, softcap, kv_scales. The caches are written in place."""
    q, k, v = batch.qkv_views()
    return backend.forward(
        q, k, v, k_cache, v_cache, build_metadata(backend, batch.layout, batch.slots), SCALE, **options
    )


def full_precision(batch: Batch, **options) -> torch.Tensor:
    return attend(
        TorchAttention(batch.k_cache.shape[1]), batch, batch.k_cache.clone(), batch.v_cache.clone(), **options
    )


def torch_fp8(batch: Batch, **options) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    k_cache, v_cache = fp8_caches(batch)
    out = attend(TorchAttention(batch.k_cache.shape[1]), batch, k_cache, v_cache, kv_scales=KV_SCALES, **options)
    return out, k_cache, v_cache


def triton_fp8(batch: Batch, **options) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Slots no sequence owns hold NaN (e4m3fn has one), so a read past a context would show."""
    k_cache, v_cache = fp8_caches(batch)
    for cache in (k_cache, v_cache):
        cache.view(torch.uint8).view(-1, *cache.shape[2:])[batch.poisoned] = E4M3_NAN
    out = attend(
        TritonAttention(batch.k_cache.shape[1], batch.k_cache.shape[2]),
        batch,
        k_cache,
        v_cache,
        kv_scales=KV_SCALES,
        **options,
    )
    return out, k_cache, v_cache


def test_the_torch_backend_over_an_e4m3_store_stays_within_its_precision_of_full_precision():
    batch = mixed_batch(MIXED, 16, 8, 2, head_dim=32)
    out, k_cache, _ = torch_fp8(batch)
    assert k_cache.dtype == FP8
    assert 0 < relative_error(out, full_precision(batch)) < FP8_ATTENTION_RELATIVE_ERROR


def written_slots(cache: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """[T, Hkv, D] the store's entries at `slots` (gathered as bytes: torch indexes float8 on CUDA only)."""
    return cache.view(torch.uint8).view(-1, *cache.shape[2:])[slots.to(cache.device)].view(FP8)


@needs_fp8_triton
@pytest.mark.parametrize("options", [{}, {"sliding_window": 24, "softcap": 5.0}], ids=["plain", "window-softcap"])
@pytest.mark.parametrize("head_dim", [32, 80, 16], ids=["pairs", "pairs-padded", "too-narrow-for-pairs"])
def test_the_triton_kernels_store_torchs_bits_and_attend_as_the_torch_backend_does(options, head_dim):
    batch = mixed_batch(MIXED, 16, 8, 2, head_dim=head_dim, seed=5)
    out, k_cache, v_cache = triton_fp8(batch, **options)
    want, want_k, want_v = torch_fp8(batch, **options)
    for cache, want_cache in ((k_cache, want_k), (v_cache, want_v)):
        got, expected = (written_slots(c, batch.slots).float() for c in (cache, want_cache))
        torch.testing.assert_close(got, expected, rtol=0, atol=0)  # the same values (the sign of a zero may differ)
    torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-5)
    assert relative_error(out, full_precision(batch, **options)) < FP8_ATTENTION_RELATIVE_ERROR


@needs_fp8_triton
@pytest.mark.parametrize("products", ["q", "pairs"])
@pytest.mark.parametrize("options", [{}, {"sliding_window": 24, "softcap": 5.0}], ids=["plain", "window-softcap"])
def test_the_triton_kernels_over_an_e4m3_store_give_the_bits_of_a_full_precision_store_of_its_values(
    options, products, monkeypatch
):
    """The kernels apply the power-of-two scales outside their tile loops (K's in the score scale, V's on the
    output): exactly what scaling each entry gives, so a store of e4m3 values attends as a full-precision store
    holding the same values: bit for bit where the decode kernel converts its entries; where it places their
    bits as 16-bit pairs (1/256 of each, the 256 folded into the same scales) its products sum the even and the
    odd dims apart, so only float32's rounding of the sums' order differs."""
    monkeypatch.setitem(kernels.DECODE_TILES, (32, True), kernels.DecodeTiles(fp8_products=products))
    batch = mixed_batch(MIXED, 16, 8, 2, head_dim=32, seed=7)
    _, k, v = batch.qkv_views()
    for x, cache, scale in ((k, batch.k_cache, KV_SCALES[0]), (v, batch.v_cache, KV_SCALES[1])):
        for t in (x, cache):  # every entry, new and cached, on the e4m3 grid: quantizing it loses nothing
            t.copy_(dequantize(quantize(t, scale), scale, t.dtype))
    out, _, _ = triton_fp8(batch, **options)
    backend = TritonAttention(batch.k_cache.shape[1], batch.k_cache.shape[2])
    want = attend(backend, batch, batch.k_cache.clone(), batch.v_cache.clone(), **options)
    if products == "q":
        assert torch.equal(out, want)
    else:
        torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-6)


@pytest.mark.skipif(
    not torch.cuda.is_available(),
    reason="bfloat16 queries over a float8 store take float16 products on a GPU (the interpreter's bfloat16 is not "
    "the GPU's)",
)
@needs_fp8_triton
def test_bfloat16_queries_over_an_e4m3_store_stay_within_its_precision_of_full_precision():
    batch = mixed_batch(MIXED, 16, 8, 2, head_dim=32, dtype=torch.bfloat16, seed=9)
    out, _, _ = triton_fp8(batch)
    assert 0 < relative_error(out, full_precision(batch)) < FP8_ATTENTION_RELATIVE_ERROR


@triton.jit
def _place_e4m3_pairs(src_ptr, even_ptr, odd_ptr, BLOCK: tl.constexpr, ASM: tl.constexpr):
    offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    even, odd = kernels._e4m3_pairs_as_f16(tl.load(src_ptr + offsets), ASM)
    tl.store(even_ptr + offsets, even)
    tl.store(odd_ptr + offsets, odd)


@needs_fp8_triton
def test_every_pair_of_e4m3_values_placed_as_float16_bits_is_their_values_over_256():
    """The decode kernel's float8 entries, read two at a time as 16-bit pairs and their bits moved
    (_e4m3_pairs_as_f16): every pair of codes, subnormals and signed zeros included, in either byte; on a GPU
    also its PTX, which must give the same bits. (0x7F and 0xFF are NaN in e4m3fn: a store never holds them,
    quantize saturates; here they stand in as zeros.)"""
    codes = torch.arange(256, dtype=torch.int32)
    codes = torch.where(codes & 0x7F == 0x7F, 0, codes)
    low, high = codes.repeat(256), codes.repeat_interleave(256)  # every (low byte, high byte)
    pairs = (low | (high << 8)).to(torch.int32).to(torch.int16)
    bytes_ = torch.stack([low, high], dim=1).to(torch.uint8).view(FP8)
    want_even, want_odd = ((bytes_[:, i].float() / kernels.E4M3_IN_F16_UNIT).to(torch.float16) for i in (0, 1))
    for asm in (False, True) if DEVICE.type == "cuda" else (False,):
        even, odd = (torch.empty(len(pairs), dtype=torch.float16, device=DEVICE) for _ in range(2))
        _place_e4m3_pairs[(len(pairs) // 1024,)](pairs.to(DEVICE), even, odd, BLOCK=1024, ASM=asm)
        assert torch.equal(even.cpu().view(torch.int16), want_even.view(torch.int16)), f"asm={asm}"
        assert torch.equal(odd.cpu().view(torch.int16), want_odd.view(torch.int16)), f"asm={asm}"


# ---------------------------------------------------------------------------------- engine and server

PROMPTS = random_prompts(8, [5, 13, 17, 35], vocab=512, seed=3)


def greedy(folder, **engine_args) -> list[list[int]]:
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    with LLM(
        str(folder), device="cpu", num_kv_blocks=64, max_num_seqs=8, max_num_batched_tokens=512, **engine_args
    ) as llm:
        return [o.token_ids for o in llm.generate(PROMPTS, params)]


def test_the_engine_with_an_e4m3_store_mostly_generates_what_the_full_precision_one_does(tiny_model):
    fp8 = greedy(tiny_model, kv_cache_dtype="fp8")
    assert all(len(tokens) == 12 for tokens in fp8)
    agreement = sum(a[0] == b[0] for a, b in zip(fp8, greedy(tiny_model), strict=True)) / len(PROMPTS)
    assert agreement >= 0.75


def test_the_server_starts_with_an_e4m3_store_and_serves(tiny_llama, tmp_path):
    srv = ServerProcess(tiny_llama, "--kv-cache-dtype", "fp8", "--tokenizer-workers", "1", log_path=tmp_path / "log")
    try:
        with srv.client() as client:
            answer = client.post("/v1/completions", json={"prompt": "hello there", "max_tokens": 8, "temperature": 0})
        assert answer.status_code == 200
        assert answer.json()["usage"]["completion_tokens"] == 8
        assert "float8 e4m3" in srv.log()
    finally:
        srv.stop()


def test_an_unknown_kv_cache_dtype_exits_2_naming_the_flag_and_the_choices():
    done = subprocess.run(
        [sys.executable, str(ROOT / "launch.py"), "--kv-cache-dtype", "int4", "--port", str(free_port())],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 2
    assert "--kv-cache-dtype: invalid choice: 'int4'" in done.stderr and "fp8_e4m3" in done.stderr
