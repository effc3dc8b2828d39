#!/bin/bash
# Call E: the 1B's plain bf16 products (pointer and TMA feeds, bf16 tiles) against cuBLAS; W1 1B bf16 with the winners.
. benchmarks/device_setup.sh llama-3.2-1b > /dev/null
mkdir -p /tmp/logs
S=.device-cache/s24
timeout 200 python -m benchmarks.fp8_gemm --shape llama-3.2-1b --tokens 128,256,512 --plain --json /tmp/logs/plain_1b.json \
  > /tmp/logs/plain_1b.log 2>&1; echo "plain rc=$?"; grep -A15 "bf16 product" /tmp/logs/plain_1b.log | cut -c1-160
tar czf $OUT/logs.tgz -C /tmp/logs .
for t in none /tmp/logs/plain_1b.json none /tmp/logs/plain_1b.json; do
  timeout 60 python $S/w1_plain.py $t --model /tmp/shapes/llama-3.2-1b --load-format dummy --baselines none --profile-steps 0 \
    > /tmp/logs/w1.log 2>&1
  echo "w1 1b bf16 [$t] rc=$? $(grep -E '^ours  ' /tmp/logs/w1.log | tr -s ' ') | $(grep -o 'a full decode step [0-9.]* ms' /tmp/logs/w1.log)"
  echo "== $t" >> /tmp/logs/w1_all.log; grep -v "it/s\]\|tok/s\]" /tmp/logs/w1.log >> /tmp/logs/w1_all.log
done
tar czf $OUT/logs.tgz -C /tmp/logs .
