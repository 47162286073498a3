"""What an architecture spec is: `ArchSpec` (one family: its Hugging Face classes, config fields, GGUF files,
checkpoint renames, tensor parallelism, fused decode stack, model class) and `GGUFSpec` (how its GGUF files map onto
its transformers config and Hugging Face tensor names, as llama.cpp writes them); and the pieces several families'
specs share: llama.cpp's tensor-name tables, the sliding-window and bias readers. Each family's own facts sit in its
module beside this one (llmserve/model/specs/<family>.py); llmserve.model.registry builds the table from them."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from llmserve.model.families.llama import LlamaModel


@dataclass(frozen=True)
class GGUFMetadata:
    """What a GGUFSpec's `config` reads from the file: `get(key, default)` is the `<arch>.<key>` metadata."""

    get: Callable
    tensor_names: frozenset
    path: str = ""
    tensor: Callable | None = None  # a small float tensor's values by its GGUF name (Phi-3's rope factors)


@dataclass(frozen=True)
class GGUFSpec:
    """How a family's GGUF files map onto its transformers config and Hugging Face tensor names."""

    arch: str  # general.architecture (and the metadata keys' prefix)
    config_class: str  # the transformers config class the metadata becomes
    layer_names: Mapping  # blk.N.<key>.weight -> model.layers.N.<value>.weight ("{e}": one per expert)
    names: Mapping = field(default_factory=lambda: dict(GGUF_MODEL_NAMES))  # whole-model tensors -> HF names
    permute_qk: bool = False  # llama.cpp's converter interleaved the rotary halves of Q and K rows
    head_dim_key: str | None = None  # metadata key (after "<arch>.") holding the head size, if any
    norm_offset: bool = False  # the converter stored the (1 + w) norms as 1 + w: read back as w (Gemma)
    experts: bool = False  # this family's files are `arch` files with `<arch>.expert_count` > 0 (Mixtral: llama)
    # (GGUFMetadata, the common config fields, rope theta) -> the config fields beyond the common ones
    config: Callable | None = None
    # (Hugging Face name, the file's float32 tensor) -> the tensor as the checkpoint holds it, where the converter
    # stored a value transformed (Granite 4.0-H's -exp(A_log), its per-group norm); None: every tensor as stored
    values: Callable | None = None


@dataclass(frozen=True)
class ArchSpec:
    """One family of architectures."""

    model_type: str  # its transformers config's model_type
    hf_architectures: tuple[str, ...]  # the Hugging Face class names it covers
    features: Mapping = field(default_factory=dict)  # ModelConfig feature fields the family fixes
    config: Callable | None = None  # transformers config -> ModelConfig fields read from it (beyond the common)
    gguf: GGUFSpec | None = None  # None: not read from GGUF files
    checkpoint_renames: tuple[tuple[str, str], ...] = ()  # checkpoint name fragments -> the model's
    # (cfg, the renamed checkpoint mapping) -> the mapping under the model's names and layouts (gpt-oss: fused experts)
    checkpoint_tensors: Callable | None = None
    tensor_parallel: bool = True  # llmserve.model.parallel shards its attention and MLP (False: refused)
    fused_decode: bool = True  # its layers are plain Llama layers, which the fused C++ decode stack runs
    model_class: type = LlamaModel  # builds it: model_class(cfg, max_positions)
    # a vision-language model: (folder, or a --mmproj file's processor settings; transformers config) -> its
    # vision.processing.ImageProcessing (GGUF projector files: loader.mmproj)
    images: Callable | None = None


# layers the fused decode stack lacks (q/k norms, sandwich norms, experts)
NO_STACK = dict(fused_decode=False)


# -- GGUF tensor names (llama.cpp's) ---------------------------------------------------------------
GGUF_MODEL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
GGUF_LLAMA_LAYERS = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
GGUF_QK_NORMS = {"attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm"}
# routed experts: the router, and each merged [n_expert, rows, cols] tensor split into one per expert
GGUF_MOE_LAYERS = {
    "ffn_gate_inp": "mlp.gate",
    "ffn_gate_exps": "mlp.experts.{e}.gate_proj",
    "ffn_up_exps": "mlp.experts.{e}.up_proj",
    "ffn_down_exps": "mlp.experts.{e}.down_proj",
}


# -- config readers several families share --------------------------------------------------
def o_proj_bias_fields(hf) -> dict:
    """attention_bias in Granite, OLMo 2 and gpt-oss: q / k / v biases (the common field) and o_proj's alike (a
    biased o_proj leaves the fused decode stack, which takes no biases: the model takes the module path)."""
    return dict(o_proj_bias=bool(getattr(hf, "attention_bias", False)))


def gguf_attention_bias(meta: GGUFMetadata, kw: dict, theta: float) -> dict:
    # attention_bias (Granite, OLMo 2): the converter writes the checkpoint's biases as blk.N.attn_*.bias, and no key
    return dict(attention_bias="blk.0.attn_q.bias" in meta.tensor_names)


def swa_layers(meta: GGUFMetadata, layers: int, every: int) -> list[str]:
    """Hugging Face's layer_types from `<arch>.attention.sliding_window_pattern` (a bool per layer, or n: every
    n-th layer is global) or llama.cpp's default n for the architecture."""
    pattern = meta.get("attention.sliding_window_pattern", every)
    if isinstance(pattern, list):
        sliding = [bool(p) for p in pattern]
    else:
        sliding = [pattern > 0 and (i + 1) % pattern != 0 for i in range(layers)]
    return ["sliding_attention" if s else "full_attention" for s in sliding]
