"""Vision-language models (llmserve.model.vision) on a tiny random checkpoint of each family written by the test
(tests/vision_files.py, no hub): the prompt's token ids equal transformers' processor's, and llmserve's greedy
tokens equal transformers' generate with one image and several, batched with text-only prompts and alone, with
chunked prefill cutting through images and prefix caching on; the prefix cache tells images apart."""

from __future__ import annotations

import pytest
import torch

from llmserve import LLM, SamplingParams
from llmserve.model.vision.processing import prompt_with_images
from tests.vision_files import pictures, qwen_processor, write_gemma3, write_idefics3, write_qwen_vl

MAX_TOKENS = 10
BUDGET = 16  # tokens a step: prompts are chunked, the chunks cut through Idefics3's images (not Gemma 3's)
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
# model_type -> transformers' class-name prefix (tests/vision_files.py writes its tiny checkpoint)
FAMILIES = {
    "idefics3": "Idefics3",
    "smolvlm": "SmolVLM",
    "gemma3": "Gemma3",
    "qwen2_5_vl": "Qwen2_5_VL",
    "qwen3_vl": "Qwen3VL",
}
QWEN = ("Qwen2_5_VL", "Qwen3VL")


def test_every_vision_family_has_a_row():
    from llmserve.model.registry import ARCHITECTURES

    assert set(FAMILIES) == {t for t, s in ARCHITECTURES.items() if s.images is not None}


def _chat(n_images: int, words: str) -> list[dict]:
    parts = [{"type": "image"}] * n_images + [{"type": "text", "text": words}]
    return [{"role": "user", "content": parts}]


CASES = [(1, "What is in the picture?"), (2, "Compare these two."), (0, "Just text, no image at all.")]


@pytest.fixture(scope="module", params=list(FAMILIES))
def vlm(request, tmp_path_factory, bundled_gguf):
    import transformers as T

    family = FAMILIES[request.param]
    d = tmp_path_factory.mktemp(request.param)
    if family == "Gemma3":
        write_gemma3(d, bundled_gguf)
    elif family in QWEN:
        write_qwen_vl(d, bundled_gguf, family)
    else:
        write_idefics3(d, bundled_gguf, family)
    tok = T.AutoTokenizer.from_pretrained(d)
    pil = "Qwen2VL" if family in QWEN else family
    image_processor = getattr(T, f"{pil}ImageProcessorPil").from_pretrained(d)
    if family in QWEN:  # (its processor insists on a video processor, which needs torchvision)
        processor = qwen_processor(image_processor, tok)
    elif family == "Gemma3":
        processor = T.Gemma3Processor(image_processor=image_processor, tokenizer=tok, image_seq_length=4)
    else:  # (SmolVLM's own processor needs num2words for videos; its prompt is Idefics3's, with its image processor)
        processor = T.Idefics3Processor(image_processor=image_processor, tokenizer=tok, image_seq_len=4)
    model_class = getattr(T, f"{family}ForConditionalGeneration")
    ref = model_class.from_pretrained(d, dtype=torch.float32, attn_implementation="eager")
    cases = []
    for seed, (n, words) in enumerate(CASES):
        text = tok.apply_chat_template(_chat(n, words), tokenize=False, add_generation_prompt=True)
        images = pictures(n, seed=seed)
        enc = processor(text=[text], images=[images] if images else None, return_tensors="pt", add_special_tokens=False)
        with torch.inference_mode():
            out = ref.eval().generate(
                **enc, max_new_tokens=MAX_TOKENS, min_new_tokens=MAX_TOKENS, do_sample=False, pad_token_id=0
            )
            want = out[0, enc["input_ids"].shape[1] :].tolist()
            logprob = ref(**enc).logits[0, -1].float().log_softmax(-1)[want[0]].item()  # (shows what greedy hides)
        cases.append((text, images, enc["input_ids"][0].tolist(), want, logprob))
    llm = LLM(model=str(d), kv_cache_memory=0.05, max_num_batched_tokens=BUDGET, num_threads=2, dtype="float32")
    return llm, cases


def _prompts(llm, cases):
    eng = llm.engine
    return [prompt_with_images(eng.tokenizer, eng.image_processing, text, images) for text, images, *_ in cases]


def test_prompt_ids_equal_transformers_processor(vlm):
    llm, cases = vlm
    for prompt, (_, images, ids, *_) in zip(_prompts(llm, cases), cases):
        assert list(prompt) == ids
        assert len(prompt.images) == len(images)
        assert sum(im.num_tokens for im in prompt.images) == ids.count(llm.engine.image_processing.image_token_id)


def test_greedy_equals_transformers_batched_and_alone(vlm):
    llm, cases = vlm
    assert llm.engine.config.enable_prefix_caching and llm.engine.max_num_batched_tokens < len(cases[1][2])
    want = [c[3] for c in cases]
    batched = [o.outputs[0].token_ids for o in llm.generate(_prompts(llm, cases), GREEDY, use_tqdm=False)]
    assert batched == want
    for prompt, expected in zip(_prompts(llm, cases), want):  # alone (the prompts' blocks now cached)
        out = llm.generate([prompt], GREEDY, use_tqdm=False)[0]
        assert out.outputs[0].token_ids == expected
    # the first token's logprob is transformers' (a Gemma 3 image's two-way attention shows here), fresh and cached
    lp = SamplingParams(temperature=0, max_tokens=1, logprobs=1)
    for _ in range(2):
        outs = llm.generate(_prompts(llm, cases), lp, use_tqdm=False)
        for out, case in zip(outs, cases):
            assert out.outputs[0].logprobs[0].logprob == pytest.approx(case[4], abs=1e-4)


