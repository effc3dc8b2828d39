#!/bin/bash
# Session 23's first GPU call: what session 22 built without a GPU to run it on.
. benchmarks/device_setup.sh llama-3.2-1b llama-3-8b
timeout 240 python -m pytest -q -x -p no:cacheprovider tests/test_fp8_matmul.py tests/test_fp8_checkpoint.py tests/test_fp8.py \
  tests/test_triton_attention.py > $OUT/tests.log 2>&1; echo "tests rc=$?"; tail -2 $OUT/tests.log
timeout 200 python -m benchmarks.fp8_gemm --block-scales --tokens 16,64,256,2048 > $OUT/fp8_gemm_blocks.log 2>&1; echo "gemm rc=$?"; tail -14 $OUT/fp8_gemm_blocks.log
timeout 150 python -m benchmarks.offline --model /tmp/shapes/llama-3-8b --load-format dummy --baselines none --profile-steps 0 \
  --gpu-clocks > $OUT/w1_clocks.log 2>&1; echo "w1 rc=$?"; grep -E "^ours|roofline" $OUT/w1_clocks.log
for kv in auto fp8; do
timeout 120 python -m benchmarks.decode_breakdown --model /tmp/shapes/llama-3-8b --load-format dummy --batch 256 --prompt-lens 64-512 \
  --warm-steps 128 --quantization fp8 --kv-cache-dtype $kv > $OUT/bd_fp8_kv_$kv.log 2>&1; echo "bd kv=$kv rc=$?"; tail -16 $OUT/bd_fp8_kv_$kv.log
done
