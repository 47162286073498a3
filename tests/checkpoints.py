"""Small random Llama checkpoints with the bundled model's vocabulary and tokenizer, written by the tests
that need a Hugging Face folder of their own (drafts, adapters' bases, a models directory, the disk tier)."""

from __future__ import annotations


def tiny_llama(path, bundled_gguf: str, *, seed: int = 0, **config):
    """Write a random Llama to `path` (config.json + safetensors + the bundled tokenizer) and return the
    transformers model. `config` overrides the LlamaConfig fields below (hidden_size, num_hidden_layers, ...)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from llmserve.tokenizer import Tokenizer

    fields = dict(
        vocab_size=49152,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=2048,
        tie_word_embeddings=True,
        bos_token_id=1,
        eos_token_id=2,
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(LlamaConfig(**{**fields, **config})).eval()
    model.save_pretrained(path)
    Tokenizer(bundled_gguf, gguf=True).hf.save_pretrained(path)
    return model
