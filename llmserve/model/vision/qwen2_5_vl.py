"""Qwen2.5-VL (`Qwen2_5_VLForConditionalGeneration`): the Qwen2 decoder (LlamaModel with q/k/v biases) under
multimodal rotary (M-RoPE: `mrope_section`, positions from each image's grid, llmserve.model.vision.inputs), whose
embeddings at the `<|image_pad|>` tokens are this vision tower's output:

- patches of patch_size^2 pixels, each repeated temporal_patch_size times (a still image is two equal frames),
  embedded by a Conv3d whose kernel is the patch (a matrix product), in the processor's order: 2x2 merge units
  of patches, row-major over the units;
- 2-D rotary in every block (a quarter of each head's frequencies per axis: the patch's row, then its column);
- pre-RMSNorm blocks with a SwiGLU MLP; attention within windows of window_size pixels (squares of merge units,
  the image's units taken window by window) on most blocks, over the whole image on `fullatt_block_indexes`;
- the merger: RMSNorm, each merge unit's four patch states side by side, a GELU MLP to the decoder's width, one
  row per unit, in the units' row-major order.

Parameter names follow the checkpoints' (`visual.patch_embed.proj`, `visual.blocks.N.attn.qkv`,
`visual.merger.mlp.0`, ...). float32 throughout."""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from llmserve.model.config import ModelConfig
from llmserve.model.families.llama import LlamaModel

ACTIVATIONS = {"silu": F.silu, "gelu": F.gelu, "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh")}


def _rms(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


class Norm(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _rms(x, self.weight)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return x * cos + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin


class Attention(nn.Module):
    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, lengths: list[int]) -> torch.Tensor:
        """x [N, dim]; each run of `lengths` consecutive rows attends within itself, both ways."""
        n = x.shape[0]
        q, k, v = self.qkv(x).view(n, 3, self.heads, -1).unbind(1)  # [N, heads, head_dim] each
        q, k = _rotate(q, cos, sin), _rotate(k, cos, sin)
        outs = [
            F.scaled_dot_product_attention(qs.transpose(0, 1), ks.transpose(0, 1), vs.transpose(0, 1)).transpose(0, 1)
            for qs, ks, vs in zip(q.split(lengths), k.split(lengths), v.split(lengths))
        ]
        return self.proj(torch.cat(outs).reshape(n, -1))


class MLP(nn.Module):
    def __init__(self, dim: int, inner: int, act: str) -> None:
        super().__init__()
        if act not in ACTIVATIONS:
            raise ValueError(f"model: a vision tower with activation {act!r} is not supported")
        self.gate_proj = nn.Linear(dim, inner)
        self.up_proj = nn.Linear(dim, inner)
        self.down_proj = nn.Linear(inner, dim)
        self.act = ACTIVATIONS[act]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_proj(x)) * self.up_proj(x))


class Block(nn.Module):
    def __init__(self, vc) -> None:
        super().__init__()
        self.norm1 = Norm(vc.hidden_size)
        self.norm2 = Norm(vc.hidden_size)
        self.attn = Attention(vc.hidden_size, vc.num_heads)
        self.mlp = MLP(vc.hidden_size, vc.intermediate_size, vc.hidden_act)

    def forward(self, x, cos, sin, lengths):
        x = x + self.attn(self.norm1(x), cos, sin, lengths)
        return x + self.mlp(self.norm2(x))


class PatchEmbed(nn.Module):
    def __init__(self, vc, bias: bool = False) -> None:
        super().__init__()
        kernel = (vc.temporal_patch_size, vc.patch_size, vc.patch_size)
        self.proj = nn.Conv3d(vc.in_channels, vc.hidden_size, kernel, stride=kernel, bias=bias)

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        """pixels [N, channels * temporal * patch * patch] -> [N, hidden] (the kernel covers the whole patch)."""
        w = self.proj.weight
        return F.linear(pixels, w.reshape(w.shape[0], -1), self.proj.bias)


class Merger(nn.Module):
    def __init__(self, vc) -> None:
        super().__init__()
        width = vc.hidden_size * vc.spatial_merge_size**2
        self.ln_q = Norm(vc.hidden_size)
        self.mlp = nn.Sequential(nn.Linear(width, width), nn.GELU(), nn.Linear(width, vc.out_hidden_size))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.mlp(self.ln_q(x).reshape(-1, self.mlp[0].in_features))


