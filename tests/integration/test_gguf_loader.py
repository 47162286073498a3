"""GGUF files served as they come: greedy parity with transformers loading the same file (Q8_0 and a
Q4_K_M-like mix of K-quants), the file's blocks kept (never rounded twice, no float32 copy, nothing
written to the cache), and the refusals (truncated, corrupt, unknown type or architecture, too big)."""

from __future__ import annotations

import os
import shutil

import numpy as np
import pytest
import torch

from llmserve import LLM, SamplingParams
from llmserve.model.formats.gguf_layers import GGUFEmbedding, GGUFLinear
from llmserve.model.formats.quant import QuantLinear
from tests.gguf_files import LOW, MIXED, Q8, write_tiny_gguf

MAX_TOKENS = 16


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    d = tmp_path_factory.mktemp("gguf")
    return {
        "mixed": write_tiny_gguf(str(d / "mixed" / "tiny.gguf"), MIXED),
        "q8_0": write_tiny_gguf(str(d / "q8" / "tiny.gguf"), Q8, tied=True, seed=1),
        "low": write_tiny_gguf(str(d / "low" / "tiny.gguf"), LOW, seed=2),
    }


def _prompts(vocab: int) -> list[list[int]]:
    rng = np.random.default_rng(7)
    return [rng.integers(3, vocab, n).tolist() for n in (5, 23, 90)]  # 90 > the token budget: chunked


def _strip_eos(ids):
    return ids[:-1] if ids and ids[-1] == 2 else ids


@pytest.mark.parametrize("kind,keep_blocks", [("mixed", True), ("q8_0", True), ("mixed", False), ("low", True)])
def test_greedy_matches_transformers_on_the_same_gguf(files, kind, keep_blocks, monkeypatch):
    """Float32-exact from the file's blocks (GGUFLinear: what a big model gets), and widened tensor by tensor
    into plain float32 layers (a model under loader.gguf_model.WIDEN_GGUF_BYTES, as these tiny ones are)."""
    from transformers import AutoModelForCausalLM

    from llmserve.model.loader import gguf as gguf_loader
    from llmserve.model.loader import gguf_model

    monkeypatch.setattr(gguf_loader, "gguf_as_hf_folder", lambda *a: pytest.fail("a float32 folder was written"))
    path = files[kind]
    hf = AutoModelForCausalLM.from_pretrained(
        os.path.dirname(path), gguf_file=os.path.basename(path), torch_dtype=torch.float32
    ).eval()
    if keep_blocks:
        monkeypatch.setattr(gguf_model, "WIDEN_GGUF_BYTES", 0)
    llm = LLM(model=path, kv_cache_memory=0.05, max_num_batched_tokens=64)
    model = llm.engine.model
    if keep_blocks:
        qkv = model.layers[0].self_attn.qkv_proj
        assert isinstance(qkv, GGUFLinear) and qkv.exact
        assert isinstance(model.embed_tokens, GGUFEmbedding) and isinstance(model.lm_head, GGUFLinear)
        assert all("norm" in n for n, _ in model.named_parameters())  # no float weights but the norms
    else:
        assert isinstance(model.layers[0].self_attn.qkv_proj, torch.nn.Linear)
    prompts = _prompts(model.cfg.vocab_size)
    refs = []
    with torch.inference_mode():
        for ids in prompts:
            out = hf.generate(
                torch.tensor([ids]), max_new_tokens=MAX_TOKENS, do_sample=False, eos_token_id=2, pad_token_id=2
            )
            refs.append(out[0, len(ids) :].tolist())
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS)
    together = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    alone = [llm.generate([p], params, use_tqdm=False)[0].outputs[0].token_ids for p in prompts]
    for i, r in enumerate(refs):
        assert _strip_eos(together[i]) == _strip_eos(r), f"prompt {i}, batched"
        assert _strip_eos(alone[i]) == _strip_eos(r), f"prompt {i}, alone"
    assert llm.engine.kv.usage == 0


