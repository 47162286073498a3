"""Gemma 2, Gemma 3 (text), Phi-3 / Phi-4-mini, Qwen3-MoE, Mixtral, Granite, SmolLM3, OLMo 2, GLM-4, gpt-oss, LFM2 and
Granite 4.0-H from GGUF files written as llama.cpp's converter writes them (tests/gguf_files.write_checkpoint_gguf:
gguf's own tensor names, Gemma's 1 + w norms, Phi-3's fused attn_qkv / ffn_up, merged ffn_*_exps experts, Mixtral as
`llama` with experts, longrope factors as tensors, LFM2's squeezed conv weights, Granite 4.0-H's ssm_* tensors with
A stored as -exp(A_log) and the per-group norm), from a tiny random transformers
checkpoint, in float32 and Q8_0. llmserve's greedy tokens, batched and alone, equal transformers' on the same file
(`from_pretrained(..., gguf_file=...)`, which dequantizes) where transformers reads that architecture's files, else
transformers' on the checkpoint holding the file's values (Qwen3-MoE: transformers' GGUF config lacks the experts'
size; Mixtral: it reads no `llama` experts; Phi-4-mini, Granite, SmolLM3, OLMo 2, GLM-4, gpt-oss, Granite 4.0-H: it
reads none of their files)."""

from __future__ import annotations

import pytest
import torch

from llmserve import LLM, SamplingParams
from llmserve.model.formats.gguf_layers import GGUFLinear
from tests.gguf_files import round_trip_model, write_checkpoint_gguf
from tests.integration.test_architectures import GRANITE, SMALL, _longrope, greedy_batched_and_alone

MAX_TOKENS, VOCAB = 12, 1024
TINY = {**SMALL, "vocab_size": VOCAB}  # the bundled tokenizer's first 1024 tokens: files parse in milliseconds
ARCHITECTURES = {
    "gemma2": "Gemma2ForCausalLM",
    "gemma3": "Gemma3ForCausalLM",
    "phi3": "Phi3ForCausalLM",
    "qwen3moe": "Qwen3MoeForCausalLM",
    "mixtral": "MixtralForCausalLM",
    "phi4-mini": "Phi3ForCausalLM",
    "granite": "GraniteForCausalLM",
    "granite-bias": "GraniteForCausalLM",
    "smollm3": "SmolLM3ForCausalLM",
    "olmo2": "Olmo2ForCausalLM",
    "olmo2-bias": "Olmo2ForCausalLM",
    "glm4": "Glm4ForCausalLM",
    "gpt-oss": "GptOssForCausalLM",
    "lfm2": "Lfm2ForCausalLM",
    "granite-hybrid": "GraniteMoeHybridForCausalLM",
}
# query_pre_attn_scalar = head_dim: llama.cpp's scale (it stores none); transformers' GGUF default is 256
GEMMA = dict(head_dim=256, query_pre_attn_scalar=256, sliding_window=24)
# Granite 4.0-H: an attention layer (no positions: the converter writes rope.scaling.finetuned false for a model with
# mixers) and two Mamba-2 mixers of two groups; experts beside the shared MLP; the multipliers
GRANITE_HYBRID = dict(
    GRANITE,
    num_hidden_layers=3,
    layer_types=["attention", "mamba", "mamba"],
    num_local_experts=4,
    num_experts_per_tok=2,
    shared_intermediate_size=64,
    mamba_n_heads=4,
    mamba_d_state=16,
    mamba_n_groups=2,
    position_embedding_type=None,
    eos_token_id=0,  # (transformers' min_new_tokens masks it: not 2, which this model's argmax hits)
)


