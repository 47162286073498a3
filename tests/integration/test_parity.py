"""Greedy output of llmserve equals transformers' greedy output on the same weights, alone or in a
batch, whatever the block size, with chunked prefill."""

from __future__ import annotations

import random

import pytest
import torch

from llmserve import SamplingParams
from llmserve.model.evaluate import top_k_divergence
from tests.integration.prompts import chat_messages

MAX_TOKENS = 32


@pytest.fixture(scope="module")
def prompt_ids(llm):
    tok = llm.get_tokenizer()
    ids = [tok.encode_chat(m) for m in chat_messages()]
    lens = [len(p) for p in ids]
    assert max(lens) > 256 * 2, lens  # longer than the token budget: prefilled in chunks
    assert min(lens) < 40, lens
    return ids


@pytest.fixture(scope="module")
def reference(hf_model, prompt_ids):
    refs = []
    with torch.inference_mode():
        for ids in prompt_ids:
            out = hf_model.generate(
                torch.tensor([ids]), max_new_tokens=MAX_TOKENS, do_sample=False, eos_token_id=2, pad_token_id=2
            )
            refs.append(out[0, len(ids) :].tolist())
    return refs


def _greedy(llm, prompts):
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=MAX_TOKENS), use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


def _strip_eos(ids):
    return ids[:-1] if ids and ids[-1] == 2 else ids


@pytest.mark.parametrize("block_size", [16, 32])
def test_greedy_matches_transformers_batched(llm_factory, prompt_ids, reference, block_size):
    llm = llm_factory(max_num_batched_tokens=256, kv_cache_memory=1.0, block_size=block_size)
    got = _greedy(llm, prompt_ids)
    for i, (g, r) in enumerate(zip(got, reference)):
        assert _strip_eos(g) == _strip_eos(r), f"prompt {i} (len {len(prompt_ids[i])})"


def test_greedy_matches_transformers_alone(llm, prompt_ids, reference):
    for i, ids in enumerate(prompt_ids):
        (g,) = _greedy(llm, [ids])
        assert _strip_eos(g) == _strip_eos(reference[i]), f"prompt {i} (len {len(ids)})"


def test_greedy_tokens_and_logits_paths_agree(llm, prompt_ids, reference):
    """Steps whose rows are all plain greedy ask the model for tokens (a float32 head is screened,
    not read whole: ops.head_argmax); a row with logprobs needs the logits. Both match transformers,
    alone and in one batch."""
    eng = llm.engine
    paths = []
    orig = eng.executor.execute

    def spy(sched, **kw):
        paths.append(kw.get("argmax"))
        return orig(sched, **kw)

    eng.executor.execute = spy
    try:
        ids = prompt_ids[:4]
        params = [
            SamplingParams(temperature=0, max_tokens=MAX_TOKENS, logprobs=0 if i == 1 else None)
            for i in range(len(ids))
        ]
        together = [o.outputs[0].token_ids for o in llm.generate(ids, params, use_tqdm=False)]
        assert False in paths
        paths.clear()
        alone = _greedy(llm, ids[:1])
        assert paths and all(paths)
    finally:
        eng.executor.execute = orig
    assert _strip_eos(alone[0]) == _strip_eos(reference[0])
    for i, g in enumerate(together):
        assert _strip_eos(g) == _strip_eos(reference[i]), f"prompt {i}"


