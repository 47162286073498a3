"""Granite 4.0-H (Mamba-2 mixers among attention layers: model/families/granite_hybrid.py) on tiny random checkpoints
written by transformers: greedy tokens equal transformers' alone and batched (prompts of 5-49 tokens), with prompts
in chunks of a few tokens (the mixers' conv and scan states carried from chunk to chunk, decodes batched with
prefills) and whole, under a KV pool small enough to preempt (the states recomputed from the tokens), quantized,
and from the checkpoint names transformers loads as well as those it writes. Two variants: routed experts beside
the shared MLP with rotary attention, and the dense one without positions in attention (Granite 4.0-H's own)."""

from __future__ import annotations

import pytest
import torch
from test_architectures import SMALL, _prompts, _transformers_greedy, greedy_batched_and_alone

from llmserve import LLM, SamplingParams

MAX_TOKENS = 12
MULTIPLIERS = dict(embedding_multiplier=3.0, attention_multiplier=0.05, residual_multiplier=0.4, logits_scaling=4.0)
VARIANTS = {
    # mixers around an attention layer; experts beside the shared MLP; rotary; two groups of B / C; the scan's
    # chunk (4) shorter than most prompt chunks
    "moe-rope": dict(
        num_hidden_layers=3,
        layer_types=["mamba", "attention", "mamba"],
        num_local_experts=4,
        num_experts_per_tok=2,
        position_embedding_type="rope",
        mamba_n_groups=2,
    ),
    # no experts, attention without positions, the default one group
    "dense-nope": dict(
        num_hidden_layers=4,
        layer_types=["mamba", "mamba", "attention", "mamba"],
        num_local_experts=0,
        position_embedding_type=None,
    ),
}


@pytest.fixture(scope="module", params=list(VARIANTS))
def granite_h(request, tmp_path_factory, bundled_gguf):
    """(variant, folder, transformers' greedy tokens for _prompts())."""
    import transformers

    from llmserve.tokenizer import Tokenizer

    cfg = transformers.GraniteMoeHybridConfig(
        **{**SMALL, **MULTIPLIERS, **VARIANTS[request.param]},
        shared_intermediate_size=64,
        mamba_n_heads=4,
        mamba_d_state=16,
        mamba_d_conv=4,
        mamba_expand=2,
        mamba_chunk_size=4,
    )
    torch.manual_seed(2)
    model = transformers.AutoModelForCausalLM.from_config(cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.normal_(1.0, 0.3)
            elif name.endswith("bias") and "dt_bias" not in name:
                p.normal_(0.0, 0.3)
            elif name.endswith("dt_bias"):  # (time steps from small to large)
                p.copy_(torch.linspace(-3.0, 1.0, p.numel()))
            elif name.endswith("conv1d.weight"):  # (a convolution that mixes its positions visibly)
                p.normal_(0.0, 0.5)
    d = tmp_path_factory.mktemp(request.param)
    model.save_pretrained(d)
    Tokenizer(bundled_gguf, gguf=True).hf.save_pretrained(d)
    return request.param, d, _transformers_greedy(d)[0]


def _llm(folder, **kw) -> LLM:
    return LLM(model=str(folder), num_threads=2, **{"kv_cache_memory": 0.05, **kw})


def _slots_back(llm: LLM) -> bool:
    pool = llm.engine.kv.states
    return pool.num_free == pool.num_slots and llm.engine.kv.num_free_blocks == llm.engine.kv.num_blocks


@pytest.mark.parametrize("budget", [7, 64])
def test_greedy_equals_transformers_chunked_and_whole(granite_h, budget):
    """Chunks of <= 7 tokens (decodes among them), or every prompt in one step."""
    name, d, want = granite_h
    llm = _llm(d, max_num_batched_tokens=budget)
    assert not llm.engine.config.enable_prefix_caching
    assert sum(s is not None for s in llm.engine.kv.states.shapes) == VARIANTS[name]["layer_types"].count("mamba")
    batched, alone = greedy_batched_and_alone(llm, _prompts(), MAX_TOKENS)
    assert batched == want, name
    assert alone == want, name
    assert _slots_back(llm)


def test_preemption_recomputes_the_states(granite_h):
    name, d, want = granite_h
    llm = _llm(d, kv_cache_memory=None, num_kv_blocks=8, block_size=8, max_num_batched_tokens=16)
    batched, _ = greedy_batched_and_alone(llm, _prompts(), MAX_TOKENS)
    assert llm.engine.scheduler.num_preemptions > 0, name
    assert batched == want, name
    assert _slots_back(llm)


@pytest.mark.parametrize("mode", ["int8", "int4"])
def test_quantized_mixers_and_experts_run(granite_h, mode):
    from llmserve.model.formats.quant import QuantLinear

    name, d, _ = granite_h
    llm = _llm(d, quantization=mode, max_num_batched_tokens=16)
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    outs = llm.generate(_prompts(), params, use_tqdm=False)
    assert all(len(o.outputs[0].token_ids) == MAX_TOKENS for o in outs)
    layer = llm.engine.model.layers[0]
    assert isinstance(layer.mamba.in_proj, QuantLinear) and isinstance(layer.mamba.out_proj, QuantLinear)
    assert isinstance(layer.shared_mlp.gate_up_proj, QuantLinear)
    if layer.mlp is not None:
        assert isinstance(layer.mlp.experts[0].down_proj, QuantLinear)


def test_transformers_own_names_load_too(granite_h, tmp_path):
    """save_pretrained writes the checkpoints' names (block_sparse_moe.input_linear, router.layer); transformers'
    module names (experts.gate_up_proj, router.weight) are read as well: the same tokens."""
    import shutil

    from safetensors.torch import load_file, save_file

    name, d, want = granite_h
    if name != "moe-rope":
        pytest.skip("the experts' names: the variant with experts")
    tensors = load_file(d / "model.safetensors")
    assert any(".block_sparse_moe.input_linear." in k for k in tensors)  # (what the hub's checkpoints hold)
    renames = (
        (".block_sparse_moe.input_linear.weight", ".block_sparse_moe.experts.gate_up_proj"),
        (".block_sparse_moe.output_linear.weight", ".block_sparse_moe.experts.down_proj"),
        (".block_sparse_moe.router.layer.", ".block_sparse_moe.router."),
    )
    renamed = {}
    for k, t in tensors.items():
        for old, new in renames:
            k = k.replace(old, new)
        renamed[k] = t
    for f in d.iterdir():
        if f.name != "model.safetensors":
            shutil.copy(f, tmp_path / f.name)
    save_file(renamed, tmp_path / "model.safetensors", metadata={"format": "pt"})
    llm = _llm(tmp_path, max_num_batched_tokens=32)
    batched, _ = greedy_batched_and_alone(llm, _prompts(), MAX_TOKENS)
    assert batched == want


def test_a_state_pool_too_big_for_the_budget_is_refused(granite_h):
    _, d, _ = granite_h
    with pytest.raises(ValueError, match="recurrent state"):
        _llm(d, kv_cache_memory=0.0001, max_num_seqs=256)
