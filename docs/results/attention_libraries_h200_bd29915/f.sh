#!/bin/bash
# Call F: FlashInfer's paged decode against ours at HEAD, kernels side by side (bf16 and fp8 stores), and the 8B's W1 per backend.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .device-cache/slim/*.whl
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 CLEARSERVE_GRAMMAR_COMPILE_PRIORITY=normal
python3 -m benchmarks.shapes llama-3-8b /tmp/shapes/llama-3-8b --tokenizer-from .device-cache/gpt2 > /dev/null
tar -xzf .device-cache/fi/fi_trim.tgz -C /tmp/site
mkdir -p /tmp/logs
python3 -c "import flashinfer; print('flashinfer', flashinfer.__version__)" 2>&1 | tail -1
timeout 150 python -m benchmarks.attention_libraries --parts decode --shapes 8b --kv-store bf16 --json /tmp/logs/al_bf16.json \
  > /tmp/logs/al_bf16.log 2>&1; echo "al bf16 rc=$?"; tail -12 /tmp/logs/al_bf16.log | cut -c1-180
tar czf $OUT/logs.tgz -C /tmp/logs .
for b in triton flashinfer; do
  timeout 120 python -m benchmarks.offline --model /tmp/shapes/llama-3-8b --load-format dummy --baselines none --profile-steps 0 \
    --attention-backend $b > /tmp/logs/w1_$b.log 2>&1
  echo "w1 8b bf16 $b rc=$? $(grep -E '^ours  ' /tmp/logs/w1_$b.log | tr -s ' ') | $(grep -o 'a full decode step [0-9.]* ms' /tmp/logs/w1_$b.log) | $(grep -o 'TTFT p50 [0-9.]* ms' /tmp/logs/w1_$b.log)"
done
tar czf $OUT/logs.tgz -C /tmp/logs .
timeout 120 python -m benchmarks.attention_libraries --parts decode --shapes 8b --kv-store fp8 --json /tmp/logs/al_fp8.json \
  > /tmp/logs/al_fp8.log 2>&1; echo "al fp8 rc=$?"; tail -12 /tmp/logs/al_fp8.log | cut -c1-180
tar czf $OUT/logs.tgz -C /tmp/logs .