@pytest.mark.parametrize("mode", ["int8", "w8a8", "int4"])
def test_quantization_flag_never_rounds_a_quantized_tensor_again(files, mode):
    """--quantization int8 / int4 on a K-quant file: the K-quant and Q5 tensors are served from their own
    blocks (llama.cpp's integer dots), Q8_0 ones in llmserve's int8 layers with the file's values (Q8_0 / Q4_0
    parts of a GGUF projection repacked, the same values)."""
    path = files["mixed"]
    exact = LLM(model=path, kv_cache_memory=0.05).engine.model
    q = LLM(model=path, quantization=mode, kv_cache_memory=0.05).engine.model
    for i in range(len(q.layers)):
        for name in ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj"):
            a, b = q.get_submodule(f"layers.{i}.{name}"), exact.get_submodule(f"layers.{i}.{name}")
            if mode != "int4" and name == "mlp.gate_up_proj":  # its Q4_0 up: rounded to int8 (quant._from_blocks)
                assert isinstance(a, QuantLinear) and a.kind == "int8"
                continue
            assert torch.equal(a.dequantize(), b.weight), name  # the exact model: widened (a tiny one)
            assert isinstance(a, QuantLinear if name == "self_attn.o_proj" else GGUFLinear), name
            if mode == "w8a8" and name == "self_attn.o_proj":  # the file's Q8_0 blocks, x one int8 level (Q8_0 x Q8_0)
                assert a.act_bits == 8
    assert isinstance(q.lm_head, GGUFLinear) and not q.lm_head.exact
    ids = torch.tensor([3, 500, q.cfg.vocab_size - 1])
    assert torch.equal(q.embed_tokens(ids), exact.embed_tokens(ids))
    out = LLM(model=path, quantization=mode, kv_cache_memory=0.05).generate(
        [[5, 6, 7]], SamplingParams(max_tokens=4, temperature=0), use_tqdm=False
    )[0]
    assert len(out.outputs[0].token_ids) >= 1


@pytest.mark.parametrize("kind", ["mixed", "low"])
@pytest.mark.parametrize("avx512", [True, False, "twin"], ids=["avx512", "avx2", "twin"])
def test_k_quant_layers_decode_through_the_fused_stack(files, avx512, kind):
    """--quantization int4 on the Q4_K_M-like mix: the K-quant projections (q, k, v of different types in one)
    and the Q8_0 ones decode through the fused stack (all layers in one C++ call), with the module path's
    logits and tokens; both variants of the K-quant dots (AVX-512 VNNI where the CPU has it, AVX2), and the VNNI
    and AVX-512 kernels' portable twins on AVX2 ("twin": the K-quant dots and panels as a VNNI CPU runs them). The
    low-bit mix (Q2_K, Q3_K, IQ4_NL, IQ4_XS) the same way, every projection on GGUF's dots. Where the VNNI kernels run
    (the instructions, or "twin" on any CPU) the Q4_K parts are loaded repacked into panels of 16 rows ("q4k16")."""
    from llmserve import envs
    from llmserve.model.evaluate import sequence_logits
    from llmserve.model.kernels import ops

    cpu = ops.cpu_kernels()
    if cpu is None:
        pytest.skip("no compiled kernels: no fused stack")
    cpu.set_avx512(avx512 is True)
    cpu.set_avx512_twin(avx512 == "twin")
    cpu.set_vnni_twin(avx512 == "twin")
    try:
        # (no prefix caching: the second run of the prompts must compute them as the first did, not read their KV and
        # compute only the last token as a decode row, whose int4 logits may differ in the last bits from a prefill's)
        llm = LLM(model=files[kind], quantization="int4", kv_cache_memory=0.05, enable_prefix_caching=False)
        model = llm.engine.model
        layers = [model.layers[0].self_attn.qkv_proj, model.layers[0].mlp.gate_up_proj]
        q4k = "q4k16" if cpu.uses_vnni() else "gguf"
        if kind == "low":
            assert all(kinds == [16, 16, 16, 16] for _, kinds, _, _ in ops.decode_layer_args(model))  # GGUF throughout
            assert [lin.layouts for lin in layers] == [["gguf"] * 3, ["gguf"] * 2]
        else:
            assert all(kinds == [16, 8, 16, 16] for _, kinds, _, _ in ops.decode_layer_args(model))  # GGUF, int8 (Q8_0)
            # Q8_0 v beside Q4_K q, k and Q4_0 up beside a Q5_K gate: repacked parts on the int8 / int4 kernels
            assert [lin.layouts for lin in layers] == [[q4k, q4k, "int8"], ["gguf", "int4"]]
        prompts = _prompts(model.cfg.vocab_size)
        params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS)
        ids = list(range(100, 140))
        fused = sequence_logits(model, ids, decode=True)
        assert model._decode_stack, "the fused path must run here"
        fused_tokens = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        model._decode_stack = False
        modules = sequence_logits(model, ids, decode=True)
        module_tokens = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    finally:
        model._decode_stack = None
        cpu.set_avx512(bool(envs.LLMSERVE_AVX512))
        cpu.set_avx512_twin(envs.LLMSERVE_AVX512 == "twin")
        cpu.set_vnni_twin(envs.LLMSERVE_VNNI == "twin")
    assert torch.allclose(fused, modules, atol=1e-4, rtol=0), (fused - modules).abs().max()
    assert fused_tokens == module_tokens
    assert llm.engine.kv.usage == 0


