#!/usr/bin/env bash
# Wheels the lent GPU machine lacks (it has torch, triton, transformers, msgpack, aiohttp, uvloop, prometheus-client,
# but no pyzmq, fastapi, uvicorn, pydantic, viztracer, xgrammar; py-spy for benchmarks.pyspy_top), downloaded here into .whl/ (git-ignored) for Python 3.12 x86-64.
# On the device: python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl; export PYTHONPATH=/tmp/site
set -euo pipefail
cd "$(dirname "$0")/.."
rm -rf .whl && mkdir .whl
for spec in pyzmq==27.3.0 fastapi==0.165.0 starlette==1.10.0 uvicorn==0.54.0 pydantic==2.14.3 pydantic-core==2.50.4 \
            annotated-types==0.8.0 typing-inspection==0.4.5 annotated-doc==0.0.7 viztracer==1.1.1 objprint==0.3.0 \
            httptools==0.7.1 gguf==0.17.1 opentelemetry-api==1.45.2 \
            xgrammar==0.2.8 apache-tvm-ffi==0.1.15.post2 py-spy==0.4.3; do
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 --platform manylinux1_x86_64 --platform any -d .whl "$spec"
done
ls .whl
