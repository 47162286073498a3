"""The vision-language families beside Gemma 3's (llmserve.model.vision): Idefics3 / SmolVLM (a Llama decoder, a
SigLIP tower and its connector), Qwen2.5-VL and Qwen3-VL (their decoders under multimodal rotary, their towers)."""

from __future__ import annotations

from llmserve.model.specs.spec import GGUF_LLAMA_LAYERS, GGUF_QK_NORMS, NO_STACK, ArchSpec, GGUFMetadata, GGUFSpec
from llmserve.model.vision.idefics3 import Idefics3Model
from llmserve.model.vision.processing import Idefics3Processing, Qwen25VLProcessing, SmolVLMProcessing
from llmserve.model.vision.qwen2_5_vl import Qwen25VLModel
from llmserve.model.vision.qwen3_vl import Qwen3VLModel


def mrope_fields(hf) -> dict:
    """Multimodal rotary (Qwen2.5-VL, Qwen3-VL): the frequency sections each position axis turns."""
    params = getattr(hf, "rope_parameters", None) or getattr(hf, "rope_scaling", None) or {}
    if "mrope_section" not in params:
        raise ValueError("model: a vision-language config without rope_parameters.mrope_section")
    return dict(mrope_section=tuple(params["mrope_section"]))


def gguf_mrope(meta: GGUFMetadata, kw: dict, theta: float) -> dict:
    """Qwen2.5-VL / Qwen3-VL text files (qwen2vl / qwen3vl): the multimodal rotary sections the converter stores as
    `rope.dimension_sections` (t, h, w, padded with a 0) become Hugging Face's `mrope_section`."""
    sections = [int(s) for s in meta.get("rope.dimension_sections") or []]
    if len(sections) < 3 or any(sections[3:]) or sum(sections[:3]) != kw["head_dim"] // 2:
        raise ValueError(
            f"model: {meta.path}: rope.dimension_sections {sections} do not split the head's "
            f"{kw['head_dim'] // 2} rotary frequencies into t, h, w"
        )
    return dict(rope_parameters={"rope_type": "default", "rope_theta": theta, "mrope_section": sections[:3]})


def gguf_mrope_interleaved(meta: GGUFMetadata, kw: dict, theta: float) -> dict:
    """qwen3vl: gguf_mrope's sections, interleaved (frequencies t, h, w, t, h, w, ...)."""
    fields = gguf_mrope(meta, kw, theta)
    fields["rope_parameters"]["mrope_interleaved"] = True
    return fields


# -- the specs -------------------------------------------------------------------------------------------------------
SPECS = (
    # Idefics3 / SmolVLM: a Llama decoder, a SigLIP tower and its connector (llmserve.model.vision)
    ArchSpec(
        "idefics3",
        ("Idefics3ForConditionalGeneration",),
        checkpoint_renames=(("model.text_model.", "model."),),
        tensor_parallel=False,
        model_class=Idefics3Model,
        images=Idefics3Processing,
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
        **NO_STACK,
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
        **NO_STACK,
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