def merge_order(h: int, w: int, m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The (row, column) of each patch of an h x w grid in the processor's order: m x m merge units row-major,
    each unit's patches row-major."""
    rows = torch.arange(h).view(h // m, m, 1, 1).expand(h // m, m, w // m, m).transpose(1, 2).reshape(-1)
    cols = torch.arange(w).view(1, 1, w // m, m).expand(h // m, m, w // m, m).transpose(1, 2).reshape(-1)
    return rows, cols


def patch_rotary(grid, merge: int, head_dim: int, theta: float, device) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [t * h * w, 1, head_dim] of a t x h x w patch grid in the processor's order: a quarter of the
    frequencies turned by the patch's row, a quarter by its column (each pair's halves alike)."""
    t, h, w = grid
    rows, cols = merge_order(h, w, merge)
    half = head_dim // 2
    inv_freq = 1.0 / theta ** (torch.arange(0, half, 2, dtype=torch.float32) / half)
    angles = torch.cat([rows[:, None] * inv_freq, cols[:, None] * inv_freq], dim=-1)
    angles = torch.cat([angles, angles], dim=-1).repeat(t, 1)[:, None, :].to(device)
    return angles.cos(), angles.sin()


class VisionTower(nn.Module):
    """One image's patches (pixel_values [N, patch values] and its patch grid t x h x w) -> [N / 4, text hidden]."""

    keep_float32 = True  # llmserve.model.formats.bf16 and the loader leave it in float32

    def __init__(self, vc) -> None:
        super().__init__()
        self.merge = vc.spatial_merge_size
        self.window = vc.window_size // vc.spatial_merge_size // vc.patch_size  # a window's side, in merge units
        self.full = set(vc.fullatt_block_indexes)
        self.head_dim = vc.hidden_size // vc.num_heads
        self.theta = float((getattr(vc, "rope_parameters", None) or {}).get("rope_theta", 10000.0))
        self.patch_embed = PatchEmbed(vc)
        self.blocks = nn.ModuleList(Block(vc) for _ in range(vc.depth))
        self.merger = Merger(vc)

    def windows(self, t: int, h: int, w: int) -> tuple[torch.Tensor, list[int]]:
        """The merge units in window order (frame by frame, windows row-major, each window's units row-major) and
        each window's length in patches."""
        gh, gw, s = h // self.merge, w // self.merge, self.window
        units = torch.arange(t * gh * gw).view(t, gh, gw)
        order, lengths = [], []
        for f in range(t):
            for r in range(0, gh, s):
                for c in range(0, gw, s):
                    win = units[f, r : r + s, c : c + s].reshape(-1)
                    order.append(win)
                    lengths.append(len(win) * self.merge**2)
        return torch.cat(order), lengths

    def forward(self, pixels: torch.Tensor, grid: tuple[int, int, int]) -> torch.Tensor:
        t, h, w = grid
        unit = self.merge**2
        x = self.patch_embed(pixels.float())
        n = x.shape[0]
        order, window_lengths = self.windows(t, h, w)
        order = order.to(x.device)
        cos, sin = patch_rotary(grid, self.merge, self.head_dim, self.theta, x.device)
        # rows grouped window by window (units kept whole), the rotary alike; whole-image blocks see them all
        x = x.view(n // unit, unit, -1)[order].reshape(n, -1)
        cos = cos.view(n // unit, unit, 1, -1)[order].reshape(n, 1, -1)
        sin = sin.view(n // unit, unit, 1, -1)[order].reshape(n, 1, -1)
        frame_lengths = [h * w] * t
        for i, block in enumerate(self.blocks):
            x = block(x, cos, sin, frame_lengths if i in self.full else window_lengths)
        return self.merger(x)[torch.argsort(order)]


class Qwen25VLModel(LlamaModel):
    def __init__(self, cfg: ModelConfig, max_positions: int | None = None) -> None:
        super().__init__(cfg, max_positions)
        self.visual = VisionTower(cfg.mm_config.vision_config)

    @torch.inference_mode()
    def embed_image(self, data: dict) -> torch.Tensor:
        """One image (data["pixel_values"]: [patches, patch values], data["image_grid_thw"]: its patch grid) -> its
        embedding rows, one per 2x2 merge unit."""
        dev = self.visual.patch_embed.proj.weight.device
        return self.visual(data["pixel_values"].to(dev), tuple(int(v) for v in data["image_grid_thw"]))
