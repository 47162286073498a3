"""Greedy output of llmserve equals transformers' greedy output on the same weights, alone or in a
batch, whatever the block size, with chunked prefill."""
from __future__ import annotations

import pytest
import torch

from llmserve import SamplingParams
from tests.integration.prompts import chat_messages

MAX_TOKENS = 32


@pytest.fixture(scope="module")
def prompt_ids(llm):
    tok = llm.get_tokenizer()
    ids = [tok.encode_chat(m) for m in chat_messages()]
    lens = [len(p) for p in ids]
    assert max(lens) > 256 * 2, lens          # longer than the token budget: prefilled in chunks
    assert min(lens) < 40, lens
    return ids


@pytest.fixture(scope="module")
def reference(hf_model, prompt_ids):
    refs = []
    with torch.inference_mode():
        for ids in prompt_ids:
            out = hf_model.generate(torch.tensor([ids]), max_new_tokens=MAX_TOKENS, do_sample=False,
                                    eos_token_id=2, pad_token_id=2)
            refs.append(out[0, len(ids):].tolist())
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
