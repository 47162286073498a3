"""benchmarks.make_checkpoint's gpt-oss GGUF writer (the gpt-oss-20b-shaped random MXFP4_MOE file of the issue's
benchmark): its tiny shape's file loads in llmserve with llama.cpp's names and metadata read as a gpt-oss model (the
experts kept as MXFP4 blocks, the rest Q8_0) and generates finite tokens; the 20b plan has the published model's
tensors and sizes, every one of them read by llmserve, at weight scales that keep activations finite. The 20b file
itself (12 GB) is written by hand only."""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest

from benchmarks.gguf_checkpoint import _random_rows, gpt_oss_tensors, write_gpt_oss_gguf
from benchmarks.make_checkpoint import GPT_OSS_SHAPES, VOCAB


def test_tiny_file_loads_and_generates(tmp_path, monkeypatch):
    from llmserve import LLM, SamplingParams
    from llmserve.model.kernels import ops
    from llmserve.model.loader import gguf_model

    monkeypatch.setenv("LLMSERVE_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(gguf_model, "WIDEN_GGUF_BYTES", 0)  # (the blocks kept, as the 20b file's are)
    path = write_gpt_oss_gguf(GPT_OSS_SHAPES["gpt-oss-tiny"], str(tmp_path))
    llm = LLM(model=path, kv_cache_memory=0.05, max_num_batched_tokens=32, num_threads=2)
    cfg, model = llm.engine.model_config, llm.engine.model
    shape = GPT_OSS_SHAPES["gpt-oss-tiny"]
    assert cfg.architecture == "GptOssForCausalLM" and cfg.vocab_size == shape["vocab_size"] == VOCAB + 128
    assert cfg.num_experts == 4 and cfg.num_experts_per_tok == 2 and cfg.attn_sinks and cfg.o_proj_bias
    assert cfg.sliding_layers == (True, False) and cfg.sliding_window == 16
    assert cfg.rope_scaling["rope_type"] == "yarn" and cfg.rope_scaling["factor"] == 32.0
    assert model.layers[1].mlp.experts[3].gate_up_proj.qtypes == [39, 39]  # MXFP4
    assert model.layers[1].mlp.experts[3].down_proj.qtypes == [39]
    assert model.layers[0].self_attn.qkv_proj.qtypes == [8, 8, 8]  # Q8_0
    assert llm.engine.tokenizer.vocab_size == VOCAB + 128  # (the bundled tokenizer, padded)
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=1)
    prompts = ["The capital of France is", "Once upon a time " * 8]  # (the second one outgrows the window)
    for out in llm.generate(prompts, params, use_tqdm=False):
        assert len(out.outputs[0].token_ids) == 8
        assert all(math.isfinite(lp.logprob) for lp in out.outputs[0].logprobs)
    assert llm.engine.kv.usage == 0
    # the default mode of a quantized GGUF (the test suite's LLMSERVE_GGUF_BLOCKS=0 turns it off): where the VNNI
    # kernels run (the instructions, or their portable twin: LLMSERVE_VNNI=twin), the experts' MXFP4 blocks are
    # repacked at load into panels of 16 rows, and the greedy tokens are those of the file's blocks row by row
    fast = LLM(model=path, kv_cache_memory=0.05, max_num_batched_tokens=32, num_threads=2, quantization="gguf")
    expert = fast.engine.model.layers[1].mlp.experts[3]
    mx = "mx16" if ops.kquant_repack(39, 96) else "gguf"
    assert expert.gate_up_proj.layouts == [mx, mx] and expert.down_proj.layouts == [mx]
    greedy = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    tokens = [out.outputs[0].token_ids for out in fast.generate(prompts, greedy, use_tqdm=False)]
    assert all(len(t) == 8 for t in tokens)
    if mx == "mx16":
        saved = ops.kernel_config()
        try:
            blocks = LLM(
                model=path,
                kv_cache_memory=0.05,
                max_num_batched_tokens=32,
                num_threads=2,
                quantization="gguf",
                kernels=dataclasses.replace(saved, kquant_repack=False),
            )
            assert blocks.engine.model.layers[1].mlp.experts[3].down_proj.layouts == ["gguf"]
            assert [out.outputs[0].token_ids for out in blocks.generate(prompts, greedy, use_tqdm=False)] == tokens
        finally:
            ops.configure(saved)


