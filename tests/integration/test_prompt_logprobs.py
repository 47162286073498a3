"""Prompt log-probabilities (SamplingParams.prompt_logprobs) equal transformers' float32 log_softmax at every
prompt position: alone, batched with other requests, prefilled in chunks, with the prompt's prefix cached."""

from __future__ import annotations

import pytest
import torch

from llmserve import SamplingParams

TEXTS = [
    "The quick brown fox jumps over the lazy dog. " * 3,
    "Paris is the capital of France, and Berlin is the capital of",
    "1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22, 23, 24, 25, 26, 27, 28, 29, 30",
]
TOP = 3


@pytest.fixture(scope="module")
def prompts(llm):
    tok = llm.get_tokenizer()
    ids = [tok.encode(t) for t in TEXTS]
    ids.append(ids[2] * 4)  # a long one: several chunks under a small token budget
    return ids


@pytest.fixture(scope="module")
def reference(hf_model, prompts):
    """Per prompt: transformers' log_softmax [len, vocab] at each position (row p scores token p + 1)."""
    with torch.inference_mode():
        return [torch.log_softmax(hf_model(torch.tensor([ids])).logits[0].float(), dim=-1) for ids in prompts]


def _check(out, ids, ref, top=TOP):
    plp = out.prompt_logprobs
    assert plp is not None and len(plp) == len(ids) and plp[0] is None
    for i in range(1, len(ids)):
        e, row = plp[i], ref[i - 1]
        assert e.token_id == ids[i]
        assert abs(e.logprob - float(row[ids[i]])) < 1e-3, (i, e.logprob, float(row[ids[i]]))
        assert e.rank == int((row > row[ids[i]]).sum()) + 1 or abs(e.logprob - float(row.max())) < 1e-4
        assert len(e.top) == top
        ref_top = row.topk(top)
        assert [a.logprob for a in e.top] == pytest.approx(ref_top.values.tolist(), abs=1e-3)
        assert [a.rank for a in e.top] == list(range(1, top + 1))


def _params(**kw):
    return SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=TOP, **kw)


def test_alone(llm, prompts, reference):
    for ids, ref in zip(prompts, reference):
        (out,) = llm.generate([ids], _params(), use_tqdm=False)
        _check(out, ids, ref)


def test_batched_with_others_and_chunked(llm_factory, prompts, reference):
    llm = llm_factory(max_num_batched_tokens=32, kv_cache_memory=1.0)
    plain = SamplingParams(temperature=0, max_tokens=4)
    params = [_params() if i % 2 == 0 else plain for i in range(2 * len(prompts))]
    outs = llm.generate([p for p in prompts for _ in range(2)], params, use_tqdm=False)
    for j, out in enumerate(outs):
        if j % 2 == 0:
            _check(out, prompts[j // 2], reference[j // 2])
        else:
            assert out.prompt_logprobs is None


def test_cached_prefix_is_computed_anyway(llm, prompts, reference):
    long = prompts[3]
    llm.generate([long], SamplingParams(temperature=0, max_tokens=1), use_tqdm=False)  # its blocks cached
    (again,) = llm.generate([long], SamplingParams(temperature=0, max_tokens=1), use_tqdm=False)
    assert again.num_cached_tokens > 0
    (out,) = llm.generate([long], _params(), use_tqdm=False)
    assert out.num_cached_tokens == 0
    _check(out, long, reference[3])


def test_greedy_output_unchanged_and_zero_top(llm, prompts, reference):
    ids = prompts[1]
    (plain,) = llm.generate([ids], SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)
    (scored,) = llm.generate([ids], SamplingParams(temperature=0, max_tokens=8, prompt_logprobs=0), use_tqdm=False)
    assert scored.outputs[0].token_ids == plain.outputs[0].token_ids
    _check(scored, ids, reference[1], top=0)
    (one,) = llm.generate([ids[:1]], SamplingParams(max_tokens=1, prompt_logprobs=1), use_tqdm=False)
    assert one.prompt_logprobs == [None]