def test_float16_kv_cache_holds_twice_the_tokens_and_keeps_greedy_output(llm, llm_factory, prompt_ids, reference):
    """--kv-cache-dtype float16: the same memory holds twice the blocks; keys and values rounded to
    float16 (read by the C++ decode kernel in place, widened for SDPA elsewhere) leave greedy output
    all but unchanged. Not exact by contract, so the bar is agreement; the fused decode path and the
    SDPA path read the same stored values and must agree with each other."""
    from llmserve.config import KernelConfig
    from llmserve.model.kernels import ops

    half = llm_factory(max_num_batched_tokens=256, kv_cache_memory=1.0, kv_cache_dtype="float16")
    assert half.engine.runner.kv_caches[0].dtype is torch.float16
    assert half.engine.num_blocks == 2 * llm.engine.num_blocks
    got = _greedy(half, prompt_ids)
    pairs = [(a, b) for g, r in zip(got, reference) for a, b in zip(_strip_eos(g), _strip_eos(r))]
    assert sum(a == b for a, b in pairs) >= 0.95 * len(pairs), (got, reference)
    saved = ops.configure(KernelConfig(in_place_decode=False))  # decode through the gather + SDPA path
    try:
        sdpa = _greedy(half, prompt_ids[:3])
    finally:
        ops.configure(saved)
    assert sdpa == got[:3]
    assert half.engine.kv.num_free_blocks == half.engine.num_blocks


def _forced(llm, prompts, continuations) -> tuple[list[float], list[list[int]]]:
    """Each prompt followed by its continuation, scored in one prefill (prompt_logprobs=1): the logprob of every
    token after the first, and for each continuation position the model's top-1 token given the same context."""
    forced = [p + c for p, c in zip(prompts, continuations)]
    outs = llm.generate(forced, SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=1), use_tqdm=False)
    lps = [e.logprob for o in outs for e in o.prompt_logprobs[1:]]
    tops = [[e.top[0].token_id for e in o.prompt_logprobs[len(p) :]] for o, p in zip(outs, prompts)]
    return lps, tops


def _perplexity(lps: list[float]) -> float:
    return float(torch.tensor(lps, dtype=torch.float64).neg().mean().exp())


def test_int8_kv_cache_holds_more_sequences_and_keeps_greedy_output_and_perplexity(
    llm, llm_factory, prompt_ids, reference
):
    """--kv-cache-dtype int8 (a scale per token and head, read in place by the decode and prefill kernels):
    the same --kv-cache-memory holds 3.8x float32's blocks and 1.9x float16's (the scales cost 4 bytes a row).
    Against float32 KV (transformers' greedy path): greedy agreement >= 97% position by position, each position
    given the reference's own context (teacher-forced: one early difference does not count again for every later
    token); perplexity of prompts and continuations within +0.5%; decoding from the int8 cache keeps
    the first divergence of its greedy output from float32's within each side's top-5 (vLLM's rule for reduced
    precision). docs/engine.md has the figures."""
    q8 = llm_factory(max_num_batched_tokens=256, kv_cache_memory=1.0, kv_cache_dtype="int8")
    cache = q8.engine.runner.kv_caches[0]
    mc = q8.engine.model_config
    assert cache.dtype is torch.int8 and cache.shape[-1] == mc.head_dim + 4 and q8.engine.runner.in_place_decode
    per_block = 2 * mc.num_layers * 16 * mc.num_kv_heads * (mc.head_dim + 4)
    assert q8.engine.num_blocks == (1 << 30) // per_block
    assert q8.engine.num_blocks >= 3.7 * llm.engine.num_blocks  # float32 KV, the default here
    assert q8.engine.num_blocks >= 1.85 * (2 * llm.engine.num_blocks)  # float16's (its own test: 2x float32)
    refs = [_strip_eos(r) for r in reference]
    lps32, _ = _forced(llm, prompt_ids, refs)
    lps8, tops8 = _forced(q8, prompt_ids, refs)
    pairs = [(a, b) for t, r in zip(tops8, refs) for a, b in zip(t, r)]
    assert len(pairs) == sum(map(len, refs))
    assert sum(a == b for a, b in pairs) >= 0.97 * len(pairs), (tops8, refs)
    assert _perplexity(lps8) <= _perplexity(lps32) * 1.005, (_perplexity(lps8), _perplexity(lps32))
    # decoding from the int8 cache (the decode kernel on int8 blocks), judged as vLLM judges reduced precision: at
    # the first token where it parts from float32's greedy path, each side's token is in the other's top-5. Whole
    # 32-token sequences are no measure: one near tie flips a sequence, and which ties flip moves with the CPU's
    # rounding order (an Intel AVX-512 machine: 6 of 8 whole, 5 of 8 with LLMSERVE_AVX512=0; the gaps 0.001-0.12)
    ref_out, q8_out = _greedy_top5(llm, prompt_ids), _greedy_top5(q8, prompt_ids)
    assert [_strip_eos(list(o.token_ids)) for o in ref_out] == refs  # float32 with logprobs: transformers' tokens
    broken = {i: _diverges(a, b) for i, (a, b) in enumerate(zip(ref_out, q8_out)) if _diverges(a, b)}
    assert not broken, broken
    assert q8.engine.kv.num_free_blocks == q8.engine.num_blocks


