#!/bin/bash
# Call C: a TMA-fed persistent / warp-specialized product against cuBLAS and _scaled_mm at decode rows; 1B fp8 KV tiles in W1.
. benchmarks/device_setup.sh llama-3.2-1b > /dev/null
mkdir -p /tmp/logs
S=.device-cache/s24
timeout 330 python $S/tma_mm.py --json /tmp/logs/tma.json > /tmp/logs/tma.log 2>&1; echo "tma rc=$?"; grep -v "^plain\|^scaled" /tmp/logs/tma.log | cut -c1-150 | tail -52
tar czf $OUT/logs.tgz -C /tmp/logs .
for t in default "64,fp8=64,2,3,pairs" default "64,fp8=64,2,3,pairs"; do
  timeout 60 python $S/w1_tiles.py "$t" --model /tmp/shapes/llama-3.2-1b --load-format dummy --baselines none --profile-steps 0 \
    --quantization fp8 --kv-cache-dtype fp8 > /tmp/logs/w1.log 2>&1
  echo "w1 1b fp8+fp8kv [$t] rc=$? $(grep -E '^ours  ' /tmp/logs/w1.log | tr -s ' ') | $(grep -o 'a full decode step [0-9.]* ms' /tmp/logs/w1.log)"
  cat /tmp/logs/w1.log >> /tmp/logs/w1_all.log
done
tar czf $OUT/logs.tgz -C /tmp/logs .
