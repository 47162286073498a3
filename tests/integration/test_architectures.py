"""Every supported architecture on a tiny random checkpoint written by transformers (config class +
save_pretrained, no hub): llmserve's greedy tokens equal transformers' (eager attention, float32),
batched and alone, with chunked prefill and prefix caching on; prompts outgrow the sliding windows."""

from __future__ import annotations

import json

import pytest
import torch

from llmserve import LLM, SamplingParams

VOCAB, MAX_TOKENS = 49152, 12
SMALL = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=0,
    initializer_range=0.15,
)
GRANITE = dict(embedding_multiplier=3.0, attention_multiplier=0.05, residual_multiplier=0.4, logits_scaling=4.0)

ENGINE = {"phi4-mini-short": dict(max_model_len=64)}  # a row's engine arguments beyond the common ones
FUSED_STACK = {"phi4-mini", "phi4-mini-short", "granite"}  # rows whose decode steps run the fused C++ decode stack
HYBRID = {"lfm2", "granite-hybrid"}  # rows with recurrent layers: prefix caching is off for them (engine/state_pool.py)
# rows whose random logits are near-uniform (Granite's logits_scaling 4: top-1 logprob -9.5 against a uniform -10.8,
# the top 5 within 0.11 nats): a top-5 rule there measures noise, so bfloat16's change of the first token's logprobs
# is bounded instead (measured 0.006-0.013 nats, below the Llama row's 0.03-0.08)
FLAT = {"granite-hybrid"}
ADAPTED = (
    "phi4-mini",
    "granite",
    "granite-bias",
    "glm4",
)  # rows whose loaded weights differ from the checkpoint's (LlamaModel.adapt_weight)


def _longrope(original: int, pairs: int = 24) -> dict:
    return {
        "rope_type": "longrope",
        "short_factor": [1.0 + i / 8 for i in range(pairs)],
        "long_factor": [2.0 + i for i in range(pairs)],
        "original_max_position_embeddings": original,
    }