def test_20b_plan_is_the_published_model():
    """24 layers of 32 experts of 2880: ~20.9B parameters (OpenAI's count), ~12 GB as MXFP4_MOE (llama.cpp's
    gpt-oss-20b files); llmserve reads every tensor (none is left over)."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    from llmserve.model.loader import gguf_hf_names
    from llmserve.model.registry import ARCHITECTURES

    c = GPT_OSS_SHAPES["gpt-oss-20b"]
    plan = gpt_oss_tensors(c)
    params = sum(math.prod(dims) for _, dims, _ in plan)
    size = 0
    for _, dims, qtype in plan:
        block, nbytes = GGML_QUANT_SIZES[GGMLQuantizationType[qtype]]
        size += math.prod(dims) // block * nbytes
    assert 20.8e9 < params < 21.0e9 and 11.9e9 < size < 12.2e9
    spec = ARCHITECTURES["gpt_oss"].gguf
    assert all(gguf_hf_names(name, spec, c["num_local_experts"]) for name, _, _ in plan)
    assert len({name for name, _, _ in plan}) == len(plan) == 2 + 1 + 19 * 24


@pytest.mark.parametrize("qtype", ["MXFP4", "Q8_0"])
def test_random_weights_keep_activations_finite(qtype):
    """A 20b expert's or attention matrix's rows (2880 wide) dequantize to values of standard deviation ~0.02:
    a unit-RMS input comes out of each at about unit RMS, so 24 layers stay finite."""
    from gguf import GGMLQuantizationType, quants

    rows = _random_rows("blk.0.x.weight", (64, 2880), qtype, np.random.default_rng(0))
    w = quants.dequantize(rows, GGMLQuantizationType[qtype])
    assert w.shape == (64, 2880) and 0.01 < w.std() < 0.03
    x = np.random.default_rng(1).standard_normal(2880).astype(np.float32)
    assert 0.5 < np.sqrt(np.mean((w @ x) ** 2)) < 2.0


def test_llama_file_written_straight_loads(tmp_path):
    """make_checkpoint --gguf-only's first step: a Llama Q8_0 file written with llama.cpp's names and metadata loads
    as the shape it was given and generates."""
    from benchmarks.gguf_checkpoint import write_llama_gguf
    from benchmarks.make_checkpoint import SHAPES
    from llmserve import LLM, SamplingParams

    shape = {**SHAPES["tiny"], "vocab_size": VOCAB, "rope_theta": 500000.0, "max_position_embeddings": 2048}
    llm = LLM(model=write_llama_gguf(shape, str(tmp_path)), kv_cache_memory=0.05, num_threads=2)
    cfg = llm.engine.model_config
    assert cfg.architecture == "LlamaForCausalLM" and cfg.vocab_size == VOCAB and cfg.tie_word_embeddings
    assert (cfg.hidden_size, cfg.num_layers, cfg.num_kv_heads, cfg.head_dim) == (256, 4, 2, 64)
    assert cfg.rope_theta == 500000.0
    out = llm.generate(["Hello there"], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, logprobs=1))
    assert len(out[0].outputs[0].token_ids) == 4
    assert all(math.isfinite(lp.logprob) for lp in out[0].outputs[0].logprobs)


def test_qwen3_moe_file_written_straight_loads(tmp_path, monkeypatch):
    """make_checkpoint's Qwen3-MoE shapes (the issue's Qwen3-30B-A3B-shaped file): a Q8_0 file with llama.cpp's
    qwen3moe names and metadata (3-D `ffn_*_exps`, a float32 router, q / k norms) loads as that shape, every layer
    routed, the experts kept as their blocks, and generates finite tokens."""
    from benchmarks.gguf_checkpoint import write_qwen3_moe_gguf
    from benchmarks.make_checkpoint import QWEN3_MOE_SHAPES
    from llmserve import LLM, SamplingParams
    from llmserve.model.layers.moe import SparseMoE
    from llmserve.model.loader import gguf_model

    monkeypatch.setattr(gguf_model, "WIDEN_GGUF_BYTES", 0)  # (the blocks kept, as the 30B file's are)
    c = {**QWEN3_MOE_SHAPES["qwen3-moe-tiny"], "vocab_size": VOCAB, "rope_theta": 1e6, "max_position_embeddings": 2048}
    llm = LLM(model=write_qwen3_moe_gguf(c, str(tmp_path)), kv_cache_memory=0.05, num_threads=2)
    cfg, model = llm.engine.model_config, llm.engine.model
    assert cfg.architecture == "Qwen3MoeForCausalLM" and cfg.vocab_size == VOCAB and not cfg.tie_word_embeddings
    assert (cfg.num_experts, cfg.num_experts_per_tok, cfg.moe_intermediate_size) == (8, 2, 256)
    assert cfg.norm_topk_prob and cfg.rope_theta == 1e6 and cfg.moe_layers == (True, True)
    assert all(isinstance(layer.mlp, SparseMoE) for layer in model.layers)
    assert model.layers[1].mlp.experts[7].gate_up_proj.qtypes == [8, 8]  # Q8_0, as written
    out = llm.generate(["Hello there"], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, logprobs=1))
    assert len(out[0].outputs[0].token_ids) == 4
    assert all(math.isfinite(lp.logprob) for lp in out[0].outputs[0].logprobs)
    assert llm.engine.kv.usage == 0


def test_qwen3_30b_a3b_plan_is_the_published_shape():
    """48 layers of 128 experts of 768 over 2048: ~30B parameters (Qwen's 30.5B less the vocabulary's difference),
    ~2.9B of them active a token (8 experts; Qwen's 3.3B with its vocabulary); llmserve reads every tensor."""
    from benchmarks.gguf_checkpoint import qwen3_moe_tensors
    from benchmarks.make_checkpoint import QWEN3_MOE_SHAPES
    from llmserve.model.loader import gguf_hf_names
    from llmserve.model.registry import ARCHITECTURES

    c = {**QWEN3_MOE_SHAPES["qwen3-30b-a3b"], "vocab_size": VOCAB}
    plan = qwen3_moe_tensors(c)
    params = sum(math.prod(dims) for _, dims, _ in plan)
    experts = sum(math.prod(dims) for name, dims, _ in plan if "_exps" in name)
    active = params - experts + experts * c["num_experts_per_tok"] // c["num_experts"]
    assert 29.9e9 < params < 30.3e9 and 2.8e9 < active < 3.0e9
    spec = ARCHITECTURES["qwen3_moe"].gguf
    assert all(gguf_hf_names(name, spec, c["num_experts"]) for name, _, _ in plan)
    assert len({name for name, _, _ in plan}) == len(plan) == 3 + 12 * 48


# llama-quantize's Q4_K_M of a 48-layer qwen3moe file (read off one it wrote, 2026-12-07): the layers whose attn_v and
# ffn_down_exps it gives Q6_K; every other matrix Q4_K but the output (Q6_K)
Q6_K_LAYERS_48 = {0, 1, 2, 3, 4, 5, 8, 11, 14, 17, 20, 23, 26, 29, 32, 35, 38, 41, 42, 43, 44, 45, 46, 47}


def test_q4_k_m_written_straight_types_as_llama_quantize(tmp_path, monkeypatch):
    """make_checkpoint --shape qwen3-30b-a3b --gguf Q4_K_M writes the file straight (an hour of llama-quantize saved
    on 2 cores): each tensor of the type llama-quantize gives it, and the random Q4_K / Q6_K blocks dequantize to
    weights of std ~0.02 around 0; a small file of that layout loads in llmserve on its own blocks and generates."""
    from gguf import GGMLQuantizationType, GGUFReader, quants

    from benchmarks.gguf_checkpoint import q4_k_m_type, write_qwen3_moe_gguf
    from llmserve import LLM, SamplingParams
    from llmserve.model.loader import gguf_model

    for i in range(48):
        for name in ("attn_v.weight", "ffn_down_exps.weight"):
            assert q4_k_m_type(f"blk.{i}.{name}", 48) == ("Q6_K" if i in Q6_K_LAYERS_48 else "Q4_K")
        for name in ("attn_q", "attn_k", "attn_output", "ffn_gate_exps", "ffn_up_exps"):
            assert q4_k_m_type(f"blk.{i}.{name}.weight", 48) == "Q4_K"
    assert q4_k_m_type("output.weight", 48) == "Q6_K" and q4_k_m_type("token_embd.weight", 48) == "Q4_K"
    for qtype in ("Q4_K", "Q6_K"):
        rows = _random_rows("blk.0.x.weight", (64, 2048), qtype, np.random.default_rng(0))
        w = quants.dequantize(rows, GGMLQuantizationType[qtype])
        assert w.shape == (64, 2048) and 0.015 < w.std() < 0.025 and abs(w.mean()) < 0.002
    monkeypatch.setattr(gguf_model, "WIDEN_GGUF_BYTES", 0)
    monkeypatch.setenv("LLMSERVE_GGUF_BLOCKS", "1")  # (the default outside the test suite: tests/conftest.py)
    c = dict(hidden_size=256, intermediate_size=512, num_hidden_layers=8, num_attention_heads=4, num_key_value_heads=2,
             head_dim=64, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=256, vocab_size=VOCAB,
             rope_theta=1e6, max_position_embeddings=2048)  # fmt: skip
    path = write_qwen3_moe_gguf(c, str(tmp_path), quant="Q4_K_M")
    types = {t.name: t.tensor_type for t in GGUFReader(path).tensors}
    assert types["blk.0.ffn_down_exps.weight"] == GGMLQuantizationType.Q6_K == types["output.weight"]
    assert types["blk.2.ffn_down_exps.weight"] == GGMLQuantizationType.Q4_K == types["blk.0.ffn_up_exps.weight"]
    llm = LLM(model=path, kv_cache_memory=0.05, num_threads=2)
    assert llm.engine.config.quantization == "gguf"
    out = llm.generate(["Hello there"], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, logprobs=1))
    assert all(math.isfinite(lp.logprob) for lp in out[0].outputs[0].logprobs)
