"""A tiny random-weight Qwen2-style checkpoint (attention bias, untied embeddings), written by the
test with transformers, loads through the safetensors loader and matches transformers greedily."""

from __future__ import annotations

import pytest
import torch


@pytest.fixture(scope="module")
def qwen2_dir(tmp_path_factory, bundled_gguf):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from llmserve.tokenizer import Tokenizer

    d = tmp_path_factory.mktemp("qwen2")
    torch.manual_seed(0)
    cfg = Qwen2Config(
        vocab_size=49152,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=1024,
        tie_word_embeddings=False,
        rope_theta=10000.0,
        initializer_range=0.2,
        bos_token_id=1,
        eos_token_id=2,
    )
    model = Qwen2ForCausalLM(cfg).eval()
    with torch.no_grad():
        for layer in model.model.layers:
            for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                proj.bias.normal_(0, 0.5)
    model.save_pretrained(d)
    Tokenizer(bundled_gguf, gguf=True).hf.save_pretrained(d)
    return d, model


def test_qwen2_safetensors_greedy_parity(qwen2_dir):
    from llmserve import LLM, SamplingParams

    d, ref = qwen2_dir
    llm = LLM(model=str(d), kv_cache_memory=0.1, max_num_batched_tokens=64)
    assert llm.engine.model_config.architecture == "Qwen2ForCausalLM"
    assert llm.engine.model_config.attention_bias and not llm.engine.model_config.tie_word_embeddings
    tok = llm.get_tokenizer()
    prompts = [tok.encode(t) for t in ["Hello world", "The quick brown fox jumps over the lazy dog. " * 6, "1 2 3 4 5"]]
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=16, ignore_eos=True), use_tqdm=False)
    with torch.inference_mode():
        for p, o in zip(prompts, outs):
            want = ref.generate(
                torch.tensor([p]), max_new_tokens=16, do_sample=False, min_new_tokens=16, pad_token_id=0
            )[0, len(p) :].tolist()
            assert o.outputs[0].token_ids == want


def test_unsupported_architecture_fails_clearly(tmp_path):
    import json

    from llmserve import LLM

    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2"}))
    with pytest.raises(ValueError) as e:
        LLM(model=str(tmp_path))
    assert "unsupported architecture" in str(e.value)