def test_prefix_cache_keys_hold_the_image(vlm):
    """The same picture again hits the cache past its placeholders; another picture of the same size (the same
    token ids) never does, and its answer is its own (transformers' for that picture)."""
    llm, cases = vlm
    text, images, ids, want, _ = cases[0]
    eng = llm.engine
    first = llm.generate(
        [prompt_with_images(eng.tokenizer, eng.image_processing, text, images)], GREEDY, use_tqdm=False
    )
    again = llm.generate(
        [prompt_with_images(eng.tokenizer, eng.image_processing, text, images)], GREEDY, use_tqdm=False
    )
    assert first[0].outputs[0].token_ids == again[0].outputs[0].token_ids == want
    # every token but the last where the prompt is whole blocks (the last one copied on write), else every full
    # block (a partial tail holding an image's placeholders is not looked up among cached blocks)
    bs = eng.block_size
    assert again[0].num_cached_tokens == (len(ids) - 1 if len(ids) % bs == 0 else (len(ids) - 1) // bs * bs) > 0
    other = prompt_with_images(eng.tokenizer, eng.image_processing, text, pictures(1, seed=99))
    assert list(other) == ids  # the same tokens...
    out = llm.generate([other], GREEDY, use_tqdm=False)[0]
    first_image_block = other.images[0].start // eng.block_size
    assert out.num_cached_tokens <= first_image_block * eng.block_size  # ...but no block holding the image hits
    assert out.outputs[0].token_ids != want


def test_image_limits_and_text_only_models(vlm, llm_factory):
    llm, cases = vlm
    text, images, *_ = cases[1]
    eng = llm.engine
    prompt = prompt_with_images(eng.tokenizer, eng.image_processing, text, images)
    eng.config.limit_mm_per_prompt = {"image": 1}
    try:
        with pytest.raises(ValueError, match="limit-mm-per-prompt"):
            llm.generate([prompt], GREEDY, use_tqdm=False)
    finally:
        eng.config.limit_mm_per_prompt = None
    with pytest.raises(ValueError, match="placeholders"):  # an image token written as text is not an image
        prompt_with_images(eng.tokenizer, eng.image_processing, text, images[:1])
    text_only = llm_factory(max_num_batched_tokens=256, kv_cache_memory=1.0)
    with pytest.raises(ValueError, match="text-only"):
        text_only.generate([prompt], GREEDY, use_tqdm=False)
    assert text_only.engine.image_processing is None


def test_preempted_image_requests_recompute_with_the_kept_tower_output(vlm):
    """A KV pool too small for every image prompt at once: requests are preempted and recomputed (the tower's
    output kept on the request, not run again) and still answer transformers' tokens."""
    llm, cases = vlm
    longest = max(len(c[2]) for c in cases) + MAX_TOKENS  # a pool one block over the longest request's
    blocks = -(-longest // llm.engine.block_size) + 1
    small = LLM(
        model=llm.engine.model_path, num_kv_blocks=blocks, max_num_batched_tokens=BUDGET, num_threads=2, dtype="float32"
    )
    prompts = _prompts(small, cases)
    runs = []
    model = small.engine.model
    original = model.embed_image
    model.embed_image = lambda data: runs.append(1) or original(data)  # counts the tower's runs, runs it
    outs = small.generate(prompts, GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == [c[3] for c in cases]
    assert small.engine.scheduler.num_preemptions > 0
    assert len(runs) == sum(len(p.images) for p in prompts)


def test_tower_stays_float32_and_quantization_is_refused(vlm):
    llm, cases = vlm
    path = llm.engine.model_path
    bf = LLM(model=path, kv_cache_memory=0.05, num_threads=2, dtype="bfloat16")
    model = bf.engine.model
    towers = [m for m in model.children() if getattr(m, "keep_float32", False)]  # the tower and its connector
    assert len(towers) == (1 if hasattr(model, "visual") else 2)  # (Qwen's merger is its tower's)
    assert {p.dtype for m in towers for p in m.parameters()} == {torch.float32}
    assert model.embed_tokens.weight.dtype == torch.bfloat16
    out = bf.generate(_prompts(bf, cases[:1]), GREEDY, use_tqdm=False)[0]
    assert len(out.outputs[0].token_ids) == MAX_TOKENS
    with pytest.raises(ValueError, match="quantization"):
        LLM(model=path, kv_cache_memory=0.05, num_threads=2, quantization="int8")


def test_multimodal_rotary_positions_equal_transformers(vlm):
    """Qwen2.5-VL, Qwen3-VL: a request's 3-D positions (image tokens on their grid, text after an image from
    start + max(h, w)) and the offset of its later tokens are transformers' get_rope_index's."""
    llm, cases = vlm
    eng = llm.engine
    if not eng.model_config.mrope_section:
        pytest.skip("1-D rotary")
    import transformers as T

    from llmserve.model.vision.inputs import mrope_positions

    ref_class = getattr(T, eng.model_config.architecture.replace("ForConditionalGeneration", "Model"))
    ref = ref_class.from_pretrained(eng.model_path, dtype=torch.float32)
    for prompt, (_, images, ids, *_) in zip(_prompts(llm, cases), cases):
        if not images:
            assert not prompt.images
            continue
        grids = torch.stack([im.data["image_grid_thw"] for im in prompt.images])
        ids_t = torch.tensor([ids])
        kinds = (ids_t == eng.image_processing.image_token_id).int()
        want, delta = ref.get_rope_index(ids_t, mm_token_type_ids=kinds, image_grid_thw=grids)
        pos, got_delta = mrope_positions(len(prompt), prompt.images)
        assert torch.equal(pos, want[:, 0]) and got_delta == int(delta) < 0
