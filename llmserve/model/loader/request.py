"""What a model load is asked for: one value through the loaders (load.load_model, gguf_model.load_gguf_model,
safetensors.load_hf_model)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from llmserve.model.config import ModelConfig
from llmserve.model.loader.lookup import ModelSource


@dataclass(frozen=True)
class LoadRequest:
    source: ModelSource  # the GGUF file (and --mmproj) or the Hugging Face folder
    cfg: ModelConfig
    reader: object  # the GGUF reader load_model_config opened; None for a folder
    device: torch.device
    dtype: torch.dtype  # the weights'
    max_positions: int  # the rotary tables' length
    quantization: str | None = None
    kv_bytes: int = 0  # the KV cache asked for: a model that will not fit with it is refused before allocating

    @property
    def path(self) -> str:
        return self.source.path
