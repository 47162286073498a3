"""The architecture table, ARCHITECTURES (one `ArchSpec` per family, from the family modules of llmserve.model.specs),
and the look-ups over it: the spec of a Hugging Face class or of a GGUF file's architecture, the model class that
builds it, a vision-language model's image processing; and `config_from_hf`, which maps a transformers config onto
`ModelConfig` (the fields every family has, then the spec's own).
"""

from __future__ import annotations

from llmserve.model.config import ModelConfig
from llmserve.model.specs import gemma, glm4, gpt_oss, granite, lfm2, llama, moe, olmo2, vision
from llmserve.model.specs.spec import ArchSpec

ACTIVATIONS = {"silu": "silu", "swish": "silu", "gelu_pytorch_tanh": "gelu_tanh"}  # transformers' -> the MLP's

# every family's specs, by model_type (a new family's module joins this list: docs/contributing.md)
FAMILIES = (llama, granite, olmo2, glm4, gemma, moe, gpt_oss, lfm2, vision)
ARCHITECTURES = {s.model_type: s for family in FAMILIES for s in family.SPECS}
_BY_CLASS = {a: s for s in ARCHITECTURES.values() for a in s.hf_architectures}
SUPPORTED_ARCHITECTURES = tuple(_BY_CLASS)  # the Hugging Face class names llmserve runs


# -- look-ups -----------------------------------------------------------------------------------
def arch_spec(architecture: str) -> ArchSpec:
    """The spec of a Hugging Face architecture (ModelConfig.architecture)."""
    spec = _BY_CLASS.get(architecture)
    if spec is None:
        raise ValueError(
            f"model: unsupported architecture {architecture!r}; llmserve runs {', '.join(SUPPORTED_ARCHITECTURES)}"
        )
    return spec


def gguf_family(arch: str, experts: bool = False) -> ArchSpec | None:
    """The spec whose GGUF files are `arch` ones (general.architecture), with or without routed experts;
    None for an architecture llmserve does not read from GGUF."""
    rows = [s for s in ARCHITECTURES.values() if s.gguf is not None and s.gguf.arch == arch]
    return next((s for s in rows if s.gguf.experts == experts), next((s for s in rows if not s.gguf.experts), None))


def gguf_architectures() -> str:
    """The GGUF architectures llmserve reads, in words (for errors)."""
    plain = dict.fromkeys(s.gguf.arch for s in ARCHITECTURES.values() if s.gguf and not s.gguf.experts)
    mixed = [
        f"{s.hf_architectures[0]} as {s.gguf.arch} with experts"
        for s in ARCHITECTURES.values()
        if s.gguf and s.gguf.experts
    ]
    return ", ".join(plain) + "".join(f", and {m}" for m in mixed)


def make_model(cfg: ModelConfig, max_positions: int | None = None):
    """The model of `cfg`'s family (its spec's model_class), built on the current device."""
    return arch_spec(cfg.architecture).model_class(cfg, max_positions)


def image_processing(cfg: ModelConfig, path: str):
    """A vision-language model's image processing (vision.processing.ImageProcessing) read from its folder, or
    from the settings its --mmproj file holds (loader.mmproj.vlm_config); None for a text-only model."""
    spec = arch_spec(cfg.architecture)
    if spec.images is None or cfg.mm_config is None:
        return None
    return spec.images(getattr(cfg.mm_config, "mmproj_processor", None) or path, cfg.mm_config)


# -- transformers config -> ModelConfig ------------------------------------------------------------
def config_from_hf(hf) -> ModelConfig:
    """A ModelConfig from a transformers config: the fields every family has, then the family's own
    (its spec's `features` and `config`); refuses what llmserve lacks."""
    archs = list(getattr(hf, "architectures", None) or [])
    arch = next((a for a in archs if a in _BY_CLASS), None)
    if arch is None:
        by_type = ARCHITECTURES.get(getattr(hf, "model_type", None))
        arch = by_type.hf_architectures[0] if by_type is not None else None
    if arch is None:
        raise ValueError(
            f"model: unsupported architecture {archs or getattr(hf, 'model_type', '?')}; "
            f"llmserve runs {', '.join(SUPPORTED_ARCHITECTURES)}"
        )
    spec = _BY_CLASS[arch]
    full, hf = hf, hf.get_text_config()  # a vision-language model's decoder is its text config's
    heads = hf.num_attention_heads
    rope = getattr(hf, "rope_parameters", None) or getattr(hf, "rope_scaling", None) or {}
    rope = rope.get("full_attention", rope)  # Gemma 3: one set per layer type (see layers.Rotary)
    theta = rope.get("rope_theta", getattr(hf, "rope_theta", 10000.0))
    scaling = rope if rope.get("rope_type", rope.get("type", "default")) != "default" else None
    eos = getattr(hf, "eos_token_id", None)  # (a vision-language model's text config may lack the token ids)
    eos = tuple(eos) if isinstance(eos, (list, tuple)) else ((eos,) if eos is not None else ())
    fields = dict(
        architecture=arch,
        vocab_size=hf.vocab_size,
        hidden_size=hf.hidden_size,
        intermediate_size=hf.intermediate_size,
        num_layers=hf.num_hidden_layers,
        num_heads=heads,
        num_kv_heads=getattr(hf, "num_key_value_heads", None) or heads,
        head_dim=getattr(hf, "head_dim", None) or hf.hidden_size // heads,
        rms_norm_eps=getattr(hf, "rms_norm_eps", None) or hf.norm_eps,  # (LFM2's: norm_eps)
        rope_theta=float(theta),
        max_position_embeddings=hf.max_position_embeddings,
        tie_word_embeddings=bool(getattr(hf, "tie_word_embeddings", False)),
        attention_bias=bool(getattr(hf, "attention_bias", False)),
        mlp_bias=bool(getattr(hf, "mlp_bias", False)),
        rope_scaling=scaling,
        bos_token_id=getattr(hf, "bos_token_id", None),
        eos_token_ids=eos,
        hf_config=hf,
        fused_decode=spec.fused_decode,
        mm_config=full if spec.images is not None else None,
        **_common_features(hf, arch),
    )
    fields.update(spec.features)
    if spec.config is not None:
        fields.update(spec.config(hf))
    return ModelConfig(**fields)


def _common_features(hf, arch: str) -> dict:
    """The feature fields any family's config may set: the MLP's activation, sliding-window layers."""
    act = getattr(hf, "hidden_activation", None) or getattr(hf, "hidden_act", "silu")
    if act not in ACTIVATIONS:
        raise ValueError(f"model: {arch} with activation {act!r} is not supported (llmserve runs {list(ACTIVATIONS)})")
    if getattr(hf, "use_bidirectional_attention", False):
        raise ValueError(f"model: {arch} with use_bidirectional_attention is not supported")
    window = getattr(hf, "sliding_window", None)
    types = getattr(hf, "layer_types", None)
    sliding = tuple(t == "sliding_attention" for t in types) if types else (window is not None,) * hf.num_hidden_layers
    return dict(hidden_act=ACTIVATIONS[act], sliding_window=window, sliding_layers=sliding if window else ())
