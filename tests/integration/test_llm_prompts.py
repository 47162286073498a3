"""LLM.generate takes the prompt forms code moving from vLLM passes: text, token ids, and vLLM's
TextPrompt / TokensPrompt dicts ({"prompt": ...}, {"prompt_token_ids": ...}), alone or in a list."""

from __future__ import annotations

import pytest

from llmserve import SamplingParams

GREEDY = SamplingParams(temperature=0, max_tokens=8)


def test_prompt_dicts_equal_plain_prompts(llm):
    text = "The capital of France is"
    ids = llm.get_tokenizer().encode(text)
    want = llm.generate(text, GREEDY, use_tqdm=False)[0].outputs[0].token_ids
    outs = llm.generate([{"prompt": text}, {"prompt_token_ids": ids}, ids, text], GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == [want] * 4
    assert outs[0].prompt == text and outs[1].prompt is None and outs[0].prompt_token_ids == ids
    one = llm.generate({"prompt_token_ids": ids, "cache_salt": "tenant-a"}, GREEDY, use_tqdm=False)
    assert len(one) == 1 and one[0].outputs[0].token_ids == want


@pytest.mark.parametrize(
    "prompt, words",
    [
        ({"prompt": "a", "prompt_token_ids": [1]}, "exactly one"),
        ({}, "exactly one"),
        ({"prompt": "a", "multi_modal_data": {}}, "multi_modal_data"),
        ({"prompt": 5}, "'prompt' must be a string"),
        ({"prompt_token_ids": "1 2"}, "list of token ids"),
        (3.5, "float"),
    ],
)
def test_bad_prompt_dicts_are_refused_before_anything_runs(llm, prompt, words):
    with pytest.raises(ValueError, match=words):
        llm.generate(["fine", prompt], GREEDY, use_tqdm=False)
    assert not llm.engine.has_unfinished_requests()
