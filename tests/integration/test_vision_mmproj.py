"""`--mmproj FILE` (llama.cpp's vision projector GGUF beside a text GGUF; llmserve.model.loader.mmproj): each family's
tiny random checkpoint (tests/vision_files.py), written as llama.cpp's converter writes the pair, gives the Hugging Face
folder's rendered chat, prompt ids and greedy tokens with one image and several, batched with a text-only prompt and
alone, and the first token's logprob (tests/integration/test_vision.py proves the folder's equal transformers'); a
projector that does not fit the model, or one beside a checkpoint folder, is refused naming it, and so is a Qwen text
file without its projector. A Q8_0 or F16 projector (llama.cpp's --outtype with --mmproj) gives what a float32 file
of the same values (gguf's dequantization) gives."""

from __future__ import annotations

import pytest

from llmserve import LLM, SamplingParams
from llmserve.model.vision.processing import prompt_with_images
from tests.vision_files import pictures, write_gemma3, write_idefics3, write_qwen_vl, write_vlm_ggufs

GREEDY = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
CASES = [(1, "What is in the picture?"), (2, "Compare these two."), (0, "Just text, no image at all.")]
ENGINE = dict(kv_cache_memory=0.05, max_num_batched_tokens=16, num_threads=2, dtype="float32")


QWEN = {"qwen2_5_vl": "Qwen2_5_VL", "qwen3_vl": "Qwen3VL"}


@pytest.fixture(scope="module", params=["idefics3", "gemma3", *QWEN])
def pair(request, tmp_path_factory, bundled_gguf):
    d = tmp_path_factory.mktemp(f"mmproj-{request.param}")
    if request.param == "gemma3":
        write_gemma3(d, bundled_gguf, query_pre_attn_scalar=16)
    elif request.param in QWEN:
        write_qwen_vl(d, bundled_gguf, QWEN[request.param])
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
    if "qwen" in d.name:  # a qwen2vl / qwen3vl text file is half a model
        with pytest.raises(ValueError, match="mmproj: .* give its projector file"):
            LLM(model=text, **ENGINE)


@pytest.mark.parametrize("projector_type", ["Q8_0", "F16"])
def test_quantized_projector(projector_type, tmp_path, bundled_gguf):
    """The idefics3 pair with its projector in Q8_0 / F16 (weight matrices; norms, biases, the patch kernel and
    position table float32, as the converter writes them) gives the greedy tokens and first logprob of the same pair
    with a float32 projector of the same values (dequantized once, by gguf), and stays near the float32 projector's."""
    from gguf import GGUFReader

    write_idefics3(tmp_path, bundled_gguf)
    (tmp_path / "gguf").mkdir()
    paths = {}
    for kind, dequantized in (("F32", False), (projector_type, False), (projector_type, True)):
        name = f"mmproj-{kind}{'-values' if dequantized else ''}.gguf"
        paths[name] = write_vlm_ggufs(
            tmp_path, str(tmp_path / "gguf" / "text.gguf"), str(tmp_path / "gguf" / name), kind, dequantized
        )[1]
    f32, quantized, values = paths.values()
    assert {t.tensor_type.name for t in GGUFReader(quantized).tensors} == {"F32", projector_type}
    text = str(tmp_path / "gguf" / "text.gguf")
    lp = SamplingParams(temperature=0, max_tokens=1, logprobs=1)
    runs = {}
    for path in (quantized, values, f32):
        llm = LLM(model=text, mmproj=path, **ENGINE)
        prompts = _prompts(llm)[1]
        runs[path] = (
            [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)],
            [o.outputs[0].logprobs[0].logprob for o in llm.generate(prompts, lp, use_tqdm=False)],
        )
        del llm
    assert runs[quantized][0] == runs[values][0]
    assert runs[quantized][1] == pytest.approx(runs[values][1], abs=1e-6)
    # the rounding's own effect (measured 2.5e-4 for Q8_0, 1.0e-5 for F16): bounded at 8-10x that
    assert runs[quantized][1] == pytest.approx(runs[f32][1], abs={"Q8_0": 2e-3, "F16": 1e-4}[projector_type])
