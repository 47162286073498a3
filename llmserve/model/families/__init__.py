"""The model families whose blocks are their own: Llama's decoder with features (llama.py, the base of every
other), gpt-oss's expert tensors (gpt_oss.py), the hybrid ones with recurrent layers (lfm2.py, granite_hybrid.py).
Each family's spec (config fields, GGUF names, renames) is its `ArchSpec` in llmserve/model/specs/<family>.py."""
