#!/bin/bash
# (1) GPU tests pending since session 21; (2) the 8B's W1 and its synchronous breakdown with the card's clocks and
# power logged beside them: is the pipelined step's excess over the breakdown's GPU busy a slower clock?
. benchmarks/device_setup.sh llama-3-8b
timeout 200 python -m pytest -q -x -p no:cacheprovider tests/test_triton_attention.py tests/test_fp8_matmul.py tests/test_fused_moe.py > $OUT/tests.log 2>&1; echo "tests rc=$?"; tail -2 $OUT/tests.log
Q="timestamp,clocks.sm,clocks.mem,power.draw,power.limit,temperature.gpu,clocks_throttle_reasons.active"
nvidia-smi --query-gpu=$Q --format=csv -lms 100 > $OUT/smi_w1.csv & S=$!
timeout 240 python -m benchmarks.offline --model /tmp/shapes/llama-3-8b --load-format dummy --baselines none --profile-steps 40 \
  --json $OUT/w1.json > $OUT/w1.log 2>&1; echo "w1 rc=$?"
kill $S
grep -v "it/s\]\|tok/s\]" $OUT/w1.log | tail -8
nvidia-smi --query-gpu=$Q --format=csv -lms 100 > $OUT/smi_bd.csv & S=$!
timeout 200 python -m benchmarks.decode_breakdown --model /tmp/shapes/llama-3-8b --load-format dummy --batch 256 \
  --prompt-lens 64-512 --warm-steps 128 --json $OUT/bd.json > $OUT/bd.log 2>&1; echo "bd rc=$?"
kill $S
grep -v "it/s\]\|tok/s\]" $OUT/bd.log | tail -14
python3 - <<'PY'
import csv, os
for name in ("smi_w1", "smi_bd"):
    rows = list(csv.reader(open(os.environ["OUT"] + f"/{name}.csv")))[1:]
    busy = [r for r in rows if float(r[3].split()[0]) > 250]
    if not busy: print(name, "no loaded samples"); continue
    sm = sorted(int(r[1].split()[0]) for r in busy); pw = sorted(float(r[3].split()[0]) for r in busy)
    reasons = {}
    for r in busy: reasons[r[6].strip()] = reasons.get(r[6].strip(), 0) + 1
    print(f"{name}: {len(busy)} samples >250 W: SM MHz min {sm[0]} p50 {sm[len(sm)//2]} max {sm[-1]}; W p50 {pw[len(pw)//2]} max {pw[-1]} limit {busy[0][4]}; temp max {max(int(r[5]) for r in busy)}; throttle {reasons}")
PY