def _configs():
    import transformers as T

    moe = dict(num_experts_per_tok=2)
    phi4 = dict(hidden_size=256, partial_rotary_factor=0.75)
    return {
        "llama3-rope": (
            T.LlamaConfig,
            dict(
                rope_scaling={
                    "rope_type": "llama3",
                    "factor": 8.0,
                    "low_freq_factor": 1.0,
                    "high_freq_factor": 4.0,
                    "original_max_position_embeddings": 32,
                    "rope_theta": 10000.0,
                }
            ),
        ),
        "mistral-sliding": (T.MistralConfig, dict(sliding_window=24, head_dim=16)),
        "qwen2": (T.Qwen2Config, dict(tie_word_embeddings=False)),  # (attention bias: the family's spec)
        "qwen3": (T.Qwen3Config, dict(head_dim=32, tie_word_embeddings=False)),
        "phi3": (T.Phi3Config, dict()),
        # Phi-4-mini: a quarter of each head (64 wide: a size the fused decode stack runs) passes unrotated;
        # longrope: every prompt is longer than the original positions (transformers' long factors throughout),
        # with its attention factor (2 here)
        "phi4-mini": (T.Phi3Config, dict(phi4, rope_scaling=_longrope(4))),
        # and served within the original positions (ENGINE's max_model_len): the short factors
        "phi4-mini-short": (T.Phi3Config, dict(phi4, rope_scaling=_longrope(64))),
        # Granite 3.x: every multiplier away from 1 (64-wide heads: through the fused decode stack)
        "granite": (
            T.GraniteConfig,
            dict(hidden_size=256, **GRANITE),
        ),
        # and with attention_bias: q / k / v / o biases (the o_proj one folded with the residual multiplier too), on
        # the module path (the fused decode stack takes no biases)
        "granite-bias": (T.GraniteConfig, dict(GRANITE, attention_bias=True)),
        # SmolLM3: the second of two layers without rotary (transformers' default: every 4th)
        "smollm3": (T.SmolLM3Config, dict(no_rope_layer_interval=2)),
        # OLMo 2: post-norms only, q / k norms over the whole projection (their weights random: per-head ones differ)
        "olmo2": (T.Olmo2Config, dict(tie_word_embeddings=False)),
        "olmo2-bias": (T.Olmo2Config, dict(tie_word_embeddings=False, attention_bias=True)),  # (q / k / v / o biases)
        # GLM-4: interleaved rotary over half of each head, q / k / v biases, four norms a layer
        "glm4": (T.Glm4Config, dict(head_dim=16, partial_rotary_factor=0.5, attention_bias=True)),
        # LFM2: gated short-convolution layers (a state per sequence, carried across the prompts' chunks) around an
        # attention layer with q / k norms; the MLP's width adjusted from intermediate_size (to 96 here)
        "lfm2": (
            T.Lfm2Config,
            dict(num_hidden_layers=3, layer_types=["conv", "full_attention", "conv"], block_multiple_of=32),
        ),
        "mixtral": (T.MixtralConfig, dict(num_local_experts=4, **moe)),
        "qwen3-moe": (
            T.Qwen3MoeConfig,
            dict(
                num_experts=4,
                moe_intermediate_size=48,
                head_dim=16,
                norm_topk_prob=True,
                decoder_sparse_step=1,
                mlp_only_layers=[1],
                **moe,
            ),
        ),
        "qwen3-moe-unnormed": (
            T.Qwen3MoeConfig,
            dict(num_experts=4, moe_intermediate_size=48, head_dim=16, norm_topk_prob=False, **moe),
        ),
        # gpt-oss: sinks, a sliding layer then a full one (transformers' alternation; the window shorter than the
        # prompts), q / k / v / o biases, 64-wide heads (the kernels' size), biased router and experts, a SwiGLU limit
        # low enough to clamp
        "gpt-oss": (
            T.GptOssConfig,
            dict(num_local_experts=4, sliding_window=24, swiglu_limit=1.0, **moe),
        ),
        "gemma2": (
            T.Gemma2Config,
            dict(
                head_dim=16,
                sliding_window=24,
                query_pre_attn_scalar=24,
                layer_types=["sliding_attention", "full_attention"],
                attn_logit_softcapping=0.5,
                final_logit_softcapping=2.0,
            ),
        ),
        "gemma3": (
            T.Gemma3TextConfig,
            dict(
                head_dim=16,
                sliding_window=24,
                query_pre_attn_scalar=24,
                layer_types=["sliding_attention", "full_attention"],
                rope_parameters={
                    "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                    "full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 1000000.0},
                },
            ),
        ),
        # Granite 4.0-H: Mamba-2 mixers around an attention layer (rotary), experts beside a shared MLP, Granite's
        # multipliers (more in test_granite_hybrid.py)
        "granite-hybrid": (
            T.GraniteMoeHybridConfig,
            dict(
                num_hidden_layers=3,
                layer_types=["mamba", "attention", "mamba"],
                num_local_experts=4,
                position_embedding_type="rope",
                shared_intermediate_size=64,
                mamba_n_heads=4,
                mamba_d_state=16,
                mamba_chunk_size=8,
                embedding_multiplier=3.0,
                attention_multiplier=0.05,
                residual_multiplier=0.4,
                logits_scaling=4.0,
                **moe,
            ),
        ),
    }


ARCHS = list(_configs())


def test_every_registered_family_has_a_row():
    """A new architecture is one spec in llmserve.model.registry and one row above (docs/contributing.md)."""
    from llmserve.model.registry import ARCHITECTURES

    text_only = {t for t, s in ARCHITECTURES.items() if s.images is None}  # (vision ones: test_vision.py's rows)
    assert {cls.model_type for cls, _ in _configs().values()} == text_only


def _prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(1)
    shared = torch.randint(3, VOCAB, (40,), generator=g).tolist()
    return [
        torch.randint(3, VOCAB, (5,), generator=g).tolist(),
        shared + torch.randint(3, VOCAB, (9,), generator=g).tolist(),  # longer than the token budget
        shared + torch.randint(3, VOCAB, (3,), generator=g).tolist(),  # the same prefix: cached blocks
        torch.randint(3, VOCAB, (21,), generator=g).tolist(),
    ]


