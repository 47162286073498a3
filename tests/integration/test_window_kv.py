"""Sliding-window layers that give their passed blocks back (engine/kv_window.py), on tiny random checkpoints
written by transformers: Gemma 2 (1:1), Gemma 3 (1 full : 5 window layers) and Mistral (every layer windowed).
Prompts are several windows long, so blocks are freed during prefill and decode. llmserve's greedy tokens equal
transformers' batched and alone, with chunked prefill, prefix-cache hits and preemption in a tiny pool; every
block of both pools comes back."""

from __future__ import annotations

import pytest
import torch

from llmserve import LLM, SamplingParams

VOCAB, MAX_TOKENS, WINDOW = 49152, 16, 24
SMALL = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=128,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=512,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=0,
    initializer_range=0.15,
    sliding_window=WINDOW,
)
ENGINE = dict(block_size=8, max_num_batched_tokens=32, num_threads=2)  # chunked prefill: 32 tokens a step


def _configs():
    import transformers as T

    gemma = dict(query_pre_attn_scalar=24)
    return {
        "gemma2": (
            T.Gemma2Config,
            dict(
                gemma,
                num_hidden_layers=2,
                layer_types=["sliding_attention", "full_attention"],
                attn_logit_softcapping=5.0,
            ),
        ),
        "gemma3-1to5": (
            T.Gemma3TextConfig,
            dict(gemma, num_hidden_layers=6, layer_types=["sliding_attention"] * 5 + ["full_attention"]),
        ),
        "mistral": (T.MistralConfig, dict(num_hidden_layers=2)),
    }


def _prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(7)
    shared = torch.randint(3, VOCAB, (72,), generator=g).tolist()
    return [
        shared + torch.randint(3, VOCAB, (40,), generator=g).tolist(),  # 112 tokens: 4.7 windows
        shared + torch.randint(3, VOCAB, (5,), generator=g).tolist(),  # the same 72-token prefix: a cache hit
        torch.randint(3, VOCAB, (50,), generator=g).tolist(),
        torch.randint(3, VOCAB, (9,), generator=g).tolist(),  # shorter than the window
    ]


@pytest.fixture(scope="module", params=list(_configs()))
def checkpoint(request, tmp_path_factory, bundled_gguf):
    import transformers

    from llmserve.tokenizer import Tokenizer

    cls, extra = _configs()[request.param]
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cls(**{**SMALL, **extra}))
    with torch.no_grad():  # norms away from their initial values (Gemma's are stored as w - 1)
        for name, p in model.named_parameters():
            if "norm" in name:
                p.normal_(1.0 if cls is transformers.MistralConfig else 0.0, 0.3)
    d = tmp_path_factory.mktemp(request.param)
    model.save_pretrained(d)
    Tokenizer(bundled_gguf, gguf=True).hf.save_pretrained(d)
    ref = transformers.AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32, attn_implementation="eager")
    with torch.inference_mode():
        want = [
            ref.generate(
                torch.tensor([p]), max_new_tokens=MAX_TOKENS, min_new_tokens=MAX_TOKENS, do_sample=False, pad_token_id=0
            )[0, len(p) :].tolist()
            for p in _prompts()
        ]
    return request.param, str(d), want


GREEDY = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)


def _tokens(llm, prompts):
    return [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)]


def _all_returned(engine) -> bool:
    kv = engine.kv
    return kv.num_free_blocks == kv.num_blocks and kv.window.pool.num_free == kv.window.num_blocks


def test_greedy_equals_transformers_batched_alone_and_cached(checkpoint):
    name, d, want = checkpoint
    llm = LLM(model=d, kv_cache_memory=0.02, **ENGINE)
    kv = llm.engine.kv
    assert kv.window is not None and kv.window.window == WINDOW, name
    assert _tokens(llm, _prompts()) == want, name
    assert _all_returned(llm.engine)
    hits = kv.prefix_cache_hits
    assert [_tokens(llm, [p])[0] for p in _prompts()] == want, name  # alone: each prompt hits its blocks
    assert kv.prefix_cache_hits > hits
    assert _all_returned(llm.engine)


