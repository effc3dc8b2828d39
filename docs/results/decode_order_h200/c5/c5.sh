#!/bin/bash
# Decode attention's launch order: a slice's KV heads together (seq_major) against each head's slices in turn, the
# kernel alone, then W1 (8B, 1B) with each default, one card.
. benchmarks/device_setup.sh llama-3.2-1b llama-3-8b
timeout 150 python .device-cache/s22/attn_major.py > /tmp/attn_major.log 2>&1; echo "attn rc=$?"; grep -v Warn /tmp/attn_major.log; cp /tmp/attn_major.log $OUT/
rm -rf /tmp/sm && mkdir -p /tmp/sm && tar cf - --exclude=./.whl --exclude=./.device-cache --exclude=./.git . | tar xf - -C /tmp/sm
sed -i 's/^    seq_major: bool = False/    seq_major: bool = True/' /tmp/sm/gpu_worker/attention/triton_kernels.py; grep -c "seq_major: bool = True" /tmp/sm/gpu_worker/attention/triton_kernels.py
run() {  # label root model
  (cd $2 && PYTHONPATH=/tmp/site:$2 timeout 120 python -m benchmarks.offline --model $3 --load-format dummy --baselines none \
    --profile-steps 0 > /tmp/$1.log 2>&1)
  echo "$1 rc=$? $(grep -E '^ours  ' /tmp/$1.log | tr -s ' ') | $(grep -o 'a full decode step [0-9.]* ms' /tmp/$1.log)"
}
N=$PWD; S8=/tmp/shapes/llama-3-8b; S1=/tmp/shapes/llama-3.2-1b
run 8b_turn $N $S8; run 8b_major /tmp/sm $S8; run 1b_turn $N $S1; run 1b_major /tmp/sm $S1