@pytest.fixture(scope="module", params=ARCHS)
def checkpoint(request, tmp_path_factory, bundled_gguf):
    import transformers

    from llmserve.tokenizer import Tokenizer

    cls, extra = _configs()[request.param]
    cfg = cls(**{**SMALL, **extra})
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cfg)
    with torch.no_grad():  # norms away from their initial ones (and zeros, Gemma's), so that mistakes show
        for name, p in model.named_parameters():
            if "norm" in name:
                p.normal_(0.0 if cls in (transformers.Gemma2Config, transformers.Gemma3TextConfig) else 1.0, 0.3)
            elif name.endswith("bias"):  # (and biases away from transformers' zeros: gpt-oss's experts' `_bias`)
                p.normal_(0.0, 0.3)
            elif name.endswith(".sinks"):  # (gpt-oss: large enough to take a visible share of each softmax)
                p.normal_(1.0, 1.0)
    d = tmp_path_factory.mktemp(request.param)
    model.save_pretrained(d)
    Tokenizer(bundled_gguf, gguf=True).hf.save_pretrained(d)
    return (request.param, d, *_transformers_greedy(d))


def _transformers_greedy(folder) -> tuple[list[list[int]], float]:
    """transformers' greedy tokens for _prompts() (float32, eager attention) from `folder`, and the logprob of the
    first prompt's first token."""
    import transformers

    ref = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, attn_implementation="eager")
    with torch.inference_mode():
        want = [
            ref.generate(
                torch.tensor([p]), max_new_tokens=MAX_TOKENS, min_new_tokens=MAX_TOKENS, do_sample=False, pad_token_id=0
            )[0, len(p) :].tolist()
            for p in _prompts()
        ]
        first = _prompts()[0]
        logprob = ref(torch.tensor([first])).logits[0, -1].float().log_softmax(-1)[want[0][0]].item()
    return want, logprob


def greedy_batched_and_alone(llm, prompts: list[list[int]], max_tokens: int) -> tuple[list, list]:
    """llmserve's greedy tokens (EOS ignored) for `prompts` all in one batch, and for each alone."""
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    batched = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    return batched, [llm.generate([p], params, use_tqdm=False)[0].outputs[0].token_ids for p in prompts]


def test_greedy_equals_transformers_batched_and_alone(checkpoint):
    name, d, want, logprob = checkpoint
    llm = LLM(model=str(d), kv_cache_memory=0.05, max_num_batched_tokens=32, num_threads=2, **ENGINE.get(name, {}))
    assert llm.engine.config.enable_prefix_caching == (name not in HYBRID)
    prompts = _prompts()
    batched, alone = greedy_batched_and_alone(llm, prompts, MAX_TOKENS)
    assert batched == want, name
    assert alone == want, name
    assert bool(llm.engine.model._decode_stack) == (name in FUSED_STACK), name
    # with logits (a logprobs row): the same tokens, and the first one's logprob is transformers'
    # (Gemma 2's final soft-capping shows only there: tanh keeps the argmax)
    lp = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=1)
    out = llm.generate(prompts[:1], lp, use_tqdm=False)[0].outputs[0]
    assert out.token_ids == want[0]
    assert out.logprobs[0].logprob == pytest.approx(logprob, abs=1e-4)


