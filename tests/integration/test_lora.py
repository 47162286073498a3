"""LoRA adapters (`enable_lora`): greedy output with an adapter equals PEFT's on transformers, alone and
batched with base-model requests and with another adapter; the prefix cache never mixes adapters; float
and quantized base weights; bad adapters fail clearly; unloading frees the adapter."""

from __future__ import annotations

import gc
import json
import weakref

import pytest
import torch

from tests.checkpoints import tiny_llama

pytest.importorskip("peft")

MAX_TOKENS = 12


@pytest.fixture(scope="module")
def lora_setup(tmp_path_factory, bundled_gguf):
    """A tiny random Llama checkpoint, two random PEFT adapters of it, and PEFT's greedy references."""
    from peft import LoraConfig, PeftModel, get_peft_model
    from transformers import LlamaForCausalLM

    from llmserve.tokenizer import Tokenizer

    root = tmp_path_factory.mktemp("lora")
    base_dir = root / "base"
    tiny_llama(
        base_dir,
        bundled_gguf,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=3,  # head_dim 64: decode steps run in the fused C++ decode stack
        max_position_embeddings=1024,
        rope_theta=10000.0,
        initializer_range=0.2,
    )
    tok = Tokenizer(bundled_gguf, gguf=True)
    adapters = {
        "all7": LoraConfig(
            r=8,
            lora_alpha=16,
            init_lora_weights=False,
            target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
        ),
        "qv_down": LoraConfig(
            r=4,
            lora_alpha=8,
            use_rslora=True,
            init_lora_weights=False,
            target_modules=["q_proj", "v_proj", "down_proj"],
        ),
    }
    for i, (name, lc) in enumerate(adapters.items()):
        torch.manual_seed(10 + i)
        peft_model = get_peft_model(LlamaForCausalLM.from_pretrained(base_dir), lc)
        peft_model.save_pretrained(root / name)
    prompts = [tok.encode(t) for t in ["Hello world", "The quick brown fox jumps over the lazy dog. " * 4, "1 2 3 4 5"]]
    refs = {}
    with torch.inference_mode():
        base = LlamaForCausalLM.from_pretrained(base_dir).eval()
        refs[None] = [_hf_greedy(base, p) for p in prompts]
        for name in adapters:
            model = PeftModel.from_pretrained(LlamaForCausalLM.from_pretrained(base_dir), root / name).eval()
            refs[name] = [_hf_greedy(model, p) for p in prompts]
    for name in adapters:
        assert refs[name] != refs[None], "the random adapter must change the output"
    return {"root": root, "base": str(base_dir), "prompts": prompts, "refs": refs}


def _hf_greedy(model, ids):
    out = model.generate(
        input_ids=torch.tensor([ids]),
        max_new_tokens=MAX_TOKENS,
        do_sample=False,
        min_new_tokens=MAX_TOKENS,
        pad_token_id=0,
    )
    return out[0, len(ids) :].tolist()


def _llm(setup, **kw):
    from llmserve import LLM

    root = setup["root"]
    kw.setdefault("lora_modules", [f"all7={root / 'all7'}", f"qv_down={root / 'qv_down'}"])
    return LLM(model=setup["base"], kv_cache_memory=0.05, max_num_batched_tokens=64, max_loras=3, max_lora_rank=8, **kw)


@pytest.fixture(scope="module")
def lora_llm(lora_setup):
    return _llm(lora_setup)


def _gen(llm, prompts, loras):
    from llmserve import SamplingParams

    outs = llm.generate(
        prompts,
        SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True),
        use_tqdm=False,
        lora_request=loras,
    )
    return [o.outputs[0].token_ids for o in outs]


def test_adapter_alone_matches_peft(lora_setup, lora_llm):
    prompts, refs = lora_setup["prompts"], lora_setup["refs"]
    for name in ("all7", "qv_down"):
        for i, p in enumerate(prompts):
            assert _gen(lora_llm, [p], [name]) == [refs[name][i]], (name, i)


