"""LFM2, the first hybrid model (recurrent state per sequence: engine/state_pool.py), on a tiny random checkpoint
written by transformers: greedy tokens equal transformers' with prompts in chunks of a few tokens (the conv state
carried from chunk to chunk, decodes batched with prefills), under a KV pool small enough to preempt (the state
recomputed from the tokens), quantized; the state slots come back after aborts; what the state cannot follow is
refused at start-up; the pool's bytes come out of the KV budget."""

from __future__ import annotations

import pytest
import torch
from test_architectures import SMALL, _prompts, _transformers_greedy, greedy_batched_and_alone

from llmserve import LLM, SamplingParams

MAX_TOKENS = 12


@pytest.fixture(scope="module")
def lfm2(tmp_path_factory, bundled_gguf):
    """(folder, transformers' greedy tokens for _prompts()): conv layers first and last, two attention layers."""
    import transformers

    from llmserve.tokenizer import Tokenizer

    cfg = transformers.Lfm2Config(
        **{**SMALL, "num_hidden_layers": 4},
        layer_types=["conv", "full_attention", "conv", "full_attention"],
        block_multiple_of=32,
    )
    torch.manual_seed(1)
    model = transformers.AutoModelForCausalLM.from_config(cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.normal_(1.0, 0.3)
            elif name.endswith("conv.weight"):  # (a conv that mixes its positions visibly)
                p.normal_(0.0, 0.6)
    d = tmp_path_factory.mktemp("lfm2")
    model.save_pretrained(d)
    Tokenizer(bundled_gguf, gguf=True).hf.save_pretrained(d)
    return d, _transformers_greedy(d)[0]


def _llm(folder, **kw) -> LLM:
    return LLM(model=str(folder), num_threads=2, **{"kv_cache_memory": 0.05, **kw})


def test_chunks_of_a_few_tokens_carry_the_conv_state(lfm2):
    d, want = lfm2
    llm = _llm(d, max_num_batched_tokens=7)  # prompts of 5-49 tokens in chunks of <= 7, decodes among them
    batched, alone = greedy_batched_and_alone(llm, _prompts(), MAX_TOKENS)
    assert batched == want and alone == want
    pool = llm.engine.kv.states
    assert pool.num_free == pool.num_slots == llm.engine.config.max_num_seqs
    assert not llm.engine.config.enable_prefix_caching and not llm.engine.kv.enable_caching


def test_preemption_recomputes_the_state(lfm2):
    d, want = lfm2
    llm = _llm(d, kv_cache_memory=None, num_kv_blocks=8, block_size=8, max_num_batched_tokens=16)
    batched, _ = greedy_batched_and_alone(llm, _prompts(), MAX_TOKENS)
    assert llm.engine.scheduler.num_preemptions > 0
    assert batched == want
    assert llm.engine.kv.states.num_free == llm.engine.kv.states.num_slots


@pytest.mark.parametrize("mode", ["int8", "int4"])
def test_quantized_conv_layers_run(lfm2, mode):
    from llmserve.model.formats.quant import QuantLinear

    llm = _llm(lfm2[0], quantization=mode, max_num_batched_tokens=16)
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    outs = llm.generate(_prompts(), params, use_tqdm=False)
    assert all(len(o.outputs[0].token_ids) == MAX_TOKENS for o in outs)
    conv = llm.engine.model.layers[0].conv
    assert isinstance(conv.in_proj, QuantLinear) and isinstance(conv.out_proj, QuantLinear)


def test_abort_and_finish_give_the_slots_back(lfm2):
    eng = _llm(lfm2[0], max_num_seqs=3, max_num_batched_tokens=128).engine
    pool = eng.kv.states
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    ids = [eng.add_request(p, params) for p in _prompts()]  # four requests, three slots
    eng.step()
    assert pool.num_free == 0 and eng.scheduler.num_waiting == 1
    eng.abort_request(ids[0])  # a running one: its slot goes back, the waiting one takes it
    assert pool.num_free == 1 and ids[0] not in pool.slot_of
    eng.step()
    assert pool.num_free == 0 and ids[3] in pool.slot_of
    eng.abort_request(ids[1])
    while eng.has_unfinished_requests():
        eng.step()
    assert pool.num_free == pool.num_slots == 3 and not pool.slot_of


@pytest.mark.parametrize(
    "kw, what",
    [
        (dict(speculative_ngram=3), "speculative decoding"),
        (dict(enable_lora=True), "LoRA"),
    ],
)
def test_refused_at_start_up(lfm2, kw, what):
    with pytest.raises(ValueError, match=f"hybrid model.*{what}"):
        _llm(lfm2[0], **kw)


def test_state_pool_comes_out_of_the_kv_budget(lfm2):
    from llmserve.engine.kv_plan import bytes_per_block, config_kinds

    eng = _llm(lfm2[0], kv_cache_memory=0.01, max_num_seqs=64).engine
    pool = eng.kv.states
    assert pool.shapes == [((2, 64),), None, ((2, 64),), None]  # (kernel 3 - 1 inputs of 64 channels)
    mc = eng.model_config
    per_block = bytes_per_block(config_kinds(mc, mc.num_kv_heads, torch.float32), eng.block_size)
    state = 64 * 2 * (2 * 64 * 4)  # two conv layers' float32 state each
    assert eng.num_blocks == (int(0.01 * (1 << 30)) - state) // per_block
    assert [type(c) for c in eng.runner.kv_caches] == [tuple, torch.Tensor, tuple, torch.Tensor]
    assert eng.runner.kv_caches[0][0].shape == (64, 2, 64)
