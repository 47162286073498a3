"""A SigLIP-style vision transformer (the towers of Idefics3 / SmolVLM and Gemma 3): patches by a strided
convolution, learned position embeddings (looked up by fractional bucket, so that a tile of fewer patches than
the table covers still spreads over it, as Idefics3's variable-resolution tower does), pre-norm encoder layers
with bidirectional attention and a GELU MLP, a final LayerNorm. Parameter names follow the checkpoints'
(`embeddings.patch_embedding`, `encoder.layers.N.self_attn.q_proj`, ...). float32 throughout."""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

ACTIVATIONS = {
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "gelu": F.gelu,
    "quick_gelu": lambda x: x * torch.sigmoid(1.702 * x),
}


class VisionAttention(nn.Module):
    def __init__(self, hidden: int, heads: int) -> None:
        super().__init__()
        self.heads, self.head_dim = heads, hidden // heads
        self.q_proj = nn.Linear(hidden, hidden)
        self.k_proj = nn.Linear(hidden, hidden)
        self.v_proj = nn.Linear(hidden, hidden)
        self.out_proj = nn.Linear(hidden, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, n, _ = x.shape

        def split(t):
            return t.view(b, n, self.heads, self.head_dim).transpose(1, 2)

        q, k, v = split(self.q_proj(x)), split(self.k_proj(x)), split(self.v_proj(x))
        o = F.scaled_dot_product_attention(q, k, v)  # every patch sees every patch of its tile
        return self.out_proj(o.transpose(1, 2).reshape(b, n, -1))


class VisionMLP(nn.Module):
    def __init__(self, hidden: int, inner: int, act: str) -> None:
        super().__init__()
        if act not in ACTIVATIONS:
            raise ValueError(f"model: a vision tower with activation {act!r} is not supported")
        self.fc1 = nn.Linear(hidden, inner)
        self.fc2 = nn.Linear(inner, hidden)
        self.act = ACTIVATIONS[act]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))


class EncoderLayer(nn.Module):
    def __init__(self, vc) -> None:
        super().__init__()
        self.layer_norm1 = nn.LayerNorm(vc.hidden_size, eps=vc.layer_norm_eps)
        self.self_attn = VisionAttention(vc.hidden_size, vc.num_attention_heads)
        self.layer_norm2 = nn.LayerNorm(vc.hidden_size, eps=vc.layer_norm_eps)
        self.mlp = VisionMLP(vc.hidden_size, vc.intermediate_size, vc.hidden_act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.layer_norm1(x))
        return x + self.mlp(self.layer_norm2(x))


class Encoder(nn.Module):
    def __init__(self, vc) -> None:
        super().__init__()
        self.layers = nn.ModuleList(EncoderLayer(vc) for _ in range(vc.num_hidden_layers))


class PatchEmbeddings(nn.Module):
    def __init__(self, vc, fractional: bool = True) -> None:
        super().__init__()
        self.fractional = fractional  # False: plain SigLIP, tiles of the table's size (patch i at position i)
        self.patch_size = vc.patch_size
        self.per_side = vc.image_size // vc.patch_size  # the position table is per_side x per_side
        self.patch_embedding = nn.Conv2d(vc.num_channels, vc.hidden_size, vc.patch_size, stride=vc.patch_size)
        self.position_embedding = nn.Embedding(self.per_side**2, vc.hidden_size)

    def positions(self, rows: int, cols: int, device) -> torch.Tensor:
        """The table index of each patch of a rows x cols tile: its fractional coordinate's bucket per axis."""
        edges = torch.arange(1 / self.per_side, 1.0, 1 / self.per_side, device=device)

        def axis(n: int) -> torch.Tensor:
            frac = torch.arange(n, device=device, dtype=torch.float32) * (1.0 / torch.tensor(n, dtype=torch.float32))
            return torch.bucketize(frac.clamp(max=1.0 - 1e-6), edges, right=True)

        return (axis(rows)[:, None] * self.per_side + axis(cols)[None, :]).reshape(-1)

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        """pixels [tiles, channels, H, W] -> [tiles, patches, hidden]."""
        x = self.patch_embedding(pixels)  # [tiles, hidden, rows, cols]
        rows, cols = x.shape[2], x.shape[3]
        x = x.flatten(2).transpose(1, 2)
        if not self.fractional:
            return x + self.position_embedding.weight[: rows * cols][None]
        return x + self.position_embedding(self.positions(rows, cols, x.device))[None]


class SiglipVisionTower(nn.Module):
    """Tiles of pixels -> the final-normed patch states [tiles, patches, hidden]."""

    keep_float32 = True  # llmserve.model.formats.bf16 and the loader leave it in float32

    def __init__(self, vc, fractional_positions: bool = True) -> None:
        super().__init__()
        self.embeddings = PatchEmbeddings(vc, fractional_positions)
        self.encoder = Encoder(vc)
        self.post_layernorm = nn.LayerNorm(vc.hidden_size, eps=vc.layer_norm_eps)

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        x = self.embeddings(pixels.float())
        for layer in self.encoder.layers:
            x = layer(x)
        return self.post_layernorm(x)
