"""Idefics3 / SmolVLM: a Llama decoder whose prompt embeddings at the `<image>` tokens are a SigLIP tower's
patch states (llmserve.model.vision.siglip), pixel-shuffled (each scale x scale square of patches becomes one
row, its states side by side) and projected to the decoder's width. An image is split into tiles (rows x cols
of them, and the whole picture scaled down as the last one: llmserve.model.vision.processing); each tile gives
(patches / scale^2) embedding rows, in the prompt's order."""

from __future__ import annotations

import torch
import torch.nn as nn

from llmserve.model.config import ModelConfig
from llmserve.model.families.llama import LlamaModel
from llmserve.model.vision.siglip import SiglipVisionTower


class Connector(nn.Module):
    keep_float32 = True

    def __init__(self, hf) -> None:
        super().__init__()
        self.scale = hf.scale_factor
        self.modality_projection = nn.Module()
        width = hf.vision_config.hidden_size * self.scale**2
        self.modality_projection.proj = nn.Linear(width, hf.get_text_config().hidden_size, bias=False)

    def forward(self, states: torch.Tensor) -> torch.Tensor:
        """[tiles, side * side, d] -> [tiles * side^2 / scale^2, text hidden]: each scale x scale square of
        patches (row-major over the squares) concatenated, the square's rows outer, its columns inner."""
        tiles, n, d = states.shape
        side, s = int(round(n**0.5)), self.scale
        x = states.view(tiles, side // s, s, side // s, s, d)  # [tile, square row, row in it, square col, col, d]
        x = x.permute(0, 1, 3, 2, 4, 5)  # [tile, square row, square col, row in it, col in it, d]
        x = x.reshape(tiles * (side // s) ** 2, s * s * d)
        return self.modality_projection.proj(x)


class Idefics3Model(LlamaModel):
    def __init__(self, cfg: ModelConfig, max_positions: int | None = None) -> None:
        super().__init__(cfg, max_positions)
        hf = cfg.mm_config
        self.vision_model = SiglipVisionTower(hf.vision_config)
        self.connector = Connector(hf)

    @torch.inference_mode()
    def embed_image(self, data: dict) -> torch.Tensor:
        """One image's tiles (data["pixel_values"]: [tiles, 3, H, W]) -> its embedding rows [n, hidden]."""
        dev = self.connector.modality_projection.proj.weight.device
        return self.connector(self.vision_model(data["pixel_values"].to(dev)))
