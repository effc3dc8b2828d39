"""benchmarks.decode_breakdown's kinds: a kernel's name decides which part of a decode step it counts toward."""

from __future__ import annotations

import pytest

from benchmarks.decode_breakdown import kind_of


@pytest.mark.parametrize(
    ("kernel", "kind"),
    [
        ("nvjet_sm90_tst_256x128_64x4_1x2_h_bz_coopA_TNT", "matmul"),
        ("void cublasLt::splitKreduce_kernel<32, 16, int, float, __nv_bfloat16, float>", "matmul"),  # a product's end
        ("_scaled_matmul_kernel", "matmul"),
        ("_decode_kernel", "attention"),
        ("_sum_kernel", "all-reduce"),  # our one-shot all-reduce
        ("_sum_add_rms_norm_kernel", "all-reduce"),  # ... ending in the residual norm
        ("ncclDevKernel_AllReduce_Sum_bf16_RING_LL", "all-reduce"),
        ("_add_rms_norm_kernel", "norm"),
        ("_act_and_mul_kernel", "activation"),
        ("void at::native::reduce_kernel<512, 1, at::native::ReduceOp<float, ArgMaxOps<float>>>", "sampling"),
    ],
)
def test_each_kernel_counts_toward_its_kind(kernel, kind):
    assert kind_of(kernel) == kind
