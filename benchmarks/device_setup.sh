#!/usr/bin/env bash
# Sourced first in a command on the lent GPU machine (from the repo's root there), with `.whl` (made here by
# benchmarks/device_wheels.sh) and `.device-cache/gpt2` (a copy of GPT-2's config and tokenizer) carried:
#     . benchmarks/device_setup.sh [SHAPE ...]
# installs the wheels into /tmp/site, exports PYTHONPATH (and PATH, for py-spy), and writes each named shape
# (benchmarks/shapes.py; default: llama-3.2-1b llama-3-8b) to /tmp/shapes/NAME with GPT-2's tokenizer.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  || return 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 CLEARSERVE_GRAMMAR_COMPILE_PRIORITY=normal PATH=/tmp/site/bin:$PATH
for shape in ${@:-llama-3.2-1b llama-3-8b}; do
  python3 -m benchmarks.shapes "$shape" "/tmp/shapes/$shape" --tokenizer-from .device-cache/gpt2 >/dev/null || return 1
done
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
git rev-parse --short HEAD 2>/dev/null || true
