"""The families of plain Llama layers with features: Llama, Mistral (llama.cpp writes its files as llama ones), Qwen2
(attention biases), Qwen3 (q / k norms), Phi-3 (packed projections, longrope factors read from the GGUF file's
tensors), SmolLM3 (every 4th layer without rotary). All build `LlamaModel`."""

from __future__ import annotations

from llmserve.model.specs.spec import GGUF_LLAMA_LAYERS, GGUF_QK_NORMS, NO_STACK, ArchSpec, GGUFMetadata, GGUFSpec


def gguf_phi3(meta: GGUFMetadata, kw: dict, theta: float) -> dict:
    extra = {"sliding_window": meta.get("attention.sliding_window") or None}  # (llama.cpp writes 0 for none)
    rot = meta.get("rope.dimension_count", kw["head_dim"])
    if rot != kw["head_dim"]:  # Phi-4-mini: partial rotary (q / k rows in layers.head_order, blocks too)
        extra["partial_rotary_factor"] = rot / kw["head_dim"]
    if "rope_factors_long.weight" in meta.tensor_names:  # longrope: the converter writes the factors as tensors
        extra["rope_scaling"] = {
            "rope_type": "longrope",
            "rope_theta": theta,
            "long_factor": meta.tensor("rope_factors_long.weight").tolist(),
            "short_factor": meta.tensor("rope_factors_short.weight").tolist(),
            "original_max_position_embeddings": meta.get("rope.scaling.original_context_length"),
        }
        extra["original_max_position_embeddings"] = meta.get("rope.scaling.original_context_length")
    return extra


def smollm3_fields(hf) -> dict:
    return dict(nope_layers=tuple(not use_rope for use_rope in hf.no_rope_layers))  # (1: the layer rotates)


def gguf_smollm3(meta: GGUFMetadata, kw: dict, theta: float) -> dict:
    return dict(no_rope_layer_interval=4)  # (llama.cpp's, fixed: the converter writes none)


# -- the specs -------------------------------------------------------------------------------------------------------
SPECS = (
    ArchSpec(
        "llama",
        ("LlamaForCausalLM",),
        gguf=GGUFSpec("llama", "LlamaConfig", GGUF_LLAMA_LAYERS, permute_qk=True, head_dim_key="rope.dimension_count"),
    ),
    ArchSpec("mistral", ("MistralForCausalLM",)),  # (llama.cpp writes Mistral files as llama ones),
    ArchSpec(
        "qwen2",
        ("Qwen2ForCausalLM",),
        features=dict(attention_bias=True),
        gguf=GGUFSpec("qwen2", "Qwen2Config", GGUF_LLAMA_LAYERS),
    ),
    ArchSpec(
        "qwen3",
        ("Qwen3ForCausalLM",),
        features=dict(qk_norm=True),
        gguf=GGUFSpec(
            "qwen3", "Qwen3Config", {**GGUF_LLAMA_LAYERS, **GGUF_QK_NORMS}, head_dim_key="attention.key_length"
        ),
        **NO_STACK,
    ),
    ArchSpec(
        "phi3",
        ("Phi3ForCausalLM",),
        # one attn_qkv (q, k, v rows) and one ffn_up holding gate and up, as Hugging Face's own packed layers
        gguf=GGUFSpec(
            "phi3",
            "Phi3Config",
            {**GGUF_LLAMA_LAYERS, "attn_qkv": "self_attn.qkv_proj", "ffn_up": "mlp.gate_up_proj"},
            config=gguf_phi3,
        ),
        tensor_parallel=False,  # its checkpoint packs q/k/v and gate/up, which the slicing expects apart
    ),
    # SmolLM3: Llama layers, every 4th without rotary (the model takes the module path where any is: the
    # fused stack rotates every layer)
    ArchSpec(
        "smollm3",
        ("SmolLM3ForCausalLM",),
        config=smollm3_fields,
        gguf=GGUFSpec(
            "smollm3",
            "SmolLM3Config",
            GGUF_LLAMA_LAYERS,
            permute_qk=True,
            head_dim_key="rope.dimension_count",
            config=gguf_smollm3,
        ),
    ),
)
