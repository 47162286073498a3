"""The model's configuration: `ModelConfig`, what a decoder is built from (sizes and per-architecture
features), read from a checkpoint's transformers config."""

from __future__ import annotations

from dataclasses import dataclass

SUPPORTED_ARCHITECTURES = {  # architecture -> its config's model_type
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "Phi3ForCausalLM": "phi3",
    "Gemma2ForCausalLM": "gemma2",
    "Gemma3ForCausalLM": "gemma3_text",
    "MixtralForCausalLM": "mixtral",
    "Qwen3MoeForCausalLM": "qwen3_moe",
}
GEMMA = ("Gemma2ForCausalLM", "Gemma3ForCausalLM")
ACTIVATIONS = {"silu": "silu", "swish": "silu", "gelu_pytorch_tanh": "gelu_tanh"}


@dataclass
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool = False
    mlp_bias: bool = False
    rope_scaling: dict | None = None
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    hf_config: object = None  # the transformers config, for rope variants
    # per-architecture features (defaults: Llama's)
    qk_norm: bool = False  # RMSNorm over each q and k head before rotary (Qwen3, Gemma 3)
    norm_offset: bool = False  # norms scale by (1 + weight) (Gemma: folded into the weight at load)
    embed_scale: float | None = None  # embeddings times sqrt(hidden) (Gemma)
    sandwich_norms: bool = False  # norms after attention and after the MLP too (Gemma 2/3)
    attn_scale: float | None = None  # query_pre_attn_scalar ** -0.5 (Gemma); None: head_dim ** -0.5
    attn_softcap: float | None = None  # attention logits -> tanh(s / cap) * cap (Gemma 2)
    final_softcap: float | None = None  # the same on the output logits (Gemma 2)
    hidden_act: str = "silu"  # the gated MLP's activation: silu | gelu_tanh
    sliding_window: int | None = None  # the sliding layers attend to this many last positions
    sliding_layers: tuple[bool, ...] = ()  # per layer (empty: none)
    num_experts: int = 0  # > 0: routed experts (llmserve.model.moe) in the moe_layers
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    moe_layers: tuple[bool, ...] = ()
    norm_topk_prob: bool = True  # renormalise the top-k routing weights to sum to 1

    @classmethod
    def from_hf(cls, hf) -> "ModelConfig":
        archs = list(getattr(hf, "architectures", None) or [])
        arch = next((a for a in archs if a in SUPPORTED_ARCHITECTURES), None)
        if arch is None and getattr(hf, "model_type", None) in SUPPORTED_ARCHITECTURES.values():
            arch = {v: k for k, v in SUPPORTED_ARCHITECTURES.items()}[hf.model_type]
        if arch is None:
            raise ValueError(
                f"model: unsupported architecture {archs or getattr(hf, 'model_type', '?')}; "
                f"llmserve runs {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        heads = hf.num_attention_heads
        rope = getattr(hf, "rope_parameters", None) or getattr(hf, "rope_scaling", None) or {}
        rope = rope.get("full_attention", rope)  # Gemma 3: one set per layer type (see Rotary)
        theta = rope.get("rope_theta", getattr(hf, "rope_theta", 10000.0))
        scaling = rope if rope.get("rope_type", rope.get("type", "default")) != "default" else None
        eos = hf.eos_token_id
        eos = tuple(eos) if isinstance(eos, (list, tuple)) else ((eos,) if eos is not None else ())
        return cls(
            architecture=arch,
            vocab_size=hf.vocab_size,
            hidden_size=hf.hidden_size,
            intermediate_size=hf.intermediate_size,
            num_layers=hf.num_hidden_layers,
            num_heads=heads,
            num_kv_heads=getattr(hf, "num_key_value_heads", None) or heads,
            head_dim=getattr(hf, "head_dim", None) or hf.hidden_size // heads,
            rms_norm_eps=hf.rms_norm_eps,
            rope_theta=float(theta),
            max_position_embeddings=hf.max_position_embeddings,
            tie_word_embeddings=bool(getattr(hf, "tie_word_embeddings", False)),
            attention_bias=bool(getattr(hf, "attention_bias", False)) or arch == "Qwen2ForCausalLM",
            mlp_bias=bool(getattr(hf, "mlp_bias", False)),
            rope_scaling=scaling,
            bos_token_id=hf.bos_token_id,
            eos_token_ids=eos,
            hf_config=hf,
            **_features(hf, arch),
        )


def _features(hf, arch: str) -> dict:
    """ModelConfig's per-architecture fields from a transformers config; refuses what llmserve lacks."""
    layers = hf.num_hidden_layers
    act = getattr(hf, "hidden_activation", None) or getattr(hf, "hidden_act", "silu")
    if act not in ACTIVATIONS:
        raise ValueError(f"model: {arch} with activation {act!r} is not supported (llmserve runs {list(ACTIVATIONS)})")
    if getattr(hf, "use_bidirectional_attention", False):
        raise ValueError(f"model: {arch} with use_bidirectional_attention is not supported")
    window = getattr(hf, "sliding_window", None)
    types = getattr(hf, "layer_types", None)
    sliding = tuple(t == "sliding_attention" for t in types) if types else (window is not None,) * layers
    f = dict(
        hidden_act=ACTIVATIONS[act],
        sliding_window=window,
        sliding_layers=sliding if window else (),
        qk_norm=arch in ("Qwen3ForCausalLM", "Qwen3MoeForCausalLM", "Gemma3ForCausalLM"),
    )
    if arch in GEMMA:
        f.update(
            norm_offset=True,
            embed_scale=hf.hidden_size**0.5,
            sandwich_norms=True,
            attn_scale=hf.query_pre_attn_scalar**-0.5,
            attn_softcap=getattr(hf, "attn_logit_softcapping", None),
            final_softcap=getattr(hf, "final_logit_softcapping", None),
        )
    if arch == "MixtralForCausalLM":
        f.update(
            num_experts=hf.num_local_experts,
            num_experts_per_tok=hf.num_experts_per_tok,
            moe_intermediate_size=hf.intermediate_size,
            moe_layers=(True,) * layers,
        )
    elif arch == "Qwen3MoeForCausalLM":
        sparse = tuple(
            i not in (hf.mlp_only_layers or []) and hf.num_experts > 0 and (i + 1) % hf.decoder_sparse_step == 0
            for i in range(layers)
        )
        f.update(
            num_experts=hf.num_experts,
            num_experts_per_tok=hf.num_experts_per_tok,
            moe_intermediate_size=hf.moe_intermediate_size,
            moe_layers=sparse,
            norm_topk_prob=bool(hf.norm_topk_prob),
        )
    return f
