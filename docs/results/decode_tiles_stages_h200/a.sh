#!/bin/bash
# Call A: deeper K/V pipelining in the decode kernel (stages 5-7), then W1 8B bf16 with the winners vs DECODE_TILES.
. benchmarks/device_setup.sh llama-3-8b > /dev/null
mkdir -p /tmp/logs
S=.device-cache/s24
timeout 150 python -m benchmarks.decode_tiles --head-dims 128 --stores bf16,fp8 --block-n 64 --warps 4 --stages 2,3,4,5,6,7 \
  --fp8-products pairs --json /tmp/logs/tiles128.json > /tmp/logs/tiles128.log 2>&1; echo "tiles128 rc=$?"; tail -4 /tmp/logs/tiles128.log
timeout 170 python -m benchmarks.decode_tiles --head-dims 64 --stores bf16,fp8 --block-n 64,128 --warps 2,4 --stages 2,3,5,7 \
  --fp8-products pairs --json /tmp/logs/tiles64.json > /tmp/logs/tiles64.log 2>&1; echo "tiles64 rc=$?"; tail -4 /tmp/logs/tiles64.log
tar czf $OUT/logs.tgz -C /tmp/logs .
PICK=$(python $S/pick.py /tmp/logs/tiles128.json 2>/dev/null); echo "pick: $PICK"
PICK128=$(echo "$PICK" | tr ';' '\n' | grep '^128,bf16' || echo default)
for t in default "$PICK128" default "$PICK128"; do
  timeout 80 python $S/w1_tiles.py "$t" --model /tmp/shapes/llama-3-8b --load-format dummy --baselines none --profile-steps 0 \
    > /tmp/logs/w1.log 2>&1
  echo "w1 8b bf16 [$t] rc=$? $(grep -E '^ours  ' /tmp/logs/w1.log | tr -s ' ') | $(grep -o 'a full decode step [0-9.]* ms' /tmp/logs/w1.log)"
  cat /tmp/logs/w1.log >> /tmp/logs/w1_all.log
done
tar czf $OUT/logs.tgz -C /tmp/logs .