def _cases():
    import transformers as T

    return {  # name: (config class, fields, GGUF architecture, transformers reads the GGUF)
        "gemma2": (T.Gemma2Config, dict(GEMMA), "gemma2", True),
        # six layers: llama.cpp's Gemma 3 pattern (five sliding, one global) shows
        "gemma3": (T.Gemma3TextConfig, dict(GEMMA, num_hidden_layers=6), "gemma3", True),
        "phi3": (T.Phi3Config, dict(), "phi3", True),
        "qwen3moe": (
            T.Qwen3MoeConfig,
            dict(num_experts=4, moe_intermediate_size=64, head_dim=16, norm_topk_prob=True, num_experts_per_tok=2),
            "qwen3moe",
            False,
        ),
        "mixtral": (T.MixtralConfig, dict(num_local_experts=4, num_experts_per_tok=2), "llama", False),
        # Phi-4-mini: partial rotary (rope.dimension_count) and longrope's factors as tensors (past the original
        # positions from the start: the long ones), q / k rows of the packed attn_qkv blocks in the model's order
        "phi4-mini": (
            T.Phi3Config,
            dict(partial_rotary_factor=0.75, original_max_position_embeddings=4, rope_scaling=_longrope(4, 6)),
            "phi3",
            False,
        ),
        # Granite: the four multipliers as llama.cpp's *_scale keys; Q / K rows interleaved (the Llama converter's)
        "granite": (T.GraniteConfig, dict(GRANITE), "granite", False),
        # with attention_bias: blk.N.attn_*.bias (Q / K biases interleaved as their rows), no metadata key
        "granite-bias": (T.GraniteConfig, dict(GRANITE, attention_bias=True), "granite", False),
        # SmolLM3: four layers, the fourth without rotary (llama.cpp's fixed step)
        "smollm3": (T.SmolLM3Config, dict(num_hidden_layers=4), "smollm3", False),
        "olmo2": (T.Olmo2Config, dict(tie_word_embeddings=False), "olmo2", False),
        "olmo2-bias": (T.Olmo2Config, dict(tie_word_embeddings=False, attention_bias=True), "olmo2", False),
        # GLM-4: interleaved partial rotary (rope.dimension_count), q / k / v biases, four norms a layer
        "glm4": (T.Glm4Config, dict(head_dim=16, partial_rotary_factor=0.5, attention_bias=True), "glm4", False),
        # gpt-oss: sinks, a sliding and a full layer, biased router and experts split from the fused checkpoint tensors
        # (the SwiGLU limit llama.cpp's: 7)
        "gpt-oss": (
            T.GptOssConfig,
            dict(num_local_experts=4, num_experts_per_tok=2, sliding_window=24),
            "gpt-oss",
            False,
        ),
        # LFM2: an attention layer (q / k norms) and a gated short-convolution layer (shortconv.*, its state carried
        # across chunks); head_count_kv per layer, 0 for the conv layer
        "lfm2": (T.Lfm2Config, dict(layer_types=["full_attention", "conv"], block_multiple_of=32), "lfm2", True),
        "granite-hybrid": (T.GraniteMoeHybridConfig, GRANITE_HYBRID, "granitehybrid", False),
    }


@pytest.fixture(scope="module", params=list(_cases()))
def checkpoint(request, tmp_path_factory):
    import transformers

    cls, extra, arch, hf_reads_gguf = _cases()[request.param]
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cls(**{**TINY, **extra}))
    with torch.no_grad():  # norms away from their initial values, so that a norm read wrongly shows
        for name, p in model.named_parameters():
            if "norm" in name:
                p.normal_(0.0 if arch.startswith("gemma") else 1.0, 0.3)
            elif name.endswith(("bias", ".sinks")):  # (gpt-oss's experts' `_bias`)
                p.normal_(0.0, 0.3)
    d = tmp_path_factory.mktemp(request.param)
    model.save_pretrained(d)
    return request.param, d, arch, hf_reads_gguf


def _prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(1)
    shared = torch.randint(3, VOCAB, (40,), generator=g).tolist()
    return [  # one longer than the token budget and than the sliding windows, two sharing a prefix
        torch.randint(3, VOCAB, (5,), generator=g).tolist(),
        shared + torch.randint(3, VOCAB, (9,), generator=g).tolist(),
        shared + torch.randint(3, VOCAB, (3,), generator=g).tolist(),
        torch.randint(3, VOCAB, (21,), generator=g).tolist(),
    ]


