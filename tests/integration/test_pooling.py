"""Pooling requests (embeddings, SamplingParams.pooling): the engine's pooled vector equals transformers'
final-normed hidden states of the bundled model, pooled the same way (last token, mean), alone, in a batch
with generating requests (whose greedy output stays transformers'), over chunked prefill and preemption;
KV blocks always come back."""

from __future__ import annotations

import pytest
import torch

from llmserve import SamplingParams
from tests.integration.prompts import long_document

TEXTS = [
    "The capital of France is Paris.",
    "Hi",
    "def add(a, b):\n    return a + b",
    long_document(1600),  # longer than the 256-token budget: prefilled in chunks
    long_document(700),
]


@pytest.fixture(scope="module")
def reference(hf_model, llm):
    """transformers: last_hidden_state (after the final norm), last token and mean, normalized."""
    tok = llm.get_tokenizer()
    out = {}
    with torch.inference_mode():
        for t in TEXTS:
            ids = tok.encode(t)
            h = hf_model.model(torch.tensor([ids])).last_hidden_state[0].float()
            out[t] = {
                "last": torch.nn.functional.normalize(h[-1], dim=0),
                "mean": torch.nn.functional.normalize(h.mean(0), dim=0),
                "ids": ids,
            }
    assert len(out[TEXTS[3]]["ids"]) > 256
    return out


def _close(got: list[float], want: torch.Tensor) -> None:
    got_t = torch.tensor(got)
    assert got_t.shape == want.shape
    assert abs(got_t.norm().item() - 1.0) < 1e-5
    assert torch.allclose(got_t, want, atol=2e-5), (got_t - want).abs().max().item()


@pytest.mark.parametrize("pooling", ["last", "mean"])
def test_pooled_vectors_match_transformers(llm, reference, pooling):
    eng = llm.engine
    free = eng.kv.num_free_blocks
    for t in TEXTS:  # alone
        (out,) = llm.embed([t], pooling=pooling)
        _close(out.embedding, reference[t][pooling])
        assert out.finished and out.outputs[0].token_ids == [] and out.outputs[0].finish_reason == "stop"
    outs = llm.embed(TEXTS, pooling=pooling)  # together
    for t, out in zip(TEXTS, outs):
        _close(out.embedding, reference[t][pooling])
    assert eng.kv.num_free_blocks == free and not eng.has_unfinished_requests()


def test_pooling_next_to_generation(llm, reference):
    """One batch: generating requests keep their greedy tokens, pooling requests get transformers' vectors."""
    gen = SamplingParams(temperature=0, max_tokens=16)
    alone = [o.outputs[0].token_ids for o in llm.generate(TEXTS[:2], gen, use_tqdm=False)]
    params = [
        gen,
        SamplingParams(max_tokens=1, temperature=0, pooling="mean"),
        gen,
        SamplingParams(max_tokens=1, temperature=0, pooling="last"),
    ]
    outs = llm.generate([TEXTS[0], TEXTS[3], TEXTS[1], TEXTS[2]], params, use_tqdm=False)
    assert [outs[0].outputs[0].token_ids, outs[2].outputs[0].token_ids] == alone
    assert outs[0].embedding is None
    _close(outs[1].embedding, reference[TEXTS[3]]["mean"])
    _close(outs[3].embedding, reference[TEXTS[2]]["last"])


def test_pooling_under_preemption_and_prefix_cache(llm_factory, reference):
    """A small KV pool held by two generations when a long pooling request arrives: it is preempted and
    recomputed (its pool starts again), the generations keep their greedy tokens; a prompt whose blocks are
    cached is still computed whole (mean pooling needs every position)."""
    llm = llm_factory(max_num_batched_tokens=64, num_kv_blocks=16, max_num_seqs=8)
    eng = llm.engine
    free = eng.kv.num_free_blocks
    gen = SamplingParams(temperature=0, max_tokens=60, ignore_eos=True)
    alone = llm.generate([TEXTS[0]], gen, use_tqdm=False)[0].outputs[0].token_ids
    pool = SamplingParams(max_tokens=1, temperature=0, pooling="mean")
    ids = eng.tokenizer.encode(TEXTS[0])
    finals = {}

    def run(until):
        while eng.has_unfinished_requests() and not until():
            for out in eng.step():
                if out.finished:
                    finals[out.request_id] = out

    eng.add_request(ids, gen, request_id="g1")
    eng.add_request(ids, gen, request_id="g2")
    run(lambda: eng.scheduler.requests["g1"].num_output_tokens >= 50)  # 2 x 4 of the 16 blocks held
    before = eng.scheduler.num_preemptions
    assert 12 * 16 < len(eng.tokenizer.encode(TEXTS[4])) < 20 * 16
    for k in range(2):  # the same prompt twice: the second finds its blocks cached
        eng.add_request(eng.tokenizer.encode(TEXTS[4]), pool, request_id=f"p{k}")
    eng.add_request(eng.tokenizer.encode(TEXTS[1]), pool, request_id="p2")
    run(lambda: False)
    assert eng.scheduler.num_preemptions > before
    assert finals["g1"].outputs[0].token_ids == finals["g2"].outputs[0].token_ids == alone
    for rid, t in (("p0", TEXTS[4]), ("p1", TEXTS[4]), ("p2", TEXTS[1])):
        _close(finals[rid].embedding, reference[t]["mean"])
    assert eng.kv.num_free_blocks == free and not eng.scheduler.requests


def test_bad_pooling_is_refused():
    with pytest.raises(ValueError, match="pooling"):
        SamplingParams(pooling="cls")
