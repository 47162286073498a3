"""The entry point: a model's config and the model itself, from a GGUF file (and its --mmproj projector file) or
a Hugging Face folder."""

from __future__ import annotations

import torch.nn as nn

from llmserve.model.loader.build import release_freed_memory
from llmserve.model.loader.gguf import gguf_hf_config, open_gguf
from llmserve.model.loader.gguf_model import load_gguf_model
from llmserve.model.loader.lookup import ModelSource
from llmserve.model.loader.mmproj import vlm_config
from llmserve.model.loader.request import LoadRequest
from llmserve.model.loader.safetensors import load_hf_model
from llmserve.model.registry import arch_spec, config_from_hf


def load_model_config(source: ModelSource):
    """(ModelConfig, gguf reader or None)."""
    if source.kind == "gguf":
        reader = open_gguf(source.path)
        hf = gguf_hf_config(reader, source.path)
        if source.mmproj:  # a vision-language model: the text file and llama.cpp's projector file
            hf = vlm_config(hf, reader, source.mmproj)
        elif arch_spec(hf.architectures[0]).images is not None:  # (qwen2vl, qwen3vl: multimodal rotary decoders)
            raise ValueError(
                f"mmproj: {source.path} is the text half of a vision-language model ({hf.architectures[0]}); give "
                f"its projector file (llama.cpp's mmproj-*.gguf) with --mmproj"
            )
        return config_from_hf(hf), reader
    if source.mmproj:
        raise ValueError("mmproj: a projector file goes with a GGUF --model (a checkpoint folder has its tower)")
    import transformers

    try:
        hf = transformers.AutoConfig.from_pretrained(source.path)
    except (ValueError, KeyError) as e:
        raise ValueError(f"model: cannot read {source.path}/config.json: {e}") from e
    return config_from_hf(hf), None


def load_model(request: LoadRequest) -> nn.Module:
    """The model a LoadRequest names: a GGUF file (its `reader`, from load_model_config) through load_gguf_model, a
    Hugging Face folder from its safetensors files."""
    if request.quantization and request.cfg.mm_config is not None:
        raise ValueError("quantization: vision-language models are served unquantized (float32 or bfloat16) for now")
    if request.reader is not None:
        model = load_gguf_model(request)
    else:
        model = load_hf_model(request)
    if model.pack_weights():  # float32 projections in oneDNN's layout (ops.pack_weight)
        release_freed_memory()
    return model