def test_bfloat16_default_within_top5_of_float32(checkpoint, monkeypatch):
    """`--dtype auto` on a CPU with native bfloat16 (oneDNN's matmul where this CPU has it, else its portable twin,
    LLMSERVE_CPU_BF16=emulate): every architecture loads and runs in bfloat16, and its greedy tokens are judged as
    vLLM judges reduced precision: at the first one where they part from float32's, each side's is in the other's
    top-5 (FLAT rows: the first token's top-20 logprobs within 0.05 of float32's)."""
    from llmserve.model.evaluate import top_k_broken
    from llmserve.model.formats import bf16

    name, d = checkpoint[0], checkpoint[1]
    monkeypatch.setenv("LLMSERVE_CPU_BF16", "1")
    if not bf16.supported():
        monkeypatch.setenv("LLMSERVE_CPU_BF16", "emulate")
    kw = dict(model=str(d), kv_cache_memory=0.05, max_num_batched_tokens=32, num_threads=2, **ENGINE.get(name, {}))
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=20 if name in FLAT else 5)
    outs = {}
    for dtype in ("auto", "float32"):
        llm = LLM(dtype=dtype, **kw)
        assert llm.engine.dtype is (torch.bfloat16 if dtype == "auto" else torch.float32), name
        outs[dtype] = [o.outputs[0] for o in llm.generate(_prompts(), params, use_tqdm=False)]
        del llm
    assert [o.token_ids for o in outs["float32"]] == checkpoint[2], name  # float32: transformers' tokens
    if name in FLAT:  # no top-5 rule over a flat distribution: bf16's change of the logprobs themselves, bounded
        for a, b in zip(outs["auto"], outs["float32"]):
            la, lb = ({t.token_id: t.logprob for t in o.logprobs[0].top} for o in (a, b))
            assert max(abs(la[t] - lb[t]) for t in la.keys() & lb.keys()) <= 0.05, name
        return
    broken = top_k_broken(outs["auto"], outs["float32"], k=5)
    assert not broken, (name, broken)


@pytest.mark.parametrize("mode", ["int8", "int4"])
def test_quantized_new_layers_run(checkpoint, mode):
    """--quantization through quant.py's interface (norms and MoE routers stay float; the experts are
    quantized): every token comes back; layers whose weights the model adapts are rounded from the adapted ones."""
    if checkpoint[0] not in ("qwen3", "phi3", *ADAPTED, "mixtral", "gemma2", "olmo2", "glm4", "gpt-oss"):
        pytest.skip("one of each kind of layer is enough")
    llm = LLM(
        model=str(checkpoint[1]), kv_cache_memory=0.05, max_num_batched_tokens=32, quantization=mode, num_threads=2
    )
    outs = llm.generate(
        _prompts(), SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True), use_tqdm=False
    )
    assert all(len(o.outputs[0].token_ids) == MAX_TOKENS for o in outs)
    from llmserve.model.formats.quant import QuantLinear

    layer = llm.engine.model.layers[0]
    assert isinstance(layer.self_attn.qkv_proj, QuantLinear)
    if checkpoint[0] in ("mixtral", "gpt-oss"):  # (gpt-oss's experts with their biases)
        assert isinstance(layer.mlp.experts[0].gate_up_proj, QuantLinear)
    if checkpoint[0] in ADAPTED:  # rounded from the weights as the float model holds them (not the checkpoint's)
        ref = LLM(model=str(checkpoint[1]), kv_cache_memory=0.05, num_threads=2).engine.model.layers[0]
        for got, want in ((layer.self_attn.qkv_proj, ref.self_attn.qkv_proj), (layer.mlp.down_proj, ref.mlp.down_proj)):
            x = torch.randn(3, want.in_features)
            assert (got(x) - want(x)).norm() < 0.25 * want(x).norm(), checkpoint[0]