def _reference(d, qtype: str, path: str, hf_reads_gguf: bool) -> list[list[int]]:
    import transformers

    kw = dict(dtype=torch.float32, attn_implementation="eager")
    if hf_reads_gguf:
        ref = transformers.AutoModelForCausalLM.from_pretrained(d, gguf_file=path.rsplit("/", 1)[1], **kw)
    else:
        ref = transformers.AutoModelForCausalLM.from_pretrained(d, **kw)
        round_trip_model(ref, qtype)
    with torch.inference_mode():
        return [
            ref.generate(
                torch.tensor([p]), max_new_tokens=MAX_TOKENS, min_new_tokens=MAX_TOKENS, do_sample=False, pad_token_id=0
            )[0, len(p) :].tolist()
            for p in _prompts()
        ]


@pytest.mark.parametrize("qtype", ["F32", "Q8_0"])
def test_greedy_from_gguf_equals_transformers(checkpoint, qtype, monkeypatch):
    """F32: widened into float32 layers (a model this small, loader.gguf_model.WIDEN_GGUF_BYTES); Q8_0: every weight
    matrix kept as the file's blocks (GGUFLinear, float32-exact), experts one layer each over their rows of
    the merged tensor."""
    from llmserve.model.loader import gguf_model

    name, d, arch, hf_reads_gguf = checkpoint
    path = write_checkpoint_gguf(d, str(d / f"{qtype}.gguf"), arch, qtype)
    want = _reference(d, qtype, path, hf_reads_gguf)
    if qtype != "F32":
        monkeypatch.setattr(gguf_model, "WIDEN_GGUF_BYTES", 0)
    llm = LLM(model=path, kv_cache_memory=0.05, max_num_batched_tokens=32, num_threads=2)
    model = llm.engine.model
    assert model.cfg.architecture == ARCHITECTURES[name]
    mlp = model.layers[0].mlp
    if qtype != "F32":
        assert isinstance(model.layers[0].self_attn.qkv_proj, GGUFLinear)
        expert = mlp.experts[1] if hasattr(mlp, "experts") else mlp
        assert isinstance(expert.gate_up_proj, GGUFLinear)
        # Granite's residual multiplier is folded into o_proj / down_proj: those are read as float32 instead
        assert isinstance(expert.down_proj, GGUFLinear) == (not name.startswith("granite")), name
        if name == "lfm2":  # (the convolution's own weight, [hidden, 3], stays float32 as llama-quantize keeps it)
            assert isinstance(model.layers[1].conv.in_proj, GGUFLinear)
        if name == "granite-hybrid":  # (the mixers' out_proj takes the residual multiplier: read as float32)
            mixer = model.layers[1].mamba
            assert isinstance(mixer.in_proj, GGUFLinear) and not isinstance(mixer.out_proj, GGUFLinear)
            assert isinstance(model.layers[1].shared_mlp.gate_up_proj, GGUFLinear)
    batched, alone = greedy_batched_and_alone(llm, _prompts(), MAX_TOKENS)
    assert batched == want, name
    assert alone == want, name
    assert llm.engine.kv.usage == 0


def test_gpt_oss_mxfp4_file(checkpoint, monkeypatch):
    """A gpt-oss file as llama.cpp's MXFP4_MOE quantization writes it (the experts MXFP4, every other matrix
    Q8_0): each expert kept as its rows of the merged MXFP4 blocks (GGUFLinear, float32-exact), greedy tokens equal
    transformers' on the file's values, batched and alone."""
    from llmserve.model.loader import gguf_model

    name, d, arch, _ = checkpoint
    if name != "gpt-oss":
        pytest.skip("the gpt-oss checkpoint only")
    path = write_checkpoint_gguf(d, str(d / "MXFP4.gguf"), arch, "MXFP4")
    want = _reference(d, "MXFP4", path, False)
    monkeypatch.setattr(gguf_model, "WIDEN_GGUF_BYTES", 0)
    llm = LLM(model=path, kv_cache_memory=0.05, max_num_batched_tokens=32, num_threads=2)
    model = llm.engine.model
    expert = model.layers[0].mlp.experts[1]
    assert expert.gate_up_proj.qtypes == [39, 39] and expert.down_proj.qtypes == [39]
    assert model.layers[1].self_attn.qkv_proj.qtypes == [8, 8, 8]
    batched, alone = greedy_batched_and_alone(llm, _prompts(), MAX_TOKENS)
    assert batched == want and alone == want


