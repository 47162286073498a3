"""n-gram speculative decoding (--speculative-ngram): output identical to plain decoding."""

from __future__ import annotations

import pytest

from llmserve.engine.ngram import propose_ngram
from llmserve.engine.request import SamplingParams
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


def test_limits_stops_and_sampled_requests_unchanged(llm, spec_llm):
    msgs = _messages()[-1:]
    cases = [
        SamplingParams(max_tokens=7, temperature=0),  # ends mid-proposal
        SamplingParams(max_tokens=40, temperature=0, stop=["def "]),  # stop string
        SamplingParams(max_tokens=30, temperature=0.8, seed=7),  # sampled: not speculated
        SamplingParams(max_tokens=30, temperature=0, logprobs=2),
    ]
    for p in cases:
        a = llm.chat(msgs, p, use_tqdm=False)[0].outputs[0]
        b = spec_llm.chat(msgs, p, use_tqdm=False)[0].outputs[0]
        assert (b.token_ids, b.text, b.finish_reason) == (a.token_ids, a.text, a.finish_reason), p
        if p.logprobs:
            assert [lp.token_id for lp in b.logprobs] == b.token_ids
            assert [round(lp.logprob, 3) for lp in b.logprobs] == [round(lp.logprob, 3) for lp in a.logprobs]
