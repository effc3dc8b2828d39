#!/bin/bash
# Two H200s of one host. (1) The 8B's W1 at TP=1 and TP=2 (this tree), TP=2 at 9780763 too; (2) GPT-2 and the 1B,
# 9780763 against this tree alternated, and GPT-2 with nvidia-smi's clock sampling (--gpu-clocks) beside them.
. benchmarks/device_setup.sh llama-3.2-1b llama-3-8b
rm -rf /tmp/base && mkdir -p /tmp/base && git archive 9780763 | tar x -C /tmp/base
L=/tmp/c4; mkdir -p $L
run() {  # label root model [args]
  local label=$1 root=$2 model=$3; shift 3
  (cd $root && PYTHONPATH=/tmp/site:$root timeout 130 python -m benchmarks.offline --model $model --load-format dummy --baselines none \
    --profile-steps 0 --json $L/$label.json "$@" > $L/$label.log 2>&1)
  echo "$label rc=$? $(grep -E '^ours  ' $L/$label.log | tr -s ' ') | $(grep -o 'a full decode step [0-9.]* ms' $L/$label.log) | $(grep -o 'clock at [0-9]* MHz.*limit' $L/$label.log)"
}
N=$PWD; G=$PWD/.device-cache/gpt2; S8=/tmp/shapes/llama-3-8b; S1=/tmp/shapes/llama-3.2-1b
run 8b_tp1 $N $S8; run 8b_tp2 $N $S8 -tp 2; run 8b_tp2_base /tmp/base $S8 -tp 2
run gpt2_base /tmp/base $G; run gpt2_new $N $G; run gpt2_new_clocks $N $G --gpu-clocks; run gpt2_base2 /tmp/base $G; run gpt2_new2 $N $G
run 1b_base /tmp/base $S1; run 1b_new $N $S1; run 1b_base2 /tmp/base $S1; run 1b_new2 $N $S1
tar czf $OUT/c4_logs.tgz -C $L .