def _greedy_top5(llm, prompts):
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, logprobs=5)
    return [o.outputs[0] for o in llm.generate(prompts, params, use_tqdm=False)]


def _diverges(a, b) -> str | None:
    """vLLM's top-5 rule between two greedy outputs with logprobs=5 (llmserve.model.evaluate.top_k_divergence)."""
    tops = [[[t.token_id for t in lp.top] for lp in o.logprobs] for o in (a, b)]
    return top_k_divergence(list(a.token_ids), tops[0], list(b.token_ids), tops[1], k=5)


def test_bfloat16_kv_cache_is_read_in_place_and_agrees_with_the_sdpa_path(llm, llm_factory, prompt_ids, reference):
    """--kv-cache-dtype bfloat16 (vLLM's cache for a bfloat16 model): twice the blocks of float32; the C++ kernels
    write the rows (rounded to nearest even, as torch rounds) and read them in place, widened exactly, in prefill
    and decode. Keys and values with 8 mantissa bits are not exact by contract: greedy output keeps vLLM's top-5
    rule against float32, and the kernels and the gather + SDPA path read the same stored values and agree."""
    from llmserve.config import KernelConfig
    from llmserve.model.kernels import ops

    bf = llm_factory(max_num_batched_tokens=256, kv_cache_memory=1.0, kv_cache_dtype="bfloat16")
    assert bf.engine.runner.kv_caches[0].dtype is torch.bfloat16 and bf.engine.runner.in_place_decode
    assert bf.engine.num_blocks == 2 * llm.engine.num_blocks
    got = _greedy_top5(bf, prompt_ids)
    for a, b in zip(got, _greedy_top5(llm, prompt_ids)):
        assert _diverges(a, b) is None
    saved = ops.configure(KernelConfig(in_place_decode=False, in_place_prefill=False))  # gather + SDPA throughout
    try:
        sdpa = _greedy(bf, prompt_ids[:3])
    finally:
        ops.configure(saved)
    assert sdpa == [list(o.token_ids) for o in got[:3]]
    assert bf.engine.kv.num_free_blocks == bf.engine.num_blocks


def test_greedy_unchanged_without_prefix_caching(llm_factory, prompt_ids, reference):
    llm = llm_factory(max_num_batched_tokens=256, kv_cache_memory=1.0, enable_prefix_caching=False)
    got = _greedy(llm, prompt_ids + prompt_ids[:3])  # repeats would hit the cache if it were on
    assert llm.engine.kv.prefix_cache_hits == 0
    for g, r in zip(got, reference + reference[:3]):
        assert _strip_eos(g) == _strip_eos(r)


def test_greedy_unchanged_under_preemption(llm_factory, prompt_ids, reference):
    # 64 blocks x 16 = 1024 tokens: the batch needs about twice that, so requests are preempted
    # and recomputed (often from their own cached prefix) many times.
    llm = llm_factory(max_num_batched_tokens=256, num_kv_blocks=64)
    before = llm.engine.scheduler.num_preemptions
    got = _greedy(llm, prompt_ids)
    assert llm.engine.scheduler.num_preemptions - before > 0
    for g, r in zip(got, reference):
        assert _strip_eos(g) == _strip_eos(r)
    assert llm.engine.kv.num_free_blocks == 64


