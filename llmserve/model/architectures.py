"""The architectures llmserve runs: one `ArchSpec` per family, in the table ARCHITECTURES (llmserve.model.registry
holds the look-ups over it and maps a transformers config onto `ModelConfig`).

A spec says which Hugging Face architectures (class names) it covers, how their transformers config maps
onto `ModelConfig` (the fields common to every family are read by `registry.config_from_hf`; the family's own come
from `features` and `config`), how its GGUF files are named (`GGUFSpec`, llmserve.model.gguf_specs: the
metadata prefix, tensor names, the config fields llama.cpp writes), how its checkpoints' tensor names differ
from the model's (`checkpoint_renames`), whether tensor parallelism shards it, whether the fused decode stack runs its
layers, and which model class builds it. A new architecture is one more entry in ARCHITECTURES (see
docs/contributing.md).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from llmserve.model.families import lfm2
from llmserve.model.families.gpt_oss import checkpoint_tensors as gpt_oss_tensors
from llmserve.model.families.granite_hybrid import GraniteHybridModel, hybrid_fields
from llmserve.model.families.granite_hybrid import checkpoint_tensors as granite_hybrid_tensors
from llmserve.model.families.llama import LlamaModel
from llmserve.model.gguf_specs import (
    GGUF_GEMMA_LAYERS,
    GGUF_GLM4_LAYERS,
    GGUF_GPT_OSS_LAYERS,
    GGUF_GRANITE_HYBRID_LAYERS,
    GGUF_LFM2_LAYERS,
    GGUF_LFM2_NAMES,
    GGUF_LLAMA_LAYERS,
    GGUF_MOE_LAYERS,
    GGUF_OLMO2_LAYERS,
    GGUF_QK_NORMS,
    GGUFSpec,
    gguf_attention_bias,
    gguf_gemma2,
    gguf_gemma3,
    gguf_glm4,
    gguf_gpt_oss,
    gguf_granite,
    gguf_granite_hybrid,
    gguf_granite_hybrid_values,
    gguf_lfm2,
    gguf_mixtral,
    gguf_mrope,
    gguf_mrope_interleaved,
    gguf_phi3,
    gguf_qwen3_moe,
    gguf_smollm3,
)
from llmserve.model.hf_fields import (
    gemma_fields,
    gpt_oss_fields,
    granite_fields,
    mixtral_fields,
    mrope_fields,
    o_proj_bias_fields,
    qwen3_moe_fields,
    smollm3_fields,
)
from llmserve.model.vision.gemma3 import Gemma3VisionModel
from llmserve.model.vision.idefics3 import Idefics3Model
from llmserve.model.vision.processing import (
    Gemma3Processing,
    Idefics3Processing,
    Qwen25VLProcessing,
    SmolVLMProcessing,
)
from llmserve.model.vision.qwen2_5_vl import Qwen25VLModel
from llmserve.model.vision.qwen3_vl import Qwen3VLModel


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


# -- the families -------------------------------------------------------------------------------
_NO_STACK = dict(fused_decode=False)  # layers the fused decode stack lacks (q/k norms, sandwich norms, experts)
ARCHITECTURES = {
    s.model_type: s
    for s in (
        ArchSpec(
            "llama",
            ("LlamaForCausalLM",),
            gguf=GGUFSpec(
                "llama", "LlamaConfig", GGUF_LLAMA_LAYERS, permute_qk=True, head_dim_key="rope.dimension_count"
            ),
        ),
        ArchSpec("mistral", ("MistralForCausalLM",)),  # (llama.cpp writes Mistral files as llama ones)
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
            **_NO_STACK,
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
        # Granite 3.x: Llama layers with multipliers; the residual one is folded into the weights (the fused stack's)
        ArchSpec(
            "granite",
            ("GraniteForCausalLM",),
            config=granite_fields,
            gguf=GGUFSpec(
                "granite",
                "GraniteConfig",
                GGUF_LLAMA_LAYERS,
                permute_qk=True,
                head_dim_key="rope.dimension_count",
                config=gguf_granite,
            ),
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
        # OLMo 2: no norm before attention or the MLP, one after each (the sandwich's post-norms), q / k normed over
        # the whole projection (all heads as one row: not split across tensor-parallel ranks)
        ArchSpec(
            "olmo2",
            ("Olmo2ForCausalLM",),
            features=dict(qk_norm=True, qk_norm_whole=True, sandwich_norms=True, pre_norms=False),
            config=o_proj_bias_fields,
            gguf=GGUFSpec(
                "olmo2",
                "Olmo2Config",
                GGUF_OLMO2_LAYERS,
                head_dim_key="attention.key_length",
                config=gguf_attention_bias,
            ),
            tensor_parallel=False,
            **_NO_STACK,
        ),
        # GLM-4 (0414): Gemma's sandwich norms under other names, interleaved partial rotary (q / k rows loaded in
        # layers.head_order), q / k / v biases, a packed gate_up_proj in the checkpoint (as Phi-3's)
        ArchSpec(
            "glm4",
            ("Glm4ForCausalLM",),
            features=dict(sandwich_norms=True, rotary_interleaved=True),
            # (llama.cpp rotates GLM-4's adjacent pairs too: the converter keeps Hugging Face's rows)
            gguf=GGUFSpec(
                "glm4", "Glm4Config", GGUF_GLM4_LAYERS, head_dim_key="attention.key_length", config=gguf_glm4
            ),
            checkpoint_renames=(  # (in this order: post_attention_layernorm is first renamed away)
                (".post_attention_layernorm.", ".pre_feedforward_layernorm."),
                (".post_self_attn_layernorm.", ".post_attention_layernorm."),
                (".post_mlp_layernorm.", ".post_feedforward_layernorm."),
            ),
            tensor_parallel=False,  # (the packed gate_up_proj, as Phi-3's)
            **_NO_STACK,
        ),
        ArchSpec(
            "gemma2",
            ("Gemma2ForCausalLM",),
            config=gemma_fields,
            gguf=GGUFSpec(
                "gemma2",
                "Gemma2Config",
                GGUF_GEMMA_LAYERS,
                head_dim_key="attention.key_length",
                norm_offset=True,
                config=gguf_gemma2,
            ),
            **_NO_STACK,
        ),
        ArchSpec(
            "gemma3_text",
            ("Gemma3ForCausalLM",),
            features=dict(qk_norm=True),
            config=gemma_fields,
            gguf=GGUFSpec(
                "gemma3",
                "Gemma3TextConfig",
                {**GGUF_GEMMA_LAYERS, **GGUF_QK_NORMS},
                head_dim_key="attention.key_length",
                norm_offset=True,
                config=gguf_gemma3,
            ),
            **_NO_STACK,
        ),
        ArchSpec(
            "mixtral",
            ("MixtralForCausalLM",),
            config=mixtral_fields,
            gguf=GGUFSpec(
                "llama",
                "MixtralConfig",
                {**GGUF_LLAMA_LAYERS, **GGUF_MOE_LAYERS},
                permute_qk=True,
                head_dim_key="rope.dimension_count",
                experts=True,
                config=gguf_mixtral,
            ),
            # the model's names are Hugging Face's Llama / Qwen3-MoE ones
            checkpoint_renames=(
                (".block_sparse_moe.", ".mlp."),
                (".w1.", ".gate_proj."),
                (".w3.", ".up_proj."),
                (".w2.", ".down_proj."),
            ),
            tensor_parallel=False,  # (experts are not split yet)
            **_NO_STACK,
        ),
        ArchSpec(
            "qwen3_moe",
            ("Qwen3MoeForCausalLM",),
            features=dict(qk_norm=True),
            config=qwen3_moe_fields,
            gguf=GGUFSpec(
                "qwen3moe",
                "Qwen3MoeConfig",
                {**GGUF_LLAMA_LAYERS, **GGUF_QK_NORMS, **GGUF_MOE_LAYERS},
                head_dim_key="attention.key_length",
                config=gguf_qwen3_moe,
            ),
            tensor_parallel=False,
            **_NO_STACK,
        ),
        # gpt-oss: attention sinks, alternating sliding-window layers, q / k / v / o biases; experts in every layer
        # (router with a bias, softmax over the top-k logits, biased experts, the clamped SwiGLU); the checkpoint's
        # fused expert tensors split per expert (llmserve.model.families.gpt_oss)
        ArchSpec(
            "gpt_oss",
            ("GptOssForCausalLM",),
            features=dict(attn_sinks=True),
            config=gpt_oss_fields,
            gguf=GGUFSpec(
                "gpt-oss", "GptOssConfig", GGUF_GPT_OSS_LAYERS, head_dim_key="attention.key_length", config=gguf_gpt_oss
            ),
            # (a GGUF file's attn_sinks has a .weight suffix, the checkpoint's sinks none)
            checkpoint_renames=((".mlp.router.", ".mlp.gate."), (".self_attn.sinks.weight", ".self_attn.sinks")),
            checkpoint_tensors=gpt_oss_tensors,
            tensor_parallel=False,
            **_NO_STACK,
        ),
        # Granite 4.0-H: Mamba-2 mixers and attention layers (families/granite_hybrid.py), each sequence's mixer
        # states in the engine's recurrent-state pool; the checkpoint's stacked experts split per expert
        ArchSpec(
            "granitemoehybrid",
            ("GraniteMoeHybridForCausalLM",),
            config=lambda hf: {**granite_fields(hf), **hybrid_fields(hf)},
            gguf=GGUFSpec(
                "granitehybrid",
                "GraniteMoeHybridConfig",
                GGUF_GRANITE_HYBRID_LAYERS,
                permute_qk=True,
                config=gguf_granite_hybrid,
                values=gguf_granite_hybrid_values,
            ),
            checkpoint_renames=(
                (".block_sparse_moe.router.layer.", ".mlp.gate."),
                (".block_sparse_moe.router.", ".mlp.gate."),
                (".block_sparse_moe.input_linear.weight", ".mlp.experts.gate_up_proj"),
                (".block_sparse_moe.output_linear.weight", ".mlp.experts.down_proj"),
                (".block_sparse_moe.experts.", ".mlp.experts."),
                (".shared_mlp.input_linear.", ".shared_mlp.gate_up_proj."),
                (".shared_mlp.output_linear.", ".shared_mlp.down_proj."),
            ),
            checkpoint_tensors=granite_hybrid_tensors,
            tensor_parallel=False,
            model_class=GraniteHybridModel,
            **_NO_STACK,
        ),
        # LFM2: gated short-convolution layers that keep a state per sequence (engine/state_pool.py) among attention
        # layers with q / k norms per head (llmserve.model.families.lfm2); its names onto Llama's
        ArchSpec(
            "lfm2",
            ("Lfm2ForCausalLM",),
            features=dict(qk_norm=True),
            config=lfm2.config_fields,
            gguf=GGUFSpec("lfm2", "Lfm2Config", GGUF_LFM2_LAYERS, names=GGUF_LFM2_NAMES, config=gguf_lfm2),
            checkpoint_renames=lfm2.RENAMES,
            tensor_parallel=False,
            model_class=lfm2.Lfm2Model,
            **_NO_STACK,
        ),
        # Idefics3 / SmolVLM: a Llama decoder, a SigLIP tower and its connector (llmserve.model.vision)
        ArchSpec(
            "idefics3",
            ("Idefics3ForConditionalGeneration",),
            checkpoint_renames=(("model.text_model.", "model."),),
            tensor_parallel=False,
            model_class=Idefics3Model,
            images=Idefics3Processing,
        ),
        ArchSpec(  # Gemma 3 with its SigLIP tower (pan and scan off): the decoder is gemma3_text's
            "gemma3",
            ("Gemma3ForConditionalGeneration",),
            features=dict(qk_norm=True),
            config=gemma_fields,
            checkpoint_renames=(("language_model.model.", "model."), ("vision_tower.vision_model.", "vision_tower.")),
            tensor_parallel=False,
            model_class=Gemma3VisionModel,
            images=Gemma3Processing,
            **_NO_STACK,
        ),
        ArchSpec(  # Qwen2.5-VL: the Qwen2 decoder under multimodal rotary, its windowed tower (llmserve.model.vision)
            "qwen2_5_vl",
            ("Qwen2_5_VLForConditionalGeneration",),
            features=dict(attention_bias=True),
            config=mrope_fields,
            checkpoint_renames=(("model.language_model.", "model."),),  # (transformers 5's names; the hub's: as is)
            gguf=GGUFSpec("qwen2vl", "Qwen2_5_VLTextConfig", GGUF_LLAMA_LAYERS, config=gguf_mrope),  # (with --mmproj)
            tensor_parallel=False,
            model_class=Qwen25VLModel,
            images=Qwen25VLProcessing,
            **_NO_STACK,
        ),
        ArchSpec(  # Qwen3-VL: the Qwen3 decoder under interleaved multimodal rotary, DeepStack rows, its own tower
            "qwen3_vl",
            ("Qwen3VLForConditionalGeneration",),
            features=dict(qk_norm=True, mrope_interleaved=True),
            config=mrope_fields,
            checkpoint_renames=(("model.language_model.", "model."),),
            gguf=GGUFSpec(
                "qwen3vl",
                "Qwen3VLTextConfig",
                {**GGUF_LLAMA_LAYERS, **GGUF_QK_NORMS},
                head_dim_key="attention.key_length",
                config=gguf_mrope_interleaved,
            ),
            tensor_parallel=False,
            model_class=Qwen3VLModel,
            images=Qwen25VLProcessing,  # (the same image processing and prompt)
            **_NO_STACK,
        ),
        ArchSpec(  # SmolVLM 2: Idefics3's model and prompt, its own image processor
            "smolvlm",
            ("SmolVLMForConditionalGeneration",),
            checkpoint_renames=(("model.text_model.", "model."),),
            tensor_parallel=False,
            model_class=Idefics3Model,
            images=SmolVLMProcessing,
        ),
    )
}