# -- refusals: one error naming the file, what is wrong and what to change, before allocating -----------
def _refused(path, match, **kwargs):
    with pytest.raises(ValueError, match=match) as e:
        LLM(model=path, kv_cache_memory=0.05, **kwargs)
    assert path in str(e.value)
    return str(e.value)


def test_truncated_gguf_refused(files, tmp_path):
    src = files["q8_0"]
    cut = str(tmp_path / "cut.gguf")
    with open(src, "rb") as f, open(cut, "wb") as g:
        g.write(f.read(int(os.path.getsize(src) * 0.6)))
    msg = _refused(cut, "truncated")
    assert "again" in msg


def test_corrupt_gguf_refused(files, tmp_path):
    bad = str(tmp_path / "bad.gguf")
    shutil.copy(files["q8_0"], bad)
    with open(bad, "r+b") as f:  # the tensor count and the first key's length: nonsense sizes
        f.seek(8)
        f.write(b"\xff" * 24)
    _refused(bad, "truncated or corrupt")


def test_unknown_quant_type_refused(tmp_path):
    from gguf import GGMLQuantizationType

    import tests.gguf_files as gf

    real = gf._weight

    def with_iq2(name, qtype, rows, cols, rng):
        if qtype == "IQ2_XXS":
            return np.zeros((rows, cols // 256 * 66), np.uint8)
        return real(name, qtype, rows, cols, rng)

    gf._weight = with_iq2
    try:
        path = gf.write_tiny_gguf(str(tmp_path / "iq2.gguf"), {**Q8, "ffn_up": "IQ2_XXS"})
    finally:
        gf._weight = real
    assert GGMLQuantizationType.IQ2_XXS.name == "IQ2_XXS"
    msg = _refused(path, "IQ2_XXS")
    assert "blk.0.ffn_up.weight" in msg and "llama-quantize" in msg


def test_unknown_architecture_refused(tmp_path):
    path = write_tiny_gguf(str(tmp_path / "mamba.gguf"), Q8, arch="mamba")
    msg = _refused(path, "mamba")
    assert "--model" in msg


def test_model_that_does_not_fit_refused(files):
    path = files["q8_0"]
    with pytest.raises(ValueError, match="does not fit in memory") as e:
        LLM(model=path, kv_cache_memory=100_000)
    assert path in str(e.value) and "--kv-cache-memory" in str(e.value)
