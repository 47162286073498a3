"""--quantization int8 / int4: close to float32 on the same weights, by the numbers the issue sets.

Greedy agreement is teacher-forced: both models score the same 1,000 tokens that float32 generated
(10 chat prompts x 100 tokens), and each position counts once. Perplexity is on a shipped text
(tests/data/alice.txt, public domain). Both are measured twice: as one prefill (many rows per matmul:
the float16 GEMM) and one token per step as decoding runs (the integer-dot kernels on the packed
weights and the in-place decode attention)."""

from __future__ import annotations

import os

import pytest
import torch

from llmserve.engine.request import SamplingParams
from llmserve.model.evaluate import greedy_agreement, perplexity
from llmserve.model.formats.quant import Int8Embedding, QuantLinear
from tests.integration.prompts import CHATS

TEXT = os.path.join(os.path.dirname(__file__), "..", "data", "alice.txt")
PROMPTS = CHATS + [
    "Tell me about the history of Rome.",
    "Write a Python function that reverses a string.",
    "Why is the sky blue?",
    "Give me a recipe for pancakes.",
]


@pytest.fixture(scope="module")
def reference(llm):
    """(float32 model, [(prompt + 100 generated ids, 100)], token ids of the text)."""
    params = SamplingParams(max_tokens=100, temperature=0, ignore_eos=True)
    outs = llm.chat([[{"role": "user", "content": p}] for p in PROMPTS], params, use_tqdm=False)
    seqs = [(o.prompt_token_ids + o.outputs[0].token_ids, 100) for o in outs]
    assert sum(k for _, k in seqs) == 1000
    with open(TEXT) as f:
        text_ids = llm.get_tokenizer().encode(f.read())
    return llm.engine.model, seqs, text_ids


@pytest.mark.parametrize(
    "mode,max_ppl_change,min_agreement", [("int8", 0.03, 0.95), ("w8a8", 0.02, 0.94), ("int4", 0.10, 0.90)]
)
def test_quantized_close_to_float32(llm_factory, reference, mode, max_ppl_change, min_agreement):
    ref_model, seqs, text_ids = reference
    q = llm_factory(quantization=mode, kv_cache_memory=0.25)
    model = q.engine.model
    assert isinstance(model.layers[0].mlp.down_proj, QuantLinear)
    assert isinstance(model.embed_tokens, Int8Embedding) and isinstance(model.lm_head, QuantLinear)
    # w8a8: every projection's activations one int8 level per token, rotated first by Hadamard blocks of 64 (as its
    # weights were), but the LM head's two levels
    layers = [(n.rsplit(".", 1)[-1], m) for n, m in model.named_modules() if isinstance(m, QuantLinear)]
    bits = {name: (m.act_bits, m.hadamard) for name, m in layers}
    one = (8, 64) if mode == "w8a8" else (16, 0)
    head = (8, 0) if mode == "int4" else (16, 0)
    assert bits == {"qkv_proj": one, "o_proj": one, "gate_up_proj": one, "down_proj": one, "lm_head": head}
    if mode == "w8a8":  # laid out for the integer GEMM at every row count as int8 mode's layers are (VNNI, oneDNN)
        layouts = {(m.qweight.dim(), m.qweight.is_mkldnn) for m in model.layers.modules() if isinstance(m, QuantLinear)}
        assert len(layouts) == 1 and all(m.per_token for m in model.layers[0].modules() if isinstance(m, QuantLinear))
    ppl_ref = perplexity(ref_model, text_ids)
    for decode in (False, True):
        ppl_q = perplexity(model, text_ids, decode=decode)
        agreement = greedy_agreement(model, ref_model, seqs, decode=decode)
        print(
            f"{mode} ({'decode steps' if decode else 'prefill'}): perplexity {ppl_q:.3f} vs float32 "
            f"{ppl_ref:.3f} ({ppl_q / ppl_ref - 1:+.2%}); greedy agreement {agreement:.1%} over 1,000 tokens"
        )
        assert abs(ppl_q / ppl_ref - 1) <= max_ppl_change
        assert agreement >= min_agreement
    # and it serves: a short greedy answer through the engine
    out = q.chat(
        [[{"role": "user", "content": "What is the capital of France?"}]],
        SamplingParams(max_tokens=12, temperature=0),
        use_tqdm=False,
    )[0]
    assert "Paris" in out.outputs[0].text, out.outputs[0].text
    assert q.engine.kv.usage == 0


def _weight(layer) -> torch.Tensor:
    """A float32-exact layer's weight: widened (a small model: nn.Linear) or read from its blocks (GGUFLinear)."""
    return layer.weight if isinstance(layer, torch.nn.Linear) else layer.dequantize()