def test_config_from_gguf_metadata_is_the_checkpoints(checkpoint):
    """Every feature llmserve runs (sliding layers, soft-capping, sandwich norms, query scale, experts,
    rope tables) read from the file's metadata equals the one read from the checkpoint's config.json."""
    import transformers

    from llmserve.model.layers import Rotary
    from llmserve.model.loader import gguf_hf_config, open_gguf
    from llmserve.model.registry import config_from_hf

    name, d, arch, _ = checkpoint
    path = write_checkpoint_gguf(d, str(d / "config-check.gguf"), arch)
    a = config_from_hf(gguf_hf_config(open_gguf(path), path))
    b = config_from_hf(transformers.AutoConfig.from_pretrained(d))
    for field in a.__dataclass_fields__:
        if field not in ("hf_config", "rms_norm_eps", "eos_token_ids", "bos_token_id"):
            want = getattr(b, field)  # (floats: the file stores them as float32)
            assert getattr(a, field) == (pytest.approx(want, rel=1e-6) if isinstance(want, float) else want), field
    assert a.rms_norm_eps == pytest.approx(b.rms_norm_eps)
    for layer_type in (None, "sliding_attention") if name == "gemma3" else (None,):
        assert torch.equal(Rotary(a, 64, layer_type).cos, Rotary(b, 64, layer_type).cos), (name, layer_type)


def test_gemma3_rope_scaling_and_layer_pattern_from_gguf(tmp_path):
    """Gemma 3's global layers' linear rope scaling and their own theta (rope.freq_base), the sliding layers'
    10000, and the five-sliding-one-global pattern come from the file as llama.cpp reads them."""
    import transformers

    from llmserve.model.families.llama import LlamaModel
    from llmserve.model.loader import gguf_hf_config, open_gguf
    from llmserve.model.registry import config_from_hf

    cfg = transformers.Gemma3TextConfig(
        **{**TINY, **GEMMA, "num_hidden_layers": 7},
        rope_parameters={
            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
            "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1000000.0},
        },
    )
    model = transformers.AutoModelForCausalLM.from_config(cfg)
    model.save_pretrained(tmp_path)
    path = write_checkpoint_gguf(tmp_path, str(tmp_path / "g3.gguf"), "gemma3")
    a = config_from_hf(gguf_hf_config(open_gguf(path), path))
    b = config_from_hf(cfg)
    assert a.sliding_layers == b.sliding_layers == (True,) * 5 + (False, True)
    ma, mb = LlamaModel(a, 64), LlamaModel(b, 64)
    for rot in ("rotary", "rotary_local"):
        assert torch.equal(getattr(ma, rot).cos, getattr(mb, rot).cos), rot