def _write_gguf(folder, path: str, arch: str, bundled_gguf: str) -> None:
    """The checkpoint in `folder` as a float32 GGUF file of `arch`, with the bundled model's tokenizer."""
    import numpy as np
    from gguf import GGUFReader, GGUFValueType, GGUFWriter
    from safetensors.torch import load_file

    from llmserve.model.registry import gguf_family

    cfg = json.loads((folder / "config.json").read_text())
    w = GGUFWriter(path, arch)
    w.add_block_count(cfg["num_hidden_layers"])
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(cfg["hidden_size"])
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(cfg["num_attention_heads"])
    w.add_head_count_kv(cfg["num_key_value_heads"])
    w.add_key_length(cfg["head_dim"])
    w.add_value_length(cfg["head_dim"])
    w.add_rope_freq_base(cfg.get("rope_parameters", {}).get("rope_theta", 10000.0))
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    for key, f in GGUFReader(bundled_gguf).fields.items():
        if key.startswith("tokenizer."):
            w.add_key_value(key, f.contents(), f.types[0], f.types[-1] if f.types[0] == GGUFValueType.ARRAY else None)
    spec = gguf_family(arch).gguf
    names = {v: k for k, v in spec.names.items()}
    layer_names = {v: k for k, v in spec.layer_names.items()}
    for name, t in load_file(folder / "model.safetensors").items():
        if name not in names:  # model.layers.N.<layer>.weight -> blk.N.<gguf layer>.weight
            parts = name.split(".")
            names[name] = f"blk.{parts[2]}.{layer_names['.'.join(parts[3:-1])]}.{parts[-1]}"
        w.add_tensor(names[name], t.numpy().astype(np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def test_qwen3_from_gguf(checkpoint, tmp_path, monkeypatch, bundled_gguf):
    """The same Qwen3 weights written as a GGUF file (llama.cpp's names: attn_q_norm, attn_k_norm)."""
    name, d, want, _ = checkpoint
    if name != "qwen3":
        pytest.skip("the Qwen3 checkpoint only")
    monkeypatch.setenv("LLMSERVE_CACHE_DIR", str(tmp_path / "cache"))
    path = str(tmp_path / "qwen3-tiny.gguf")
    _write_gguf(d, path, "qwen3", bundled_gguf)
    llm = LLM(model=path, kv_cache_memory=0.05, max_num_batched_tokens=32, num_threads=2)
    assert llm.engine.model_config.architecture == "Qwen3ForCausalLM" and llm.engine.model_config.qk_norm
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    assert [o.outputs[0].token_ids for o in llm.generate(_prompts(), params, use_tqdm=False)] == want


def mxfp4_folders(d, root, seed: int = 3) -> dict:
    """A gpt-oss checkpoint folder `d` as OpenAI ships it, its experts' weights in MXFP4 (`*_blocks`: random E2M1
    codes, `*_scales`: an E8M0 exponent per 32, with quantization_config), and the same experts dequantized by
    transformers' own MXFP4 code (float32): {"mxfp4": folder, "dense": folder}, under `root`."""
    import shutil

    from safetensors.torch import load_file, save_file
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    g = torch.Generator().manual_seed(seed)
    mxfp4, dense = {}, {}
    for k, t in load_file(d / "model.safetensors").items():
        if not k.endswith(("experts.gate_up_proj", "experts.down_proj")):
            mxfp4[k] = dense[k] = t
            continue
        experts, k_in, n_out = t.shape
        blocks = torch.randint(0, 256, (experts, n_out, k_in // 32, 16), generator=g, dtype=torch.uint8)
        scales = torch.randint(121, 125, (experts, n_out, k_in // 32), generator=g, dtype=torch.uint8)
        mxfp4[f"{k}_blocks"], mxfp4[f"{k}_scales"] = blocks, scales
        dense[k] = convert_moe_packed_tensors(blocks, scales, dtype=torch.float32).contiguous()
    folders = {}
    for kind, tensors in (("mxfp4", mxfp4), ("dense", dense)):
        folders[kind] = f = root / kind
        shutil.copytree(d, f)
        save_file(tensors, f / "model.safetensors", metadata={"format": "pt"})
    cfg = json.loads((folders["mxfp4"] / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": ["model.layers.*.self_attn"]}
    (folders["mxfp4"] / "config.json").write_text(json.dumps(cfg))
    return folders


def test_gpt_oss_mxfp4_experts(checkpoint, tmp_path):
    """gpt-oss as OpenAI ships it: the experts' weights in MXFP4 (mxfp4_folders). llmserve keeps them as GGUF MXFP4
    blocks (GGUFLinear, read by the GGUF kernels, float32-exact without --quantization) and its greedy tokens equal
    transformers' on the same experts dequantized by transformers' own MXFP4 code; with --quantization int8 the
    blocks stay and run llama.cpp's integer dots."""
    from llmserve.model.formats.gguf_layers import GGUFLinear

    name, d = checkpoint[:2]
    if name != "gpt-oss":
        pytest.skip("the gpt-oss checkpoint only")
    folders = mxfp4_folders(d, tmp_path)
    want, _ = _transformers_greedy(folders["dense"])
    llm = LLM(model=str(folders["mxfp4"]), kv_cache_memory=0.05, max_num_batched_tokens=32, num_threads=2)
    experts = llm.engine.model.layers[1].mlp.experts
    assert isinstance(experts[3].gate_up_proj, GGUFLinear) and experts[3].gate_up_proj.qtypes == [39, 39]
    assert isinstance(experts[3].down_proj, GGUFLinear) and experts[3].down_proj.exact
    batched, alone = greedy_batched_and_alone(llm, _prompts(), MAX_TOKENS)
    assert batched == want and alone == want
    del llm
    llm = LLM(model=str(folders["mxfp4"]), kv_cache_memory=0.05, quantization="int8", num_threads=2)
    proj = llm.engine.model.layers[0].mlp.experts[0].down_proj
    assert isinstance(proj, GGUFLinear) and not proj.exact
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    assert all(len(o.outputs[0].token_ids) == MAX_TOKENS for o in llm.generate(_prompts(), params, use_tqdm=False))


def test_unknown_architecture_names_it_and_the_supported_ones(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2"}))
    with pytest.raises(ValueError) as e:
        LLM(model=str(tmp_path))
    msg = str(e.value)
    assert "GPT2LMHeadModel" in msg and "Qwen3ForCausalLM" in msg and "Gemma2ForCausalLM" in msg


def test_partial_rotary_longrope_tables():
    """Phi-4-mini's rotary: the passed dimensions keep cos 1 / sin 0 (unscaled), the rotated ones take the
    short factors within original_max_position_embeddings and the long ones beyond, times the attention factor."""
    import math

    import transformers

    from llmserve.model.layers import Rotary, head_order
    from llmserve.model.registry import config_from_hf

    rope = {"rope_type": "longrope", "short_factor": [1.0] * 4, "long_factor": [2.0] * 4}
    hf = transformers.Phi3Config(
        **SMALL, partial_rotary_factor=0.5, original_max_position_embeddings=64, rope_scaling=rope
    )
    cfg = config_from_hf(hf)
    assert head_order(cfg).tolist() == [0, 1, 2, 3, 8, 9, 10, 11, 4, 5, 6, 7, 12, 13, 14, 15]
    scale = math.sqrt(1 + math.log(256 / 64) / math.log(64))
    inv = 1.0 / 10000.0 ** (torch.arange(0, 8, 2).float() / 8)
    for positions, factor in ((65, 1.0), (256, 2.0)):  # (a spare row for a verified proposal: still short)
        rot = Rotary(cfg, positions)
        assert torch.equal(rot.cos[:, 4:8], torch.ones(positions, 4))
        assert torch.equal(rot.sin[:, 12:], torch.zeros(positions, 4))
        assert torch.allclose(rot.cos[49, :4], (49 * inv / factor).cos() * scale)
        assert torch.allclose(rot.sin[49, 8:12], (49 * inv / factor).sin() * scale)


def test_tensor_parallel_refuses_what_it_cannot_split():
    import dataclasses

    from llmserve.model.config import ModelConfig
    from llmserve.model.parallel import plan_heads

    base = ModelConfig("LlamaForCausalLM", 100, 128, 256, 2, 4, 2, 32, 1e-5, 1e4, 128, False)
    assert len(plan_heads(base, 2)) == 2
    for cfg in (
        dataclasses.replace(base, architecture="MixtralForCausalLM", num_experts=4),
        dataclasses.replace(base, architecture="Phi3ForCausalLM"),
    ):
        with pytest.raises(ValueError, match="not split yet"):
            plan_heads(cfg, 2)
