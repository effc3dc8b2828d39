"""Benchmarks: `python -m benchmarks.offline` (in-process throughput), `python -m benchmarks.serve` (streaming
latency over HTTP) and `python -m benchmarks.scheduler_suite` (the scheduler's before/after pairs). See
docs/benchmarks.md."""
