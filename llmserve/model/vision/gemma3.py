"""Gemma 3 (vision-language, `Gemma3ForConditionalGeneration`, pan and scan off): the Gemma 3 decoder (LlamaModel
with the family's features) whose embeddings at the `<image_soft_token>`s are a SigLIP tower's patch states,
average-pooled to `mm_tokens_per_image` (a square), normed (Gemma's 1 + w RMSNorm) and projected by a plain matrix.
The image's soft tokens attend to each other both ways in the decoder (ImageInput.bidirectional)."""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from llmserve.model.config import ModelConfig
from llmserve.model.families.llama import LlamaModel
from llmserve.model.layers import RMSNorm
from llmserve.model.vision.siglip import SiglipVisionTower


class Projector(nn.Module):
    keep_float32 = True

    def __init__(self, hf) -> None:
        super().__init__()
        vc = hf.vision_config
        self.per_side = vc.image_size // vc.patch_size
        self.kernel = self.per_side // int(round(hf.mm_tokens_per_image**0.5))
        self.mm_soft_emb_norm = RMSNorm(vc.hidden_size, vc.layer_norm_eps)  # (1 + w: loaded as the decoder's norms)
        self.mm_input_projection_weight = nn.Parameter(torch.zeros(vc.hidden_size, hf.get_text_config().hidden_size))

    def forward(self, states: torch.Tensor) -> torch.Tensor:
        """[images, patches, d] -> [images * mm_tokens_per_image, text hidden]."""
        b, _, d = states.shape
        grid = states.transpose(1, 2).reshape(b, d, self.per_side, self.per_side)
        pooled = F.avg_pool2d(grid, self.kernel, self.kernel).flatten(2).transpose(1, 2)
        out = self.mm_soft_emb_norm(pooled) @ self.mm_input_projection_weight
        return out.reshape(-1, out.shape[-1])


class Gemma3VisionModel(LlamaModel):
    def __init__(self, cfg: ModelConfig, max_positions: int | None = None) -> None:
        super().__init__(cfg, max_positions)
        hf = cfg.mm_config
        self.vision_tower = SiglipVisionTower(hf.vision_config, fractional_positions=False)
        self.multi_modal_projector = Projector(hf)

    @torch.inference_mode()
    def embed_image(self, data: dict) -> torch.Tensor:
        """One image (data["pixel_values"]: [1, 3, H, W]) -> its mm_tokens_per_image embedding rows."""
        dev = self.multi_modal_projector.mm_input_projection_weight.device
        return self.multi_modal_projector(self.vision_tower(data["pixel_values"].to(dev)))