def test_adapters_batched_with_base_and_each_other(lora_setup, lora_llm):
    from llmserve import LoRARequest

    prompts, refs = lora_setup["prompts"], lora_setup["refs"]
    batch, loras, want = [], [], []
    for i, p in enumerate(prompts):
        for name in (None, "all7", "qv_down"):
            batch.append(p)
            loras.append(LoRARequest(name, 1) if name == "all7" else name)
            want.append(refs[name][i])
    assert _gen(lora_llm, batch, loras) == want


def test_prefix_cache_never_shared_across_adapters(lora_setup, lora_llm):
    """The same long prompt under the base model, then an adapter, then the other: each computes its own KV."""
    p, refs = lora_setup["prompts"][1], lora_setup["refs"]
    kv = lora_llm.engine.kv
    for name in (None, "all7", "qv_down", "all7"):
        hits = kv.prefix_cache_hits
        assert _gen(lora_llm, [p], [name]) == [refs[name][1]], name
    assert kv.prefix_cache_hits > hits  # the second all7 run reused all7's own blocks


@pytest.mark.parametrize("mode", ["int8", "int4"])
def test_quantized_base(lora_setup, mode):
    """Over quantized weights an adapter changes the output; with int8 a request's output is the same
    alone and batched with base and the other adapter (int4's kernels round activations differently by
    row count, base requests included, so its batches are not bit-stable)."""
    llm = _llm(lora_setup, quantization=mode)
    prompts = lora_setup["prompts"]
    alone = {name: _gen(llm, prompts, [name] * len(prompts)) for name in (None, "all7", "qv_down")}
    assert alone["all7"] != alone[None] and alone["qv_down"] != alone[None]
    mixed = _gen(llm, prompts * 3, [None] * 3 + ["all7"] * 3 + ["qv_down"] * 3)
    if mode == "int8":
        assert mixed == alone[None] + alone["all7"] + alone["qv_down"]


@pytest.mark.parametrize("mode", ["int8", "int4"])
def test_hook_adds_the_low_rank_update_to_quantized_layers(lora_setup, mode):
    """The update over a QuantLinear is the layer's own output plus x A^T B^T scaling (PEFT's formula)."""
    from safetensors.torch import load_file

    llm = _llm(lora_setup, quantization=mode)
    model, layers = llm.engine.model, llm.engine.lora.layers
    adapter = llm.engine.lora.get("all7")
    proj = model.layers[1].mlp.down_proj
    x = torch.randn(5, proj.in_features)
    with torch.inference_mode():
        base = proj(x)
        layers.set_step([(adapter, 1, 3)], torch.device("cpu"))
        try:
            out = proj(x)
        finally:
            layers.set_step([], torch.device("cpu"))
    w = load_file(str(lora_setup["root"] / "all7" / "adapter_model.safetensors"))
    key = "base_model.model.model.layers.1.mlp.down_proj.lora_{}.weight"
    delta = x[1:4] @ w[key.format("A")].t() @ w[key.format("B")].t() * (16 / 8)
    torch.testing.assert_close(out[1:4], base[1:4] + delta, rtol=1e-4, atol=1e-4)
    assert torch.equal(out[0], base[0]) and torch.equal(out[4], base[4])


def _write_adapter(src, dst, config=None, tensors=None):
    import shutil

    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst)
    cfg = json.loads((dst / "adapter_config.json").read_text())
    cfg.update(config or {})
    (dst / "adapter_config.json").write_text(json.dumps(cfg))
    if tensors is not None:
        save_file(tensors(load_file(str(dst / "adapter_model.safetensors"))), str(dst / "adapter_model.safetensors"))
    return str(dst)


