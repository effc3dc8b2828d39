#!/bin/bash
# Call D: TMA-fed FP8 products (this tree) against the parent 7070b67 in W1, alternated; GPU tests; prefill rows.
. benchmarks/device_setup.sh llama-3.2-1b llama-3-8b > /dev/null
mkdir -p /tmp/logs /tmp/base && tar xzf .device-cache/s24/base.tgz -C /tmp/base
timeout 120 python -m pytest -q -p no:cacheprovider tests/test_fp8_matmul.py tests/test_moe_fp8.py > /tmp/logs/tests.log 2>&1
echo "tests rc=$?"; tail -2 /tmp/logs/tests.log
w1() {  # tree label model args...
  local tree=$1 label=$2 model=$3; shift 3
  (cd $tree && PYTHONPATH=/tmp/site:$tree timeout 90 python -m benchmarks.offline --model /tmp/shapes/$model --load-format dummy \
    --baselines none --profile-steps 0 "$@" > /tmp/logs/w1.log 2>&1)
  echo "w1 $model $label [$*] rc=$? $(grep -E '^ours  ' /tmp/logs/w1.log | tr -s ' ') | $(grep -o 'a full decode step [0-9.]* ms' /tmp/logs/w1.log)"
  echo "== $model $label $*" >> /tmp/logs/w1_all.log; grep -v "it/s\]\|tok/s\]" /tmp/logs/w1.log >> /tmp/logs/w1_all.log
}
for i in 1 2; do
  w1 /tmp/base base llama-3-8b --quantization fp8 --kv-cache-dtype fp8
  w1 $PWD tma llama-3-8b --quantization fp8 --kv-cache-dtype fp8
done
for i in 1 2; do
  w1 /tmp/base base llama-3.2-1b --quantization fp8 --kv-cache-dtype fp8
  w1 $PWD tma llama-3.2-1b --quantization fp8 --kv-cache-dtype fp8
done
w1 /tmp/base base llama-3-8b --quantization fp8
w1 $PWD tma llama-3-8b --quantization fp8
tar czf $OUT/logs.tgz -C /tmp/logs .
timeout 150 python -m benchmarks.fp8_gemm --shape llama-3-8b --tokens 2048,8192 --json /tmp/logs/gemm_prefill.json \
  > /tmp/logs/gemm_prefill.log 2>&1; echo "gemm prefill rc=$?"; grep -E "^\| (qkv|o|gate_up|down) " /tmp/logs/gemm_prefill.log | head -8
tar czf $OUT/logs.tgz -C /tmp/logs .
