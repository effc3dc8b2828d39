#!/bin/bash
# (1) CUDA tests of the decode graph's model-dtype logits; (2) decode attention's launch order; (3) W1 on GPT-2 and
# the 1B shape, HEAD (float32 logits buffer) against this tree, alternated, one card.
. benchmarks/device_setup.sh llama-3.2-1b
rm -rf /tmp/base && mkdir -p /tmp/base && git archive HEAD | tar x -C /tmp/base && echo "base $(git rev-parse --short HEAD)"
timeout 240 python -m pytest -q -x -p no:cacheprovider tests/test_cuda.py tests/test_correctness.py -k "cuda or logits" > $OUT/tests.log 2>&1; echo "tests rc=$?"; tail -2 $OUT/tests.log
timeout 200 python .device-cache/s22/attn_order.py > $OUT/attn_order.log 2>&1; echo "attn rc=$?"; grep -v Warn $OUT/attn_order.log
run() {  # label root model
  PYTHONPATH=/tmp/site:$2 timeout 150 python -m benchmarks.offline --model $3 --load-format dummy --baselines none --profile-steps 0 \
    > $OUT/w1_$1.log 2>&1; echo "$1 rc=$? $(grep -E '^ours  ' $OUT/w1_$1.log | tr -s ' ') | $(grep -o 'a full decode step [0-9.]* ms' $OUT/w1_$1.log)"
}
G=$PWD/.device-cache/gpt2
(cd /tmp/base && run gpt2_base /tmp/base $G); run gpt2_new $PWD $G; (cd /tmp/base && run gpt2_base2 /tmp/base $G); run gpt2_new2 $PWD $G
(cd /tmp/base && run 1b_base /tmp/base /tmp/shapes/llama-3.2-1b); run 1b_new $PWD /tmp/shapes/llama-3.2-1b
