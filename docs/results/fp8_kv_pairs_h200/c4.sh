#!/bin/bash
# GPU tests of the pairs decode; decode_tiles' fp8 sweep (q vs pairs); W1 8B fp8 (+fp8 KV): 8d6c4ad vs this tree.
. benchmarks/device_setup.sh llama-3-8b > /dev/null
rm -rf /tmp/base && mkdir -p /tmp/base && tar xzf .device-cache/s23/base.tgz -C /tmp/base
timeout 200 python -m pytest -q -x -p no:cacheprovider tests/test_kv_cache_fp8.py tests/test_triton_attention.py tests/test_fp8_matmul.py > $OUT/tests.log 2>&1; echo "tests rc=$?"; tail -2 $OUT/tests.log
timeout 200 python -m benchmarks.decode_tiles --head-dims 128,64 --stores fp8 --block-n 64,128 --warps 4 --stages 2,3 --json $OUT/decode_tiles_fp8.json > $OUT/decode_tiles_fp8.log 2>&1; echo "tiles rc=$?"; tail -4 $OUT/decode_tiles_fp8.log
run() {  # label root model [args]
  local label=$1 root=$2 model=$3; shift 3
  (cd $root && PYTHONPATH=/tmp/site:$root timeout 170 python -m benchmarks.offline --model $model --load-format dummy --baselines none \
    --profile-steps 0 --json $OUT/w1_$label.json "$@" > $OUT/w1_$label.log 2>&1)
  echo "$label rc=$? $(grep -E '^ours  ' $OUT/w1_$label.log | tr -s ' ') | $(grep -o 'a full decode step [0-9.]* ms' $OUT/w1_$label.log)"
}
N=$PWD; S8=/tmp/shapes/llama-3-8b
run fp8kv_base /tmp/base $S8 --quantization fp8 --kv-cache-dtype fp8
run fp8kv_new $N $S8 --quantization fp8 --kv-cache-dtype fp8
run fp8_new $N $S8 --quantization fp8
run fp8kv_base2 /tmp/base $S8 --quantization fp8 --kv-cache-dtype fp8
run fp8kv_new2 $N $S8 --quantization fp8 --kv-cache-dtype fp8