def test_bad_adapters_fail_clearly_and_unload_frees(lora_setup, lora_llm, tmp_path):
    from llmserve.engine.lora import LoRAError

    src = lora_setup["root"] / "all7"
    reg = lora_llm.engine.lora
    cases = {
        "missing": (str(tmp_path / "nowhere"), "not a directory"),
        "no_config": (str(tmp_path), "no adapter_config.json"),
        "rank": (
            _write_adapter(
                src,
                tmp_path / "r",
                tensors=lambda t: {
                    k: (torch.cat([v, v]) if ".lora_A." in k else torch.cat([v, v], dim=1)) for k, v in t.items()
                },
            ),
            "more than --max-lora-rank 8",
        ),
        "target": (
            _write_adapter(src, tmp_path / "t", {"target_modules": ["q_proj", "c_attn"]}),
            "target modules ['c_attn'] are not in this model",
        ),
        "tensor": (
            _write_adapter(
                src,
                tmp_path / "x",
                tensors=lambda t: {**t, "base_model.model.lm_head.lora_A.weight": torch.zeros(8, 128)},
            ),
            "not a LoRA update",
        ),
        "shape": (
            _write_adapter(
                src,
                tmp_path / "s",
                tensors=lambda t: {
                    k: v[:, :64].contiguous() if k.endswith("q_proj.lora_A.weight") else v for k, v in t.items()
                },
            ),
            "do not fit",
        ),
        "corrupt": (_write_adapter(src, tmp_path / "c"), "cannot read"),
        "dora": (_write_adapter(src, tmp_path / "d", {"use_dora": True}), "DoRA"),
    }
    (tmp_path / "c" / "adapter_model.safetensors").write_bytes(b"not safetensors")
    for name, (path, message) in cases.items():
        with pytest.raises(LoRAError, match=message.replace("[", r"\[").replace("]", r"\]")):
            reg.load(name, path)
    with pytest.raises(LoRAError, match="already loaded"):
        reg.load("all7", str(src))
    reg.load("third", str(src))
    try:
        with pytest.raises(LoRAError, match="--max-loras"):
            reg.load("fourth", str(src))
        with pytest.raises(ValueError, match="no LoRA adapter named 'nope'"):
            _gen(lora_llm, [[1, 2, 3]], ["nope"])
        assert _gen(lora_llm, lora_setup["prompts"][:1], ["third"]) == [lora_setup["refs"]["all7"][0]]
    finally:
        adapter = reg.unload("third")
    ref = weakref.ref(next(iter(adapter.weights.values()))[0])
    del adapter
    gc.collect()
    assert ref() is None, "an unloaded adapter's weights are freed"
    assert reg.get("third") is None and sorted(reg.names()) == ["all7", "qv_down"]
    assert lora_llm.engine.kv.num_free_blocks == lora_llm.engine.num_blocks  # blocks all came back


def test_lora_decode_steps_run_in_the_fused_stack(lora_setup, lora_llm, monkeypatch):
    """Decode steps with adapter rows (mixed with base rows and both adapters) run through the fused C++
    decode stack (DecodeStack.run_lora) and give the same tokens as the module path's hooks, with the fused
    stack off (KernelConfig.fused_decode_rows = 0) and with LoRA kept out of it (lora.FUSED = False)."""
    from llmserve.model import lora as lora_mod
    from llmserve.model.kernels import ops

    model = lora_llm.engine.model
    prompts = lora_setup["prompts"]
    batch = prompts * 3
    loras = [None] * 3 + ["all7"] * 3 + ["qv_down"] * 3
    _gen(lora_llm, prompts[:1], ["all7"])  # builds the stack
    stack = model._decode_stack
    assert stack, "the test model must fit the fused decode stack (head_dim 64)"
    calls = []

    class Counting:  # the pybind object's methods cannot be patched: wrap it
        def run(self, *a):
            calls.append("run")
            return stack.run(*a)

        def run_lora(self, *a):
            calls.append("run_lora")
            return stack.run_lora(*a)

    monkeypatch.setattr(model, "_decode_stack", Counting())
    fused = _gen(lora_llm, batch, loras)
    assert calls.count("run_lora") >= MAX_TOKENS - 1, calls
    assert fused == [lora_setup["refs"][n][i % 3] for i, n in enumerate(loras)]
    calls.clear()
    monkeypatch.setattr(lora_mod, "FUSED", False)
    assert _gen(lora_llm, batch, loras) == fused
    assert "run_lora" not in calls
    monkeypatch.setattr(lora_mod, "FUSED", True)
    monkeypatch.setattr(ops.kernel_config(), "fused_decode_rows", 0)
    assert _gen(lora_llm, batch, loras) == fused
    assert not calls
