"""The default weight mode of a quantized GGUF (`--quantization auto` -> gguf, llmserve/model/loader/mode.py): the
file's own blocks with integer dots, float tensors kept float; `--quantization none` still the float32-exact mode.
Its quality bar against float32 here is vLLM's top-5 rule (benchmarks/quality/vs_llamacpp.py holds it to
llama.cpp's own output on the same file, which CI does not have)."""

from __future__ import annotations

import pytest
import torch

from llmserve import LLM, SamplingParams
from llmserve.model.evaluate import top_k_broken
from llmserve.model.formats.gguf_layers import GGUFLinear
from llmserve.model.formats.quant import QuantLinear
from llmserve.model.kernels.kinds import Q8_1_ROUNDING
from tests.gguf_files import MIXED, write_tiny_gguf
from tests.integration.prompts import CHATS


@pytest.fixture(autouse=True)
def blocks_on(monkeypatch):
    monkeypatch.setenv("LLMSERVE_GGUF_BLOCKS", "1")  # the default outside the test suite (tests/conftest.py)


@pytest.fixture(scope="module")
def engines():
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("LLMSERVE_GGUF_BLOCKS", "1")
        auto = LLM(kv_cache_memory=0.3, max_model_len=1024)
        exact = LLM(quantization="none", dtype="float32", kv_cache_memory=0.3, max_model_len=1024)
    yield auto, exact


def test_bundled_gguf_defaults_to_its_own_blocks(engines):
    auto, exact = engines
    assert auto.engine.config.quantization == "gguf" and auto.engine.dtype is torch.float32
    down = auto.engine.model.layers[0].mlp.down_proj
    assert isinstance(down, QuantLinear) and down.kind == "int4"  # the file's Q4_1 blocks, packed as they are
    # x rounded as llama.cpp's Q8_1 blocks (its reference), in the module path and the fused decode stack alike
    assert down.q8_1 and down._kargs[-1] is True
    assert down.kernel_args()[1] == Q8_1_ROUNDING
    assert exact.engine.config.quantization is None
    assert isinstance(exact.engine.model.layers[0].mlp.down_proj, torch.nn.Linear)


def test_default_mode_within_top5_of_float32(engines):
    """At the first token where the gguf mode and float32 part, each side's token is in the other's top-5."""
    auto, exact = engines
    params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True, logprobs=5)
    a = [o.outputs[0] for o in auto.generate(CHATS, params, use_tqdm=False)]
    b = [o.outputs[0] for o in exact.generate(CHATS, params, use_tqdm=False)]
    broken = top_k_broken(a, b, k=5)
    assert not broken, broken
    assert auto.engine.kv.usage == 0


def test_gguf_mode_keeps_float_tensors_float(tmp_path):
    """A file mixing K-quants, Q4_0 / Q8_0 and a float matrix: the K-quants on llama.cpp's dots (not exact), Q4_0 /
    Q8_0 packed, the F32 matrix left float (int4 would round it)."""
    path = write_tiny_gguf(str(tmp_path / "mix" / "tiny.gguf"), {**MIXED, "attn_output": "F32"})
    llm = LLM(model=path, kv_cache_memory=0.05)
    layer = llm.engine.model.layers[0]
    assert llm.engine.config.quantization == "gguf"
    assert isinstance(layer.self_attn.o_proj, torch.nn.Linear) and not isinstance(layer.self_attn.o_proj, QuantLinear)
    assert isinstance(layer.self_attn.qkv_proj, GGUFLinear) and not layer.self_attn.qkv_proj.exact
    out = llm.generate([[5, 6, 7, 8]], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 4
    int4 = LLM(model=path, quantization="int4", kv_cache_memory=0.05)
    o_proj = int4.engine.model.layers[0].self_attn.o_proj
    assert isinstance(o_proj, QuantLinear)
    # int4 mode keeps its own rounding of x (float32 scale and sum: closer to float32), gguf mode llama.cpp's
    assert not o_proj.q8_1 and o_proj.kernel_args()[1] != Q8_1_ROUNDING


def test_gguf_mode_refused_for_a_float_checkpoint(tmp_path):
    path = write_tiny_gguf(str(tmp_path / "f32" / "tiny.gguf"), {k: "F32" for k in MIXED})
    with pytest.raises(ValueError, match="gguf serves a GGUF file's own quantized blocks"):
        LLM(model=path, quantization="gguf", kv_cache_memory=0.05)
    assert LLM(model=path, kv_cache_memory=0.05).engine.config.quantization is None
