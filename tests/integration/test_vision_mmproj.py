"""`--mmproj FILE` (llama.cpp's vision projector GGUF beside a text GGUF; llmserve.model.loader.mmproj): each family's
tiny random checkpoint (tests/vision_files.py), written as llama.cpp's converter writes the pair, gives the Hugging Face
folder's rendered chat, prompt ids and greedy tokens with one image and several, batched with a text-only prompt and
alone, and the first token's logprob (tests/integration/test_vision.py proves the folder's equal transformers'); a
projector that does not fit the model, or one beside a checkpoint folder, is refused naming it."""

from __future__ import annotations

import pytest

from llmserve import LLM, SamplingParams
from llmserve.model.vision.processing import prompt_with_images
from tests.vision_files import pictures, write_gemma3, write_idefics3, write_vlm_ggufs

GREEDY = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
CASES = [(1, "What is in the picture?"), (2, "Compare these two."), (0, "Just text, no image at all.")]
ENGINE = dict(kv_cache_memory=0.05, max_num_batched_tokens=16, num_threads=2, dtype="float32")


@pytest.fixture(scope="module", params=["idefics3", "gemma3"])
def pair(request, tmp_path_factory, bundled_gguf):
    d = tmp_path_factory.mktemp(f"mmproj-{request.param}")
    if request.param == "gemma3":
        write_gemma3(d, bundled_gguf, query_pre_attn_scalar=16)
    else:
        write_idefics3(d, bundled_gguf)
    (d / "gguf").mkdir()  # (a folder of its own: no tokenizer files beside the GGUF, as a download has none)
    text, mmproj = write_vlm_ggufs(d, str(d / "gguf" / "text.gguf"), str(d / "gguf" / "mmproj.gguf"))
    return LLM(model=str(d), **ENGINE), LLM(model=text, mmproj=mmproj, **ENGINE), d, text, mmproj


def _prompts(llm: LLM) -> tuple[list[str], list]:
    """The cases' chats rendered by the model's own template and tokenized with its own image processing."""
    eng = llm.engine
    texts, prompts = [], []
    for seed, (n, words) in enumerate(CASES):
        chat = [{"role": "user", "content": [{"type": "image"}] * n + [{"type": "text", "text": words}]}]
        texts.append(eng.tokenizer.apply_chat_template(chat, add_generation_prompt=True))
        prompts.append(prompt_with_images(eng.tokenizer, eng.image_processing, texts[-1], pictures(n, seed=seed)))
    return texts, prompts


def test_gguf_pair_equals_the_folder(pair):
    folder, gguf, *_ = pair
    assert gguf.engine.model_config.architecture == folder.engine.model_config.architecture
    assert type(gguf.engine.image_processing) is type(folder.engine.image_processing)
    (want_texts, want), (texts, prompts) = _prompts(folder), _prompts(gguf)
    assert texts == want_texts
    for p, q in zip(prompts, want):
        assert list(p) == list(q)
        assert [(im.positions, im.content_hash) for im in p.images] == [
            (im.positions, im.content_hash) for im in q.images
        ]
    expected = [o.outputs[0].token_ids for o in folder.generate(want, GREEDY, use_tqdm=False)]
    assert [o.outputs[0].token_ids for o in gguf.generate(prompts, GREEDY, use_tqdm=False)] == expected
    for prompt, tokens in zip(_prompts(gguf)[1], expected):  # alone (the prompts' blocks now cached)
        assert gguf.generate([prompt], GREEDY, use_tqdm=False)[0].outputs[0].token_ids == tokens
    lp = SamplingParams(temperature=0, max_tokens=1, logprobs=1)
    for a, b in zip(gguf.generate(prompts, lp, use_tqdm=False), folder.generate(want, lp, use_tqdm=False)):
        assert a.outputs[0].logprobs[0].logprob == pytest.approx(b.outputs[0].logprobs[0].logprob, abs=1e-4)


def test_projector_that_does_not_fit_is_refused(pair, bundled_gguf):
    _, _, d, text, mmproj = pair
    with pytest.raises(ValueError, match="mmproj: .* another model"):  # the bundled 576-wide model, a 64-wide projector
        LLM(model=bundled_gguf, mmproj=mmproj, **ENGINE)
    with pytest.raises(ValueError, match="mmproj: .*not a llama.cpp vision projector"):
        LLM(model=text, mmproj=text, **ENGINE)
    with pytest.raises(ValueError, match="mmproj: a projector file goes with a GGUF"):
        LLM(model=str(d), mmproj=mmproj, **ENGINE)
    with pytest.raises(ValueError, match="mmproj: .* is not a .gguf file"):
        LLM(model=text, mmproj=str(d / "missing.gguf"), **ENGINE)
