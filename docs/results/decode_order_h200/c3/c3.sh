#!/bin/bash
# GPU tests of this tree; then W1 on the real-size shapes, 9780763 (before: float32 logits buffer, decodes in
# batch order) against this tree, one card, each pair back to back; the 8B's breakdown at this tree.
. benchmarks/device_setup.sh llama-3.2-1b llama-3-8b
rm -rf /tmp/base && mkdir -p /tmp/base && git archive 9780763 | tar x -C /tmp/base
timeout 200 python -m pytest -q -x -p no:cacheprovider tests/test_triton_attention.py tests/test_cuda.py tests/test_gpu_clocks.py > $OUT/tests.log 2>&1; echo "tests rc=$?"; tail -2 $OUT/tests.log
run() {  # label root model [args]
  local label=$1 root=$2 model=$3; shift 3
  (cd $root && PYTHONPATH=/tmp/site:$root timeout 170 python -m benchmarks.offline --model $model --load-format dummy --baselines none \
    --profile-steps 0 --json $OUT/w1_$label.json "$@" > $OUT/w1_$label.log 2>&1)
  echo "$label rc=$? $(grep -E '^ours  ' $OUT/w1_$label.log | tr -s ' ') | $(grep -o 'a full decode step [0-9.]* ms' $OUT/w1_$label.log) | $(grep -o 'clock at [0-9]* MHz' $OUT/w1_$label.log)"
}
N=$PWD; G=$PWD/.device-cache/gpt2; S8=/tmp/shapes/llama-3-8b; S1=/tmp/shapes/llama-3.2-1b
run 8b_base /tmp/base $S8; run 8b_new $N $S8
run 8b_fp8_new $N $S8 --quantization fp8; run 8b_fp8kv_new $N $S8 --quantization fp8 --kv-cache-dtype fp8
run 1b_base /tmp/base $S1; run 1b_new $N $S1
run gpt2_base /tmp/base $G; run gpt2_new $N $G
timeout 150 python -m benchmarks.decode_breakdown --model $S8 --load-format dummy --batch 256 --prompt-lens 64-512 --warm-steps 128 \
  --json $OUT/bd_8b.json > $OUT/bd_8b.log 2>&1; echo "bd rc=$?"; grep -E "attention|matmul|busy|idle|step" $OUT/bd_8b.log | grep -v "it/s" | head -8
