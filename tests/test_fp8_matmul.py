"""The FP8 product as our Triton kernel (models/triton_matmul.py: scaled_matmul), which the CUDA path takes for few
rows (a decode of a few requests) and many (a prefill), between for the weight shapes where it measured faster,
_scaled_mm elsewhere: the product of the same quantized operands as the CPU's float32 emulation, whatever the
shape's remainders against the launch's tiles; the same kernel unscaled gives F.linear's bfloat16 product. Without
CUDA the kernel runs in the Triton interpreter (see test_triton_attention.py)."""

from __future__ import annotations

import os
from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

pytest.importorskip("triton", reason="triton is not installed (pip install triton)")

from gpu_worker.models import fp8, fp8_triton, triton_matmul  # noqa: E402
from gpu_worker.models.matmul_tiles import FEEDS, Tiles  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
# tiles a small shape leaves remainders of
SMALL_TILES = Tiles(block_m=16, block_n=32, block_k=32, num_warps=4, num_stages=2, group_m=2)


def quantized(rows: int, cols: int, seed: int, scale: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    t = torch.randn(rows, cols, generator=torch.Generator().manual_seed(seed)) * scale
    return fp8.quantize_rows(t)


def emulated(a, a_scale, b, b_scale) -> torch.Tensor:
    """models/fp8.py's CPU product: the rounded values multiplied in float32, then scaled."""
    return (a.float() @ b.float().t()) * a_scale * b_scale


def counting_tma_products(monkeypatch) -> list[int]:
    """Counts the products that went through the TMA-fed kernel (the others took pointers)."""
    calls: list[int] = []
    tma_product = triton_matmul._tma_product

    def counted(*args, **kwargs):
        calls.append(1)
        return tma_product(*args, **kwargs)

    monkeypatch.setattr(triton_matmul, "_tma_product", counted)
    return calls


@pytest.mark.parametrize("feed", FEEDS)
@pytest.mark.parametrize("m,n,k", [(5, 48, 80), (16, 32, 32), (37, 70, 100), (1, 1, 33)])
def test_the_kernel_gives_the_emulations_product_whatever_the_remainders(m, n, k, feed, monkeypatch):
    """Whichever way the operands are fed; TMA where it can describe them (rows of a multiple of 16 bytes: here
    80 and 32 fp8 inputs with 48 and 32 float32 outputs), pointers where it cannot."""
    a, a_scale = quantized(m, k, seed=1)
    b, b_scale = quantized(n, k, seed=2, scale=0.05)
    b_scale = b_scale.t().contiguous()  # [1, N], as a projection keeps it
    want = emulated(a, a_scale, b, b_scale)
    tma_products = counting_tma_products(monkeypatch)
    got = triton_matmul.scaled_matmul(
        *(t.to(DEVICE) for t in (a, a_scale, b, b_scale)), replace(SMALL_TILES, feed=feed), out_dtype=torch.float32
    )
    # fp8 x fp8 products are exact in float32: only the order of the sums differs from the emulation's
    torch.testing.assert_close(got.cpu(), want, rtol=1e-5, atol=1e-5)
    assert len(tma_products) == (feed != "pointers" and k % 16 == 0 and n * 4 % 16 == 0)


@pytest.mark.parametrize("m,n,k", [(5, 48, 80), (37, 70, 200), (1, 16, 64)])
def test_with_a_scale_per_channel_and_block_of_inputs_the_kernel_gives_the_emulations_product(m, n, k):
    # A block-scaled checkpoint's weights (fp8.quantize_blocks) and activations per token and group of inputs (as
    # fp8.linear quantizes them for such a weight): each tile's sums scaled by both of its inputs' group.
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(m, k, generator=gen) * torch.linspace(1, 8, k)  # groups differ
    w = torch.randn(n, k, generator=gen) * torch.linspace(0.01, 1, k)
    b, b_scale = fp8.quantize_blocks(w, (16, 64))
    rows = fp8.quantize_activation(x, 64)
    assert b_scale.shape == (n, -(-k // 64)) and rows.scales.shape == (m, -(-k // 64))
    want = fp8.linear(x, b, None, b_scale, group=64)  # the CPU's emulation: each entry dequantized, then summed
    got = triton_matmul.scaled_matmul(
        *(t.to(DEVICE) for t in (rows.values, rows.scales, b, b_scale)), SMALL_TILES, out_dtype=torch.float32, group=64
    )
    # float32's rounding of sums taken in another order, on terms up to the largest output's size
    torch.testing.assert_close(got.cpu(), want, rtol=1e-5, atol=1e-5 * want.abs().max().item())
    with pytest.raises(ValueError, match="must divide it"):
        triton_matmul.scaled_matmul(rows.values, rows.scales, b, b_scale, SMALL_TILES, group=48)
    if k > 64:  # (one group a row is one scale a row)
        with pytest.raises(ValueError, match="quantized per group"):  # rows a fused kernel quantized per token
            fp8.linear(fp8.quantize_activation(x), b, None, b_scale, group=64)


@pytest.mark.parametrize("group", [0, 128, 32])
def test_activations_quantize_per_token_or_group_in_one_kernel_as_torch_does(group):
    """fp8_triton.quantize_rows, per token or (a block-scaled checkpoint's products) per token and group of inputs,
    the last group partial: torch's scales exactly (quantize_rows, quantize_blocks(x, (1, group))), and on a GPU
    its values' bits too (the interpreter's float8 cast is not the GPU's: a value rounding up to the next power
    of two comes out at half of it)."""
    gen = torch.Generator().manual_seed(6)
    x = torch.randn(7, 300, generator=gen) * torch.logspace(-3, 2, 300)  # each group its own magnitude
    x[2] = 0
    x = x.to(torch.bfloat16 if DEVICE.type == "cuda" else torch.float32)
    q, scale = fp8_triton.quantize_rows(x.to(DEVICE), fp8.FP8_MAX, fp8.MIN_SCALE, group)
    want_q, want_scale = fp8.quantize_blocks(x, (1, group)) if group else fp8.quantize_rows(x)
    assert torch.equal(scale.cpu(), want_scale)
    if DEVICE.type == "cuda":
        assert torch.equal(q.cpu().view(torch.uint8), want_q.view(torch.uint8))


@pytest.mark.parametrize("feed", FEEDS)
@pytest.mark.parametrize("m,n,k", [(5, 48, 80), (37, 70, 100), (1, 1, 33)])
def test_the_kernel_unscaled_gives_f_linears_product_whatever_the_remainders(m, n, k, feed, monkeypatch):
    """triton_matmul.matmul, the plain (bfloat16 / float16) product: float32 sums, rounded once."""
    dtype = torch.bfloat16 if DEVICE.type == "cuda" else torch.float32  # (the interpreter has no bfloat16)
    gen = torch.Generator().manual_seed(4)
    x, w = (torch.randn(rows, k, generator=gen).to(DEVICE, dtype) for rows in (m, n))
    tma_products = counting_tma_products(monkeypatch)
    got = triton_matmul.matmul(x, w, replace(SMALL_TILES, feed=feed))
    assert len(tma_products) == (feed != "pointers" and m == 5)  # (80 and 48 entries: rows of 16-byte multiples)
    assert got.dtype == dtype
    tolerance = 1e-5 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(got.float(), F.linear(x.float(), w.float()), rtol=tolerance, atol=tolerance)


def test_plain_products_take_the_kernel_only_on_cuda_for_measured_shapes(monkeypatch):
    table = {(48, 80): ((128, SMALL_TILES), (256, None))}
    assert triton_matmul.measured_tiles(table, 100, 48, 80) == SMALL_TILES
    assert triton_matmul.measured_tiles(table, 200, 48, 80) is None  # cuBLAS measured faster there
    assert triton_matmul.measured_tiles(table, 300, 48, 80) is None  # past the rows measured
    assert triton_matmul.measured_tiles(table, 100, 48, 96) is None  # a shape not measured
    monkeypatch.setattr(triton_matmul, "PLAIN_DECODE_ROWS", table)
    x, w = torch.zeros(100, 80, dtype=torch.bfloat16), torch.zeros(48, 80, dtype=torch.bfloat16)
    assert triton_matmul.plain_tiles(x, w) is None  # on a CPU: F.linear
    assert triton_matmul.plain_tiles(x.float(), w.float()) is None  # float32: F.linear, wherever it runs
    if DEVICE.type == "cuda":
        assert triton_matmul.plain_tiles(x.cuda(), w.cuda()) == SMALL_TILES


def test_few_and_many_rows_take_the_kernel_and_a_decode_batch_between_takes_what_measured_faster():
    few, many = fp8_triton.FEW_ROWS_MAX, fp8_triton.MANY_ROWS_MIN
    unmeasured = (1000, 3000)  # a weight shape no table entry holds
    assert fp8_triton.matmul_tiles(1, *unmeasured) == fp8_triton.matmul_tiles(few, *unmeasured) == fp8_triton.FEW_ROWS
    assert fp8_triton.matmul_tiles(few + 1, *unmeasured) is None
    assert fp8_triton.matmul_tiles(many - 1, *unmeasured) is None
    assert fp8_triton.matmul_tiles(many, *unmeasured) == fp8_triton.MANY_ROWS
    # block-scaled weights (scales along K) take ours at every size: _scaled_mm scales whole rows
    assert fp8_triton.matmul_tiles(few + 1, *unmeasured, grouped=True) == fp8_triton.MANY_ROWS
    # a measured weight shape: each row count takes the entry of the least measured count at or above it
    for shape, entries in fp8_triton.DECODE_ROWS.items():
        bounds = [few] + [most for most, _ in entries]
        for (most, tiles), low in zip(entries, bounds):
            assert fp8_triton.matmul_tiles(low + 1, *shape) == tiles == fp8_triton.matmul_tiles(most, *shape)
        assert fp8_triton.matmul_tiles(bounds[-1] + 1, *shape) is None


@pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9),
    reason="FP8 matmuls need a CUDA device of compute capability 8.9 or more (Ada, Hopper)",
)
@pytest.mark.parametrize("m,n,k", [(3, 1024, 4096), (64, 1024, 4096), (256, 1024, 4096), (2048, 1024, 4096),
                                   (100, 2048, 2048), (256, 2048, 2048), (512, 2048, 8192)])  # fmt: skip
def test_the_cuda_product_agrees_with_scaled_mm_at_every_row_count(m, n, k):
    """fp8.linear's CUDA path, kernel or _scaled_mm by row count and weight shape (DECODE_ROWS' among them),
    against _scaled_mm itself: bfloat16's rounding."""
    a, a_scale = quantized(m, k, seed=3)
    b, b_scale = quantized(n, k, seed=4, scale=0.02)
    a, a_scale, b, b_scale = a.cuda(), a_scale.cuda(), b.cuda(), b_scale.t().contiguous().cuda()
    got = fp8._product_on_cuda(fp8.QuantizedRows(a, a_scale, torch.bfloat16), b, b_scale, group=0)
    want = torch._scaled_mm(a, b.t(), scale_a=a_scale, scale_b=b_scale, out_dtype=torch.bfloat16)
    assert ((got.float() - want.float()).norm() / want.float().norm()).item() < 1e-2
