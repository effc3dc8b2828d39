#!/bin/bash
# ncu stall reasons of the pairs decode (W1 8B, fp8 store); fp8 products at decode sizes, 11 launch shapes.
. benchmarks/device_setup.sh llama-3-8b > /dev/null
timeout 100 ncu --clock-control none -k regex:_decode_kernel --launch-skip 2 --launch-count 1 --set full \
  --metrics regex:smsp__average_warps_issue_stalled_.*_per_issue_active.ratio \
  python .device-cache/s23/ncu_decode.py fp8 > $OUT/ncu_pairs.txt 2>&1; echo "ncu rc=$?"
grep -E "Duration|DRAM Throughput|Issue Slots Busy|Registers Per|Achieved Occupancy|Theoretical Occupancy|highest-utilized|Executed Instructions  " $OUT/ncu_pairs.txt
grep -E "stalled_" $OUT/ncu_pairs.txt | awk '{print $1, $NF}' | sort -k2 -g -r | head -8
for shape in llama-3-8b llama-3.2-1b; do
timeout 150 python -m benchmarks.fp8_gemm --shape $shape --tokens 128,256,512 --json $OUT/gemm_$shape.json > $OUT/gemm_$shape.log 2>&1; echo "gemm $shape rc=$?"; grep "^|" $OUT/gemm_$shape.log
done
