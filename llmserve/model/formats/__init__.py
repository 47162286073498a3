"""Weight formats: rounded at load (quant.py: --quantization int8 / int4; bf16.py: bfloat16 in oneDNN's layout) or
a GGUF file's own blocks (gguf_layers.py: layers over them; the block types' kernels: kernels/gguf_kernels.py)."""
