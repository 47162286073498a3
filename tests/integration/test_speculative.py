"""n-gram speculative decoding (--speculative-ngram): greedy output identical to plain decoding; sampled
output distributed as plain sampling (rejection sampling; the exact statistical tests are in
tests/unit/test_rejection.py)."""

from __future__ import annotations

import math

import pytest
import torch

from llmserve.engine.ngram import propose_ngram
from llmserve.engine.request import SamplingParams
from tests.checkpoints import tiny_llama
from tests.integration.prompts import chat_messages, long_document


def test_propose_ngram_finds_latest_continuation():
    assert propose_ngram([1, 2, 3, 9, 1, 2, 3, 7, 5, 1, 2, 3], 2) == [7, 5]  # latest match of (1,2,3)
    assert propose_ngram([4, 5, 6, 4], 3) == [5, 6, 4]  # falls back to a 1-gram
    assert propose_ngram([1, 2, 3], 4) == []  # nothing repeats
    assert propose_ngram([1, 2, 1, 2], 0) == []


def _messages():
    repeat = [{"role": "user", "content": "Copy this code exactly, then say 'done':\n\n" + long_document(900)}]
    return chat_messages()[:3] + [chat_messages()[-1], repeat]


@pytest.fixture(scope="module")
def spec_llm(llm_factory):
    return llm_factory(max_num_batched_tokens=256, kv_cache_memory=1.0, speculative_ngram=4)


def test_greedy_output_equals_plain_decoding(llm, spec_llm):
    params = SamplingParams(max_tokens=64, temperature=0)
    msgs = _messages()
    plain = [o.outputs[0].token_ids for o in llm.chat(msgs, params, use_tqdm=False)]
    before = spec_llm.engine.num_spec_accepted
    spec = [o.outputs[0].token_ids for o in spec_llm.chat(msgs, params, use_tqdm=False)]
    assert spec == plain
    assert spec_llm.engine.num_spec_accepted - before >= 20  # the copy task accepts many proposals
    alone = spec_llm.chat([msgs[-1]], params, use_tqdm=False)[0].outputs[0].token_ids
    assert alone == plain[-1]
    e = spec_llm.engine
    assert e.kv.usage == 0 and not e.has_unfinished_requests()
    stats = e.stats()  # what /metrics exports as llmserve:spec_decode_num_*_tokens_total
    assert 0 < stats.spec_decode_num_accepted_tokens <= stats.spec_decode_num_draft_tokens


def test_limits_and_stops_unchanged(llm, spec_llm):
    msgs = _messages()[-1:]
    cases = [
        SamplingParams(max_tokens=7, temperature=0),  # ends mid-proposal
        SamplingParams(max_tokens=40, temperature=0, stop=["def "]),  # stop string
        SamplingParams(max_tokens=30, temperature=0, logprobs=2),
    ]
    for p in cases:
        a = llm.chat(msgs, p, use_tqdm=False)[0].outputs[0]
        b = spec_llm.chat(msgs, p, use_tqdm=False)[0].outputs[0]
        assert (b.token_ids, b.text, b.finish_reason) == (a.token_ids, a.text, a.finish_reason), p
        if p.logprobs:
            assert [lp.token_id for lp in b.logprobs] == b.token_ids
            # The verify pass scores several tokens in one forward, so float sums differ in the last bits:
            # equal to a tolerance, not to a rounding (round(x, 3) splits values that straddle a boundary).
            assert [lp.logprob for lp in b.logprobs] == pytest.approx([lp.logprob for lp in a.logprobs], abs=2e-3)


def _mean_logprob(outputs) -> torch.Tensor:
    """Per sample, the model's mean log-probability of the tokens it sampled: accepting proposals too often
    would raise it (n-gram copies are likely tokens) or lower it (a random draft's are not)."""
    return torch.tensor([sum(lp.logprob for lp in o.logprobs) / len(o.logprobs) for o in outputs], dtype=torch.float64)


def _assert_same_mean(a: torch.Tensor, b: torch.Tensor) -> None:
    se = math.sqrt(float(a.var()) / len(a) + float(b.var()) / len(b)) + 1e-9
    assert abs(float(a.mean() - b.mean())) < 4 * se, (a.mean(), b.mean(), se)


def _sampled(llm, msgs, n: int, tokens: int):
    params = [SamplingParams(max_tokens=tokens, temperature=1.0, seed=s, ignore_eos=True, logprobs=0) for s in range(n)]
    return [o.outputs[0] for o in llm.chat([msgs] * n, params, use_tqdm=False)]


