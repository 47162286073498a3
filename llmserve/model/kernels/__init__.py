"""The kernel seam: ops.py (every kernel call, with PyTorch fallbacks), cpu_ext.py (the C++ extension's loader and
process-wide kernel settings), kinds.py (the fused decode stack's projection kinds), gguf_kernels.py (GGUF block
types: layouts, dequantization, llama.cpp's integer dots)."""
