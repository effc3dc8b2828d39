#!/bin/bash
# GPU tests of the fp8 products' decode table; W1 8B fp8 (+ fp8 KV): b47f5bb (pairs decode, _scaled_mm between 65 and
# 2,047 rows) against this tree (DECODE_ROWS), alternated, one card.
. benchmarks/device_setup.sh llama-3-8b > /dev/null
rm -rf /tmp/base && mkdir -p /tmp/base && tar xzf .device-cache/s23/base.tgz -C /tmp/base
mkdir -p /tmp/logs
timeout 120 python -m pytest -q -x -p no:cacheprovider tests/test_fp8_matmul.py tests/test_fp8.py > /tmp/logs/tests.log 2>&1; echo "tests rc=$?"; tail -2 /tmp/logs/tests.log
run() {  # label root model [args]
  local label=$1 root=$2 model=$3; shift 3
  (cd $root && PYTHONPATH=/tmp/site:$root timeout 150 python -m benchmarks.offline --model $model --load-format dummy --baselines none \
    --profile-steps 0 --json /tmp/logs/w1_$label.json "$@" > /tmp/logs/w1_$label.log 2>&1)
  echo "$label rc=$? $(grep -E '^ours  ' /tmp/logs/w1_$label.log | tr -s ' ') | $(grep -o 'a full decode step [0-9.]* ms' /tmp/logs/w1_$label.log)"
}
N=$PWD; S8=/tmp/shapes/llama-3-8b
run fp8kv_base /tmp/base $S8 --quantization fp8 --kv-cache-dtype fp8
run fp8kv_new $N $S8 --quantization fp8 --kv-cache-dtype fp8
run fp8_new $N $S8 --quantization fp8
run fp8kv_base2 /tmp/base $S8 --quantization fp8 --kv-cache-dtype fp8
run fp8kv_new2 $N $S8 --quantization fp8 --kv-cache-dtype fp8
tar czf $OUT/logs.tgz -C /tmp/logs .