def test_preemption_in_a_tiny_pool(checkpoint):
    name, d, want = checkpoint
    # the window pool holds a long sequence (8 blocks) and a bit; Mistral (the budget is all window layers): just one
    llm = LLM(model=d, num_kv_blocks=8 if name == "mistral" else 16, **ENGINE)
    assert _tokens(llm, _prompts()) == want, name
    assert llm.engine.scheduler.num_preemptions > 0, name
    assert _all_returned(llm.engine)


def test_the_window_pool_gets_its_blocks_back(checkpoint):
    """One long request: the window pool's free count goes back up as the window passes blocks, and it never
    holds more than a window and a chunk; with --disable-hybrid-kv-cache-manager every block is kept (the
    same tokens)."""
    name, d, want = checkpoint
    llm = LLM(model=d, kv_cache_memory=0.02, **ENGINE)
    engine, group = llm.engine, llm.engine.kv.window
    engine.add_request(_prompts()[0], GREEDY)
    free, tokens = [], []
    while engine.has_unfinished_requests():
        for out in engine.step():
            tokens = out.outputs[0].token_ids
        free.append(group.pool.num_free)
    assert tokens == want[0]
    assert any(b > a for a, b in zip(free, free[1:])), f"{name}: no window block given back"
    held = group.num_blocks - min(free)
    assert held <= group.blocks_per_sequence(32) < -(-(112 + MAX_TOKENS) // 8), name
    assert _all_returned(engine)

    whole = LLM(model=d, kv_cache_memory=0.02, disable_hybrid_kv_cache_manager=True, **ENGINE)
    assert whole.engine.kv.window is None
    assert _tokens(whole, _prompts()[:1]) == want[:1]


def test_abort_returns_both_pools_blocks(checkpoint):
    _, d, _ = checkpoint
    engine = LLM(model=d, kv_cache_memory=0.02, **ENGINE).engine
    ids = [engine.add_request(p, GREEDY) for p in _prompts()]
    for _ in range(6):  # mid-prefill and decoding, blocks already given back
        engine.step()
    assert engine.kv.window.pool.num_free < engine.kv.window.num_blocks
    for rid in ids:
        engine.abort_request(rid)
    assert not engine.has_unfinished_requests()
    assert _all_returned(engine)


def test_int8_kv_in_the_window_pool(checkpoint):
    """--kv-cache-dtype int8: the window layers' own cache is int8 too; the tokens are those of int8 KV that
    keeps every block."""
    name, d, _ = checkpoint
    if name != "gemma3-1to5":
        pytest.skip("one model is enough")
    hybrid = LLM(model=d, kv_cache_memory=0.02, kv_cache_dtype="int8", **ENGINE)
    caches = hybrid.engine.runner.kv_caches
    assert all(c.dtype is torch.int8 for c in caches)
    assert caches[0].shape[1] == hybrid.engine.kv.window.num_blocks != caches[5].shape[1]
    whole = LLM(model=d, kv_cache_memory=0.02, kv_cache_dtype="int8", disable_hybrid_kv_cache_manager=True, **ENGINE)
    assert _tokens(hybrid, _prompts()) == _tokens(whole, _prompts())
    assert _all_returned(hybrid.engine)


def test_disk_tier_keeps_every_block(checkpoint, tmp_path):
    """--kv-cache-dir files hold a block of every layer: with it the window layers keep their blocks (one pool),
    and a restart is served from disk with the same tokens."""
    name, d, want = checkpoint
    if name != "gemma2":
        pytest.skip("one model is enough")
    for _ in range(2):  # the second engine: a restart
        llm = LLM(model=d, kv_cache_memory=0.02, kv_cache_dir=str(tmp_path), **ENGINE)
        assert llm.engine.kv.window is None
        assert _tokens(llm, _prompts()[:2]) == want[:2]
        llm.engine.shutdown()  # (writes what is pending)
    assert llm.engine.kv.disk.stats()["external_prefix_cache_hits"] > 0
