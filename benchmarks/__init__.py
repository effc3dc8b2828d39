"""Benchmarks: `python -m benchmarks.offline` (in-process throughput) and `python -m benchmarks.serve` (HTTP)."""
