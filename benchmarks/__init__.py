"""Benchmark scripts, run as modules from the checkout's root: `python -m benchmarks.<folder>.<script>`
Shared helpers: benchmarks/common.py."""