def test_shared_prefix_is_served_from_cache(llm):
    eng = llm.engine
    tok = llm.get_tokenizer()
    system = "You are a careful assistant. " + " ".join(f"Rule {i}: be precise about item {i}." for i in range(40))
    first = tok.encode_chat([{"role": "system", "content": system}, {"role": "user", "content": "Hi"}])
    second = tok.encode_chat([{"role": "system", "content": system}, {"role": "user", "content": "Hello there"}])
    common = next(i for i, (a, b) in enumerate(zip(first, second)) if a != b)
    assert common >= 300
    scheduled: dict[str, int] = {}
    orig = eng.executor.execute

    def spy(sched, **kw):
        for rid, n in sched.num_scheduled_tokens.items():
            scheduled[rid] = scheduled.get(rid, 0) + n
        return orig(sched, **kw)

    eng.executor.execute = spy
    try:
        llm.generate([first], SamplingParams(temperature=0, max_tokens=2), use_tqdm=False)
        hits = eng.kv.prefix_cache_hits
        out = llm.generate([second], SamplingParams(temperature=0, max_tokens=2), use_tqdm=False)[0]
    finally:
        eng.executor.execute = orig
    assert out.num_cached_tokens >= 288 and out.num_cached_tokens >= (common // 16) * 16
    assert eng.kv.prefix_cache_hits - hits == out.num_cached_tokens
    rid = [r for r in scheduled if r.startswith("llm-")][-1]
    # only the uncached part of the prompt was computed (+1 for the decode step of token 2)
    assert scheduled[rid] == len(second) - out.num_cached_tokens + 1


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "int8"])
def test_a_repeated_prompt_computes_its_last_token_only(llm_factory, prompt_ids, reference, kv_cache_dtype):
    # vLLM and llama.cpp recompute one token of a cached prompt, not its last block: the block holding it is
    # copied on write (one prompt with a partial last block, one of whole blocks)
    llm = llm_factory(max_num_batched_tokens=256, kv_cache_memory=1.0, kv_cache_dtype=kv_cache_dtype)
    eng = llm.engine
    i = next(i for i, p in enumerate(prompt_ids) if len(p) % 16 and len(p) > 100)
    prompts = [prompt_ids[i], prompt_ids[i][: len(prompt_ids[i]) // 16 * 16]]
    scheduled: list[dict[str, int]] = []
    orig = eng.executor.execute

    def spy(sched, **kw):
        scheduled.append(dict(sched.num_scheduled_tokens))
        return orig(sched, **kw)

    first = [
        llm.generate([p], SamplingParams(temperature=0, max_tokens=MAX_TOKENS), use_tqdm=False)[0] for p in prompts
    ]
    eng.executor.execute = spy
    try:
        again = [
            llm.generate([p], SamplingParams(temperature=0, max_tokens=MAX_TOKENS), use_tqdm=False)[0] for p in prompts
        ]
    finally:
        eng.executor.execute = orig
    for p, a, b in zip(prompts, first, again):
        assert b.num_cached_tokens == len(p) - 1
        assert b.outputs[0].token_ids == a.outputs[0].token_ids
    if kv_cache_dtype == "auto":  # float32: still transformers' answer
        assert _strip_eos(again[0].outputs[0].token_ids) == _strip_eos(reference[i])
    assert [n for step in scheduled for n in step.values()] == [1] * sum(len(b.outputs[0].token_ids) for b in again)
    assert eng.kv.num_free_blocks == eng.kv.num_blocks


def test_max_model_len_that_cannot_fit_fails_at_startup():
    from llmserve import LLM

    with pytest.raises(ValueError) as e:
        LLM(max_model_len=4096, kv_cache_memory=0.01)
    assert "--kv-cache-memory" in str(e.value) and "--max-model-len" in str(e.value)


def test_greedy_matches_transformers_with_gemm_in_the_fused_decode(llm, prompt_ids, reference):
    """The fused decode stack's float32 projections take at::linear (MKL / oneDNN's GEMM) from their
    crossover on (measured per shape, ops.gemm_rows); forced there at every row count, greedy output
    still equals transformers'."""
    from llmserve.config import KernelConfig
    from llmserve.model.kernels import ops

    model = llm.engine.model
    saved = ops.configure(KernelConfig(gemv_rows=0))
    model._decode_stack = None  # rebuilt with the new row limits
    try:
        got = _greedy(llm, prompt_ids)
        assert model._decode_stack, "the fused path must run here"
    finally:
        ops.configure(saved)
        model._decode_stack = None
    for i, (g, r) in enumerate(zip(got, reference)):
        assert _strip_eos(g) == _strip_eos(r), f"prompt {i} (len {len(prompt_ids[i])})"


def test_greedy_matches_transformers_with_packed_weights(prompt_ids, reference):
    """Every float32 projection in oneDNN's blocked layout in place of the plain weight (KernelConfig.packed_weights
    True; what the auto setting does to a 1B model's projections): oneDNN's matmul at every row count, in the
    fused decode stack and on the prefill path. Greedy output, batched and alone, still equals transformers'."""
    from llmserve import LLM
    from llmserve.config import KernelConfig
    from llmserve.model.kernels import ops

    if not torch.backends.mkldnn.is_available() or ops.cpu_kernels() is None:
        pytest.skip("needs the CPU kernels and oneDNN")
    saved = ops.kernel_config()
    try:
        kernels = KernelConfig(packed_weights=True, gemm="onednn")
        llm = LLM(max_num_batched_tokens=256, kv_cache_memory=0.5, kernels=kernels)
        model = llm.engine.model
        for layer in model.layers:
            for lin in (layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj):
                assert lin.weight.is_mkldnn
        assert not model.lm_head.weight.is_mkldnn  # the head stays plain (the embedding; greedy steps screen it)
        got = _greedy(llm, prompt_ids)
        assert model._decode_stack, "the fused path must run here"
        alone = [_greedy(llm, [ids])[0] for ids in prompt_ids[:3]]
    finally:
        ops.configure(saved)
    for i, (g, r) in enumerate(zip(got, reference)):
        assert _strip_eos(g) == _strip_eos(r), f"prompt {i} (len {len(prompt_ids[i])})"
    assert alone == got[:3]


def test_a_ram_hit_of_whole_blocks_answers_as_a_cold_run_whose_last_token_is_its_own_step(llm_factory):
    # A fully cached prompt computes its last token alone, in its own copy of the last block (copy on write); a
    # cold run gives the same bits where its last token is a step of its own too (a budget of n - 1). A one-row
    # step takes other kernels than a chunk's rows (the integer dots, the fused decode stack), so a cold run
    # prefilling the last token inside a chunk can differ from a hit at near-ties: that is not what this checks.
    n = 320  # 20 whole blocks
    llm = llm_factory(max_num_batched_tokens=n - 1, kv_cache_memory=0.25)
    rng = random.Random(2)
    prompt = [rng.randrange(1000, 30000) for _ in range(n)]
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=3)
    cold, hit = (llm.generate([prompt], params, use_tqdm=False)[0] for _ in range(2))
    assert (cold.num_cached_tokens, hit.num_cached_tokens) == (0, n - 1)
    assert hit.outputs[0].token_ids == cold.outputs[0].token_ids

    def tops(out):
        return [[(t.token_id, t.logprob) for t in lp.top] for lp in out.outputs[0].logprobs]

    assert tops(hit) == tops(cold)
