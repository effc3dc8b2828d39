#!/bin/bash
# The pairs decode's occupancy: 32-key tiles (64 registers, 8 programs an SM) against 64 (103, 4); W1 8B fp8 + fp8 KV both ways.
. benchmarks/device_setup.sh llama-3-8b > /dev/null
mkdir -p /tmp/logs
timeout 100 python -m benchmarks.decode_tiles --head-dims 128 --stores fp8 --block-n 32,64 --warps 4 --stages 2,3 --fp8-products pairs \
  --json /tmp/logs/decode_tiles_pairs.json > /tmp/logs/decode_tiles_pairs.log 2>&1; echo "tiles rc=$?"; tail -3 /tmp/logs/decode_tiles_pairs.log
python3 - <<'PY'
import json; d = json.load(open("/tmp/logs/decode_tiles_pairs.json"))
for r in d["rows"]:
    print(r["seqs"], r["contexts"], (r["block_n"], r["num_warps"], r["num_stages"]), round(r.get("us", -1), 1), round(r.get("hbm_share", 0), 3))
PY
for t in 32,4,2 64,4,2; do
  timeout 80 python .device-cache/s23/w1_tiles.py $t --model /tmp/shapes/llama-3-8b --load-format dummy --baselines none --profile-steps 0 \
    --quantization fp8 --kv-cache-dtype fp8 > /tmp/logs/w1_$t.log 2>&1
  echo "w1 $t rc=$? $(grep -E '^ours  ' /tmp/logs/w1_$t.log | tr -s ' ') | $(grep -o 'a full decode step [0-9.]* ms' /tmp/logs/w1_$t.log)"
done
tar czf $OUT/logs.tgz -C /tmp/logs .