def test_gguf_blocks_kept_as_in_the_file(llm, llm_factory):
    """--quantization int4 on the bundled Q4_1 GGUF holds the file's own blocks: every projection
    equals gguf-py's dequantization of the file (the float32-exact model's blocks), bit for bit, and the tied
    Q8_0 embedding / LM head is one int8 table with a scale per 32 values."""
    ref = llm.engine.model
    q = llm_factory(quantization="int4", kv_cache_memory=0.1).engine.model
    for i in (0, len(ref.layers) - 1):
        for name in ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj"):
            a, b = q.get_submodule(f"layers.{i}.{name}"), ref.get_submodule(f"layers.{i}.{name}")
            assert a.kind == "int4" and torch.equal(a.dequantize(), _weight(b)), name
    head = q.lm_head
    assert head.kind == "int8" and head.scale.shape == (ref.cfg.vocab_size, ref.cfg.hidden_size // 32)
    assert torch.equal(head.dequantize(), _weight(ref.lm_head))
    assert q.embed_tokens.qweight is head.qweight  # tied: one copy
    ids = torch.tensor([0, 17, ref.cfg.vocab_size - 1])
    assert torch.equal(q.embed_tokens(ids), ref.embed_tokens(ids))


def test_gguf_quantized_layers_never_read_as_float32(monkeypatch):
    """With --quantization int4 the GGUF's Q4_1 / Q8_0 tensors go straight into the quantized layers:
    the loader reads only the other tensors (the norms) as float32, nothing for the projections."""
    from llmserve.model import loader

    read = []
    real = loader.GGUFTensors.__getitem__

    def recording(self, name):
        read.append(name)
        return real(self, name)

    monkeypatch.setattr(loader.GGUFTensors, "__getitem__", recording)
    from llmserve import LLM

    model = LLM(quantization="int4", kv_cache_memory=0.05).engine.model  # a fresh load, not a cached one
    assert read and all(n.endswith("norm.weight") for n in read), [n for n in read if "norm" not in n][:5]
    assert len(read) == 2 * len(model.layers) + 1


def test_fused_decode_layer_equals_the_module_path(llm_factory):
    """Decode rows run each layer as one C++ call (ops.decode_layer); the same steps through the
    modules give the same logits."""
    from llmserve.model.evaluate import sequence_logits

    ids = list(range(100, 140))
    for mode in ("int4", "int8"):
        model = llm_factory(quantization=mode, kv_cache_memory=0.1).engine.model
        fused = sequence_logits(model, ids, decode=True)
        assert model._decode_stack, "the fused path must be available here"
        model._decode_stack = False
        modules = sequence_logits(model, ids, decode=True)
        model._decode_stack = None
        assert torch.allclose(fused, modules, atol=1e-4, rtol=0), (mode, (fused - modules).abs().max())


@pytest.mark.parametrize("layout", ["vnni", "onednn"])
def test_packed_int8_weights_keep_the_int8_numbers(llm_factory, reference, layout):
    """int8 projections packed in the VNNI layout for llmserve's own integer GEMM (default where the CPU has it), or
    in oneDNN's (without: KernelConfig.int8_vnni False, packed_weights True; auto packs a 1B model's): the integer
    GEMM (per-token activations, two levels) at every row count, on the module path and in the fused decode stack.
    A prefill gives the plain int8 weights' logits (the same integer sums); decode steps, which the plain weights
    run through the int16 dots, stay within int8's agreement and perplexity bounds."""
    from llmserve import LLM
    from llmserve.config import KernelConfig
    from llmserve.model.evaluate import sequence_logits
    from llmserve.model.kernels import ops

    ref_model, seqs, text_ids = reference
    saved = ops.kernel_config()
    try:
        plain_kernels = KernelConfig(int8_vnni=False)  # SmolLM2: plain projections; its grouped head: a packed copy
        plain = LLM(quantization="int8", kv_cache_memory=0.1, kernels=plain_kernels).engine.model
        assert plain.layers[0].mlp.down_proj.qweight.dim() == 2
        kernels = KernelConfig(packed_weights=True, int8_vnni=layout == "vnni")
        packed_llm = LLM(quantization="int8", kv_cache_memory=0.25, kernels=kernels)
        model = packed_llm.engine.model
        w = model.layers[0].mlp.down_proj.qweight
        if not (w.dim() == 4 if layout == "vnni" else w.is_mkldnn):
            pytest.skip("no AVX-512 VNNI here" if layout == "vnni" else "no oneDNN int8 matmul in this torch")
        ids = list(range(100, 160))
        got, want = sequence_logits(model, ids), sequence_logits(plain, ids)
        assert torch.allclose(got, want, atol=1e-4, rtol=0), (got - want).abs().max()
        fused = sequence_logits(model, ids, decode=True)
        assert model._decode_stack, "the fused path must run here"
        model._decode_stack = False
        modules = sequence_logits(model, ids, decode=True)
        model._decode_stack = None
        assert torch.allclose(fused, modules, atol=1e-4, rtol=0), (fused - modules).abs().max()
        ppl_ref = perplexity(ref_model, text_ids)
        for decode in (False, True):
            ppl = perplexity(model, text_ids, decode=decode)
            agreement = greedy_agreement(model, ref_model, seqs, decode=decode)
            print(f"packed int8 ({'decode' if decode else 'prefill'}): {ppl / ppl_ref - 1:+.2%}, {agreement:.1%}")
            assert abs(ppl / ppl_ref - 1) <= 0.03 and agreement >= 0.95
        out = packed_llm.generate([ids], SamplingParams(max_tokens=8, temperature=0), use_tqdm=False)[0]
        assert packed_llm.engine.kv.usage == 0 and len(out.outputs[0].token_ids) == 8
    finally:
        ops.configure(saved)
