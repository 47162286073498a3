"""Peers: llmserve against llama.cpp, vLLM's CPU build and transformers, and load clients we did not write."""