@pytest.mark.parametrize("mode", ["int8", "int4"])
def test_quantization_flag_keeps_the_files_q8_0_blocks(checkpoint, mode):
    """--quantization on a Q8_0 file: Phi-3's packed attn_qkv / ffn_up and each expert's rows of the merged
    tensors go into llmserve's int8 layers with the file's values (never rounded again); the router stays
    float; tokens come back."""
    from llmserve.model.formats.quant import QuantLinear

    name, d, arch, _ = checkpoint
    if name not in ("phi3", "qwen3moe", "glm4"):
        pytest.skip("one packed, one experts and one reordered (interleaved partial rotary) architecture")
    path = write_checkpoint_gguf(d, str(d / "Q8_0-flag.gguf"), arch, "Q8_0")
    exact = LLM(model=path, kv_cache_memory=0.05).engine.model  # widened: the file's values as float32
    llm = LLM(model=path, kv_cache_memory=0.05, quantization=mode, max_num_batched_tokens=32)
    q = llm.engine.model
    layers = ["self_attn.qkv_proj", "self_attn.o_proj"]
    layers += (
        [f"mlp.experts.{e}.{p}" for e in (0, 3) for p in ("gate_up_proj", "down_proj")] if arch == "qwen3moe" else []
    )
    layers += ["mlp.gate_up_proj", "mlp.down_proj"] if arch in ("phi3", "glm4") else []
    for layer in layers:
        a, b = q.layers[1].get_submodule(layer), exact.layers[1].get_submodule(layer)
        assert isinstance(a, QuantLinear) and a.kind == "int8", layer
        assert torch.equal(a.dequantize(), b.weight), layer
    if arch == "qwen3moe":
        assert torch.equal(q.layers[1].mlp.gate.weight, exact.layers[1].mlp.gate.weight)
    outs = llm.generate(_prompts(), SamplingParams(temperature=0, max_tokens=4, ignore_eos=True), use_tqdm=False)
    assert all(len(o.outputs[0].token_ids) == 4 for o in outs)


def test_default_mode_serves_every_architecture_on_its_blocks(checkpoint, monkeypatch):
    """`--quantization auto` on every architecture's Q8_0 file picks the file's own blocks (gguf: the packed int8
    layers), and its greedy tokens keep vLLM's top-5 rule against the float32-exact mode on the same file."""
    from llmserve.model.evaluate import top_k_broken
    from llmserve.model.formats.quant import QuantLinear

    name, d, arch, _ = checkpoint
    path = write_checkpoint_gguf(d, str(d / "Q8_0-auto.gguf"), arch, "Q8_0")
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=5)
    exact = LLM(model=path, kv_cache_memory=0.05, quantization="none", dtype="float32")
    want = [o.outputs[0] for o in exact.generate(_prompts(), params, use_tqdm=False)]
    del exact
    monkeypatch.setenv("LLMSERVE_GGUF_BLOCKS", "1")  # the default outside the test suite (tests/conftest.py)
    llm = LLM(model=path, kv_cache_memory=0.05, max_num_batched_tokens=32)
    assert llm.engine.config.quantization == "gguf"
    assert any(isinstance(m, QuantLinear) for m in llm.engine.model.modules()), name
    got = [o.outputs[0] for o in llm.generate(_prompts(), params, use_tqdm=False)]
    broken = top_k_broken(got, want, k=5)
    assert not broken, (name, broken)
    assert llm.engine.kv.usage == 0