def test_sampled_requests_are_speculated_and_keep_the_distribution(llm, spec_llm):
    """Sampled requests on the copy task accept proposals, a seed repeats itself, and the model's
    log-probability of what was sampled is distributed as without speculation."""
    msgs = _messages()[-1]
    n, tokens = 48, 24
    plain = _sampled(llm, msgs, n, tokens)
    before = (spec_llm.engine.num_spec_proposed, spec_llm.engine.num_spec_accepted)
    spec = _sampled(spec_llm, msgs, n, tokens)
    proposed = spec_llm.engine.num_spec_proposed - before[0]
    accepted = spec_llm.engine.num_spec_accepted - before[1]
    assert proposed > 0 and 0 < accepted <= proposed
    assert all(len(o.token_ids) == tokens and len(o.logprobs) == tokens for o in spec)
    assert [lp.token_id for lp in spec[0].logprobs] == spec[0].token_ids
    again = _sampled(spec_llm, msgs, 4, tokens)
    assert [o.token_ids for o in again] == [o.token_ids for o in spec[:4]]
    _assert_same_mean(_mean_logprob(plain), _mean_logprob(spec))
    e = spec_llm.engine
    assert e.kv.usage == 0 and not e.has_unfinished_requests()


# -- a draft model (--speculative-model) ---------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_draft(tmp_path_factory, bundled_gguf):
    """A random 2-layer Llama with the bundled model's vocabulary: a poor draft, which verification must
    correct (greedy output unchanged, sampled output distributed as the model's)."""
    d = str(tmp_path_factory.mktemp("draft"))
    tiny_llama(d, bundled_gguf, head_dim=32, max_position_embeddings=8192)
    return d


def test_draft_model_of_the_same_weights_is_accepted_and_output_unchanged(llm, llm_factory, bundled_gguf):
    msgs = _messages()
    params = SamplingParams(max_tokens=32, temperature=0)
    plain = [o.outputs[0].token_ids for o in llm.chat(msgs, params, use_tqdm=False)]
    draft_llm = llm_factory(
        max_num_batched_tokens=256, kv_cache_memory=1.0, speculative_model=bundled_gguf, num_speculative_tokens=3
    )
    e = draft_llm.engine
    spec = [o.outputs[0].token_ids for o in draft_llm.chat(msgs, params, use_tqdm=False)]
    assert spec == plain
    stats = e.stats()
    # float32 is batch-invariant: the draft (the same weights) proposes the model's own greedy tokens
    assert stats.spec_decode_num_drafts > 0
    assert stats.spec_decode_num_accepted_tokens >= 0.9 * stats.spec_decode_num_draft_tokens > 0
    assert e.kv.usage == 0 and not e.has_unfinished_requests()
    assert e.draft.kv.usage == 0 and e.draft.shadows == {}


def test_a_poor_draft_changes_nothing_greedy_or_sampled(llm, llm_factory, tiny_draft):
    draft_llm = llm_factory(
        max_num_batched_tokens=256, kv_cache_memory=1.0, speculative_model=tiny_draft, num_speculative_tokens=2
    )
    msgs = _messages()
    greedy = SamplingParams(max_tokens=24, temperature=0)
    plain = [o.outputs[0].token_ids for o in llm.chat(msgs, greedy, use_tqdm=False)]
    assert [o.outputs[0].token_ids for o in draft_llm.chat(msgs, greedy, use_tqdm=False)] == plain
    before = draft_llm.engine.num_spec_proposed
    n, tokens = 48, 12
    a = _sampled(llm, msgs[-1], n, tokens)
    b = _sampled(draft_llm, msgs[-1], n, tokens)
    assert draft_llm.engine.num_spec_proposed > before
    assert all(len(o.token_ids) == tokens for o in b)
    _assert_same_mean(_mean_logprob(a), _mean_logprob(b))
    e = draft_llm.engine
    assert e.kv.usage == 0 and e.draft.kv.usage == 0 and e.draft.shadows == {}


def test_draft_model_settings_are_checked(tiny_draft):
    from llmserve.config import EngineConfig

    with pytest.raises(ValueError, match="not both"):
        EngineConfig(speculative_model=tiny_draft, speculative_ngram=2)
    with pytest.raises(ValueError, match="num_speculative_tokens"):
        EngineConfig(speculative_model=tiny_draft, num_speculative_tokens=0)
