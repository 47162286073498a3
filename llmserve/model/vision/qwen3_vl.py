"""Qwen3-VL (`Qwen3VLForConditionalGeneration`): the Qwen3 decoder (q/k norms) under interleaved multimodal
rotary (frequencies t, h, w, t, h, w, ...: layers.rotary.mrope_axes), and a vision tower unlike Qwen2.5-VL's:

- patches embedded by the Conv3d (with a bias) as in Qwen2.5-VL (llmserve.model.vision.qwen2_5_vl), plus learned
  position embeddings: a square table resampled bilinearly (corners aligned) to the image's patch grid;
- pre-LayerNorm blocks, every one attending over the whole image, 2-D rotary, a GELU-tanh MLP (fc1, fc2);
- the merger (LayerNorm, each 2x2 merge unit side by side, a GELU MLP) gives the rows at the `<|image_pad|>`s;
- DeepStack: after the blocks in `deepstack_visual_indexes`, mergers of their own (normed after the 2x2 merge)
  give rows added to the decoder's hidden states at the image's tokens after its first layers, one per layer.

`embed_image` returns an image's rows with the DeepStack rows beside them ([units, hidden * (1 + layers)]): the
engine slices and places them as it does any image's rows, and LlamaModel.forward splits them."""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from llmserve.model.config import ModelConfig
from llmserve.model.families.llama import LlamaModel
from llmserve.model.vision.qwen2_5_vl import ACTIVATIONS, Attention, PatchEmbed, merge_order, patch_rotary


class MLP(nn.Module):
    def __init__(self, dim: int, inner: int, act: str) -> None:
        super().__init__()
        if act not in ACTIVATIONS:
            raise ValueError(f"model: a vision tower with activation {act!r} is not supported")
        self.linear_fc1 = nn.Linear(dim, inner)
        self.linear_fc2 = nn.Linear(inner, dim)
        self.act = ACTIVATIONS[act]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_fc2(self.act(self.linear_fc1(x)))


class Block(nn.Module):
    def __init__(self, vc) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(vc.hidden_size, eps=1e-6)
        self.norm2 = nn.LayerNorm(vc.hidden_size, eps=1e-6)
        self.attn = Attention(vc.hidden_size, vc.num_heads)
        self.mlp = MLP(vc.hidden_size, vc.intermediate_size, vc.hidden_act)

    def forward(self, x, cos, sin, lengths):
        x = x + self.attn(self.norm1(x), cos, sin, lengths)
        return x + self.mlp(self.norm2(x))


class Merger(nn.Module):
    def __init__(self, vc, after_merge: bool = False) -> None:
        super().__init__()
        width = vc.hidden_size * vc.spatial_merge_size**2
        self.after_merge = after_merge  # (DeepStack's: the norm over the merged unit)
        self.norm = nn.LayerNorm(width if after_merge else vc.hidden_size, eps=1e-6)
        self.linear_fc1 = nn.Linear(width, width)
        self.linear_fc2 = nn.Linear(width, vc.out_hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        width = self.linear_fc1.in_features
        x = self.norm(x.reshape(-1, width)) if self.after_merge else self.norm(x).reshape(-1, width)
        return self.linear_fc2(F.gelu(self.linear_fc1(x)))


class VisionTower(nn.Module):
    """One image's patches (pixel_values, its patch grid t x h x w) -> [units, hidden * (1 + DeepStack layers)]."""

    keep_float32 = True  # llmserve.model.formats.bf16 and the loader leave it in float32

    def __init__(self, vc) -> None:
        super().__init__()
        self.merge = vc.spatial_merge_size
        self.head_dim = vc.hidden_size // vc.num_heads
        self.theta = float((getattr(vc, "rope_parameters", None) or {}).get("rope_theta", 10000.0))
        self.side = int(vc.num_position_embeddings**0.5)
        self.deep_at = list(vc.deepstack_visual_indexes)
        self.patch_embed = PatchEmbed(vc, bias=True)
        self.pos_embed = nn.Embedding(vc.num_position_embeddings, vc.hidden_size)
        self.blocks = nn.ModuleList(Block(vc) for _ in range(vc.depth))
        self.merger = Merger(vc)
        self.deepstack_merger_list = nn.ModuleList(Merger(vc, after_merge=True) for _ in self.deep_at)

    def positions(self, t: int, h: int, w: int) -> torch.Tensor:
        """The learned position table resampled to h x w (bilinear, corners aligned), [t * h * w, hidden] in the
        processor's order."""
        table = self.pos_embed.weight.view(self.side, self.side, -1).permute(2, 0, 1)[None]
        grid = F.interpolate(table, size=(h, w), mode="bilinear", align_corners=True)[0]  # [hidden, h, w]
        rows, cols = merge_order(h, w, self.merge)
        return grid[:, rows, cols].t().repeat(t, 1)

    def forward(self, pixels: torch.Tensor, grid: tuple[int, int, int]) -> torch.Tensor:
        t, h, w = grid
        x = self.patch_embed(pixels.float())
        x = x + self.positions(t, h, w)
        cos, sin = patch_rotary(grid, self.merge, self.head_dim, self.theta, x.device)
        frames = [h * w] * t
        deep = []
        for i, block in enumerate(self.blocks):
            x = block(x, cos, sin, frames)
            if i in self.deep_at:
                deep.append(self.deepstack_merger_list[self.deep_at.index(i)](x))
        return torch.cat([self.merger(x), *deep], dim=-1)


class Qwen3VLModel(LlamaModel):
    def __init__(self, cfg: ModelConfig, max_positions: int | None = None) -> None:
        super().__init__(cfg, max_positions)
        self.visual = VisionTower(cfg.mm_config.vision_config)

    @torch.inference_mode()
    def embed_image(self, data: dict) -> torch.Tensor:
        """One image -> its rows, each with its DeepStack rows beside it ([units, hidden * (1 + layers)])."""
        dev = self.visual.patch_embed.proj.weight.device
        return self.visual(data["pixel_values"].to(dev), tuple(int(v) for v in data["image_grid_thw"]))
