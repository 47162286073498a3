"""Kernel benchmarks: one C++ kernel or matmul path against the others, per shape and row count."""