def test_gguf_tensor_names():
    """llama.cpp's names per architecture, including the ones no test file above holds: older Mixtral files'
    one tensor per expert, and tensors llmserve does not read (longrope factors, refused apart)."""
    from llmserve.model.loader import gguf_hf_names
    from llmserve.model.registry import ARCHITECTURES

    MIXTRAL = ARCHITECTURES["mixtral"].gguf

    assert gguf_hf_names("blk.3.ffn_gate.7.weight", MIXTRAL) == [
        ("model.layers.3.mlp.experts.7.gate_proj.weight", None)
    ]
    assert gguf_hf_names("blk.0.ffn_down_exps.weight", ARCHITECTURES["qwen3_moe"].gguf, 2) == [
        ("model.layers.0.mlp.experts.0.down_proj.weight", 0),
        ("model.layers.0.mlp.experts.1.down_proj.weight", 1),
    ]
    assert gguf_hf_names("blk.1.ffn_gate_inp.weight", MIXTRAL) == [("model.layers.1.mlp.gate.weight", None)]
    gemma = ARCHITECTURES["gemma2"].gguf
    assert gguf_hf_names("blk.0.ffn_norm.weight", gemma) == [("model.layers.0.pre_feedforward_layernorm.weight", None)]
    assert gguf_hf_names("blk.0.post_attention_norm.weight", gemma)[0][0].endswith(".post_attention_layernorm.weight")
    assert gguf_hf_names("blk.0.post_ffw_norm.weight", gemma)[0][0].endswith(".post_feedforward_layernorm.weight")
    phi3 = ARCHITECTURES["phi3"].gguf
    assert gguf_hf_names("blk.2.attn_qkv.weight", phi3) == [("model.layers.2.self_attn.qkv_proj.weight", None)]
    assert gguf_hf_names("blk.2.ffn_up.weight", phi3) == [("model.layers.2.mlp.gate_up_proj.weight", None)]
    assert gguf_hf_names("rope_factors_long.weight", phi3) == []  # (read into the config: longrope)
    glm4, olmo2 = ARCHITECTURES["glm4"].gguf, ARCHITECTURES["olmo2"].gguf
    # GLM-4: Hugging Face's GLM names (the spec's checkpoint_renames make them the model's)
    assert gguf_hf_names("blk.1.ffn_norm.weight", glm4)[0][0] == "model.layers.1.post_attention_layernorm.weight"
    assert gguf_hf_names("blk.1.post_attention_norm.weight", glm4)[0][0].endswith(".post_self_attn_layernorm.weight")
    assert gguf_hf_names("blk.1.attn_q.bias", glm4) == [("model.layers.1.self_attn.q_proj.bias", None)]
    assert gguf_hf_names("blk.0.post_ffw_norm.weight", olmo2)[0][0].endswith(".post_feedforward_layernorm.weight")
    assert gguf_hf_names("blk.0.attn_norm.weight", olmo2) == []  # (OLMo 2 has none)
    assert (
        gguf_hf_names("blk.0.ffn_gate_exps.weight", ARCHITECTURES["llama"].gguf, 4) == []
    )  # (experts: MIXTRAL's spec)
    lfm2 = ARCHITECTURES["lfm2"].gguf  # (dotted names: shortconv.in_proj; the final norm is token_embd_norm)
    assert gguf_hf_names("blk.1.shortconv.in_proj.weight", lfm2) == [("model.layers.1.conv.in_proj.weight", None)]
    assert gguf_hf_names("blk.1.shortconv.conv.weight", lfm2) == [("model.layers.1.conv.conv.weight", None)]
    assert gguf_hf_names("token_embd_norm.weight", lfm2) == [("model.norm.weight", None)]
    assert gguf_hf_names("blk.1.shortconv.in_proj.weight", glm4) == []
    gpt_oss = ARCHITECTURES["gpt_oss"].gguf  # (sinks: the spec's checkpoint_renames drop the .weight)
    assert gguf_hf_names("blk.1.attn_sinks.weight", gpt_oss) == [("model.layers.1.self_attn.sinks.weight", None)]
    assert gguf_hf_names("blk.0.ffn_up_exps.bias", gpt_oss, 2) == [
        ("model.layers.0.mlp.experts.0.up_proj.bias", 0),
        ("model.layers.0.mlp.experts.1.up_proj.bias", 1),
    ]
    assert gguf_hf_names("blk.0.post_attention_norm.weight", gpt_oss)[0][0].endswith(".post_attention_layernorm.weight")
    hybrid = ARCHITECTURES["granitemoehybrid"].gguf  # (ssm_a / ssm_d have no suffix; dt_bias is ssm_dt's bias)
    assert gguf_hf_names("blk.1.ssm_a", hybrid) == [("model.layers.1.mamba.A_log", None)]
    assert gguf_hf_names("blk.1.ssm_d", hybrid) == [("model.layers.1.mamba.D", None)]
    assert gguf_hf_names("blk.1.ssm_dt.bias", hybrid) == [("model.layers.1.mamba.dt_bias", None)]
    assert gguf_hf_names("blk.1.ssm_conv1d.bias", hybrid) == [("model.layers.1.mamba.conv1d.bias", None)]
    assert gguf_hf_names("blk.1.ffn_up_shexp.weight", hybrid) == [("model.layers.1.shared_mlp.up_proj.weight", None)]
    assert gguf_hf_names("blk.1.ffn_down.weight", hybrid) == [("model.layers.1.shared_mlp.down_proj.weight", None)]
