"""Prompt log-probabilities over the wire, against `llmserve serve` on the bundled model (float32):
- completions' `echo` + `logprobs` (lm-eval's loglikelihood request): the prompt's tokens first, their
  logprobs equal to transformers' log_softmax; `max_tokens: 0` with echo; streamed, in the first chunk;
  vLLM's `prompt_logprobs` field on completions and chat;
- the real lm-eval: `local-completions` against the server scores a small multiple-choice task and a
  loglikelihood_rolling task as lm-eval's `hf` backend scores them on transformers' float32 load of the same
  weights (accuracy equal, each item's log-likelihood within 1e-3)."""

from __future__ import annotations

import importlib.util
import json
import math

import httpx
import openai
import pytest
import torch

from llmserve.testing.launcher import ServerProcess

PROMPT = "The capital of France is Paris. The capital of Germany is"


@pytest.fixture(scope="module")
def server():
    with ServerProcess("--served-model-name", "smol", "--max-num-batched-tokens", "32") as srv:  # chunked prefill
        yield srv.wait_ready()


@pytest.fixture()
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def hf_tokenizer(bundled_gguf):
    import os

    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(os.path.dirname(bundled_gguf), gguf_file=os.path.basename(bundled_gguf))


def _reference(hf_model, ids: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        return torch.log_softmax(hf_model(torch.tensor([ids])).logits[0].float(), dim=-1)


def test_echo_logprobs_equal_transformers(client, hf_model, hf_tokenizer):
    ids = hf_tokenizer.encode(PROMPT)
    ref = _reference(hf_model, ids)
    r = client.completions.create(model="smol", prompt=ids, max_tokens=1, temperature=0, echo=True, logprobs=2)
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(ids) + 1 and lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    for i in range(1, len(ids)):
        assert abs(lp.token_logprobs[i] - float(ref[i - 1, ids[i]])) < 1e-3, i
        assert sorted(lp.top_logprobs[i].values(), reverse=True) == pytest.approx(
            ref[i - 1].topk(2).values.tolist(), abs=1e-3
        )
    # the generated token last: the greedy one after the prompt
    assert abs(lp.token_logprobs[-1] - float(ref[-1].max())) < 1e-3
    assert lp.text_offset[0] == 0 and lp.text_offset == sorted(lp.text_offset)

    # max_tokens 0: the prompt alone (lm-eval's loglikelihood_rolling may send it)
    z = client.completions.create(model="smol", prompt=ids, max_tokens=0, echo=True, logprobs=1)
    assert z.choices[0].text == hf_tokenizer.decode(ids)
    assert z.choices[0].logprobs.token_logprobs == pytest.approx(lp.token_logprobs[:-1], abs=1e-5)
    assert (z.usage.prompt_tokens, z.usage.completion_tokens, z.usage.total_tokens) == (len(ids), 0, len(ids))
    with pytest.raises(openai.BadRequestError, match="max_tokens"):
        client.completions.create(model="smol", prompt=ids, max_tokens=0)


def test_echo_logprobs_streamed_in_the_first_chunk(client):
    full = client.completions.create(model="smol", prompt=PROMPT, max_tokens=3, temperature=0, echo=True, logprobs=1)
    chunks = list(
        client.completions.create(
            model="smol", prompt=PROMPT, max_tokens=3, temperature=0, echo=True, logprobs=1, stream=True
        )
    )
    first = chunks[0].choices[0]
    assert first.text == PROMPT
    want = full.choices[0].logprobs
    n = len(first.logprobs.tokens)
    assert first.logprobs.tokens == want.tokens[:n] and first.logprobs.token_logprobs[0] is None
    assert first.logprobs.token_logprobs[1:] == pytest.approx(want.token_logprobs[1:n], abs=1e-5)
    assert "".join(c.choices[0].text for c in chunks if c.choices) == full.choices[0].text


def test_vllm_prompt_logprobs_field(server, hf_model, hf_tokenizer):
    ids = hf_tokenizer.encode(PROMPT)
    ref = _reference(hf_model, ids)
    body = {"model": "smol", "prompt": ids, "max_tokens": 1, "prompt_logprobs": 2}
    plp = httpx.post(server.url + "/v1/completions", json=body, timeout=120).json()["choices"][0]["prompt_logprobs"]
    assert len(plp) == len(ids) and plp[0] is None
    for i in range(1, len(ids)):
        entry = plp[i]
        assert 2 <= len(entry) <= 3 and str(ids[i]) in entry
        mine = entry[str(ids[i])]
        assert abs(mine["logprob"] - float(ref[i - 1, ids[i]])) < 1e-3
        assert mine["rank"] >= 1 and isinstance(mine["decoded_token"], str)
        assert {v["rank"] for v in entry.values()} >= {1, 2}
    chat = httpx.post(
        server.url + "/v1/chat/completions",
        json={"model": "smol", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1, "prompt_logprobs": 0},
        timeout=120,
    ).json()
    assert chat["prompt_logprobs"][0] is None and len(chat["prompt_logprobs"]) == chat["usage"]["prompt_tokens"]
    assert all(len(e) == 1 and next(iter(e.values()))["logprob"] <= 0 for e in chat["prompt_logprobs"][1:])


# -- the real lm-eval -------------------------------------------------------------------------------------
QUESTIONS = [
    ("The capital of France is", [" Paris", " London", " Madrid", " Rome"], 0),
    ("The sun rises in the", [" west", " east", " north", " south"], 1),
    ("Water freezes at zero degrees", [" Fahrenheit", " Kelvin", " Celsius", " Rankine"], 2),
    ("A week has seven", [" months", " years", " hours", " days"], 3),
    ("The opposite of hot is", [" cold", " warm", " loud", " tall"], 0),
    ("Two plus two equals", [" five", " four", " three", " six"], 1),
    ("The color of the clear sky is", [" green", " red", " blue", " purple"], 2),
    ("Cats are known to say", [" woof", " moo", " quack", " meow"], 3),
    ("The largest planet in our solar system is", [" Jupiter", " Mars", " Venus", " Mercury"], 0),
    ("Bees make", [" milk", " honey", " silk", " wool"], 1),
    ("The first month of the year is", [" March", " June", " January", " October"], 2),
    ("Fish live in", [" trees", " deserts", " clouds", " water"], 3),
]
TEXTS = [
    "The quick brown fox jumps over the lazy dog. It was a sunny day in the park.",
    "Python is a programming language that lets you work quickly and integrate systems more effectively.",
    "Once upon a time there was a little girl who lived in a village near the forest.",
]


def _tasks(tmp_path) -> str:
    mc = tmp_path / "mc.jsonl"
    mc.write_text("".join(json.dumps({"q": q, "choices": c, "answer": a}) + "\n" for q, c, a in QUESTIONS))
    roll = tmp_path / "roll.jsonl"
    roll.write_text("".join(json.dumps({"text": t}) + "\n" for t in TEXTS))
    (tmp_path / "plp_mc.yaml").write_text(
        "task: plp_mc\ndataset_path: json\n"
        f"dataset_kwargs:\n  data_files:\n    test: {mc}\n"
        "test_split: test\noutput_type: multiple_choice\n"
        'doc_to_text: "{{q}}"\ndoc_to_choice: "{{choices}}"\ndoc_to_target: "{{answer}}"\n'
        "target_delimiter: ''\nmetric_list:\n  - metric: acc\n"
    )
    (tmp_path / "plp_roll.yaml").write_text(
        "task: plp_roll\ndataset_path: json\n"
        f"dataset_kwargs:\n  data_files:\n    test: {roll}\n"
        "test_split: test\noutput_type: loglikelihood_rolling\n"
        'doc_to_text: ""\ndoc_to_target: "{{text}}"\n'
        "metric_list:\n  - metric: word_perplexity\n"
    )
    return str(tmp_path)


def _ll(resp) -> float:
    """A sample's log-likelihood: (loglikelihood, is_greedy) of a choice, or a rolling one's float."""
    return float(resp[0] if isinstance(resp, (list, tuple)) else resp)


def _scores(model, task_dir: str) -> dict:
    """{task: (metric, [each item's log-likelihoods])} of lm-eval on `model` (an LM or a model name + args)."""
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    kw = model if isinstance(model, dict) else {"model": model}
    out = simple_evaluate(
        **kw, tasks=["plp_mc", "plp_roll"], task_manager=TaskManager(include_path=task_dir), log_samples=True
    )
    res = {}
    for task, metric in (("plp_mc", "acc,none"), ("plp_roll", "word_perplexity,none")):
        samples = sorted(out["samples"][task], key=lambda s: s["doc_id"])
        res[task] = (out["results"][task][metric], [[_ll(r) for r in s["filtered_resps"]] for s in samples])
    return res


@pytest.mark.skipif(
    importlib.util.find_spec("lm_eval") is None, reason="lm-eval is not installed (pip install lm-eval)"
)
def test_lm_eval_local_completions_scores_as_hf(server, hf_model, hf_tokenizer, tmp_path):
    from lm_eval.models.huggingface import HFLM

    tok_dir = tmp_path / "tokenizer"
    hf_tokenizer.save_pretrained(tok_dir)
    task_dir = _tasks(tmp_path)
    want = _scores(HFLM(pretrained=hf_model, tokenizer=hf_tokenizer, batch_size=1, device="cpu"), task_dir)
    args = (
        f"model=smol,base_url={server.url}/v1/completions,tokenizer_backend=huggingface,"
        f"tokenizer={tok_dir},num_concurrent=1,max_retries=1,tokenized_requests=True"
    )
    got = _scores({"model": "local-completions", "model_args": args}, task_dir)
    print("lm-eval hf:", want)
    print("lm-eval local-completions against llmserve:", got)
    for task in want:
        (m_want, items_want), (m_got, items_got) = want[task], got[task]
        assert len(items_got) == len(items_want)
        for a, b in zip(items_got, items_want):
            assert a == pytest.approx(b, abs=1e-3)
        assert m_got == pytest.approx(m_want, rel=1e-4)
    acc, lls = got["plp_mc"]
    assert acc > 0.5 and not all(math.isclose(x, 0.0) for ll in lls for x in ll)  # real scores, not ties at 0
