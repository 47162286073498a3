"""--seed (EngineConfig.seed), as vLLM's: requests that bring no seed get one from a stream it seeds, so
the same unseeded sampled workload on two engines with the same --seed gives the same outputs."""

from __future__ import annotations

from llmserve import LLM, SamplingParams

SMALL = {"kv_cache_memory": 0.05, "max_num_batched_tokens": 256}
QUESTIONS = [
    "Invent a name for a cat.",
    "Describe the sea in one sentence.",
    "Name a colour.",
    "Say something about the number 7.",
]


def _texts(seed: int) -> list[str]:
    llm = LLM(seed=seed, **SMALL)
    tok = llm.get_tokenizer()
    prompts = [tok.encode_chat([{"role": "user", "content": q}]) for q in QUESTIONS]
    params = [SamplingParams(temperature=1.0, max_tokens=16) for _ in QUESTIONS]
    params[-1] = SamplingParams(temperature=1.0, max_tokens=16, seed=1234)  # brings its own seed
    outs = llm.generate(prompts, params, use_tqdm=False)
    outs += llm.generate(prompts[:1], SamplingParams(temperature=1.0, max_tokens=16, n=2), use_tqdm=False)
    return [c.text for o in outs for c in o.outputs]


def test_seed_makes_unseeded_sampling_repeatable():
    a, b, c = _texts(7), _texts(7), _texts(8)
    assert a == b  # same --seed, same workload: the same samples
    assert a[:3] != c[:3]  # another --seed: other samples for the unseeded requests ...
    assert a[3] == c[3]  # ... but a request's own seed wins
    assert a[4] != a[5]  # n > 1 without a seed: each sample its own seed
