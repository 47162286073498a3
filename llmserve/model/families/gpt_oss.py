"""gpt-oss's checkpoint tensors under the names and in the layout of llmserve's layers (its spec's
`checkpoint_tensors`, llmserve.model.registry).

transformers keeps a layer's experts in four fused tensors: `mlp.experts.gate_up_proj` [E, hidden, 2I] with gate
and up interleaved (column 2i gate, 2i + 1 up), `gate_up_proj_bias` [E, 2I], `down_proj` [E, I, hidden] and
`down_proj_bias` [E, hidden], each multiplied from the right (x @ W). llmserve's experts are `MLP` layers whose
checkpoint parts are `experts.N.gate_proj`, `up_proj` and `down_proj` (nn.Linear's [out, in], Qwen3-MoE's names):
each expert's slice is transposed and its gate / up columns taken apart, one expert at a time, as the loader asks
(each fused tensor read once per layer).

OpenAI's own checkpoints hold the experts in MXFP4 instead: `gate_up_proj_blocks` [E, 2I, hidden / 32, 16] (two
4-bit E2M1 codes a byte, the low nibble first) and `gate_up_proj_scales` [E, 2I, hidden / 32] (an E8M0 exponent per
32 values: 2^(e - 127)), rows in [out, in] order already (gate / up interleaved as above), the same for down_proj.
Those become GGUF's MXFP4 blocks (`mxfp4_rows`: the same codes and exponents, the nibbles reordered; no value
changes) that `blocks` offers the loader for gguf_layers.GGUFLinear layers (read by the GGUF kernels, never widened
whole); the float names stay readable too (dequantized per expert when asked: CUDA, or no kernels).

Granite 4.0-H's stacked experts (`layout="stacked"`, llmserve.model.families.granite_hybrid) go through the same split:
`gate_up_proj` [E, 2I, hidden] (nn.Linear's [out, in] per expert, the gate's rows then up's) and `down_proj`
[E, hidden, I].
"""

from __future__ import annotations

import re
from collections.abc import Mapping

import torch

MXFP4 = 39  # GGMLQuantizationType.MXFP4
_FUSED = re.compile(r"^(.*\.mlp\.experts)\.(gate_up_proj|down_proj)(_bias|_blocks)?$")
_PARTS = {"gate_up_proj": (("gate_proj", 0), ("up_proj", 1)), "down_proj": (("down_proj", None),)}


def mxfp4_rows(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """A Hugging Face MXFP4 tensor's rows (blocks uint8 [N, G, 16], two E2M1 codes a byte, value 2j in the low
    nibble of byte j and 2j + 1 in its high one; scales uint8 [N, G], E8M0 exponents) as GGUF MXFP4 blocks, uint8
    [N, G * 17]: each block's exponent byte, then its 32 codes in GGUF's order (value j in the low nibble of byte j,
    value j + 16 in its high one). GGUF's table holds the E2M1 values doubled under half the scale: the same values."""
    codes = torch.stack([blocks & 15, blocks >> 4], dim=-1).flatten(-2)  # [N, G, 32] in value order
    qs = codes[..., :16] | (codes[..., 16:] << 4)
    return torch.cat([scales.unsqueeze(-1), qs], dim=-1).reshape(blocks.shape[0], -1).contiguous()


class ExpertTensors(Mapping):
    """`source`'s tensors, its fused expert tensors as one per expert and projection
    (`...mlp.experts.N.gate_proj.weight` / `.bias`, `up_proj`, `down_proj`), each read when asked; `blocks`: the MXFP4
    experts as GGUF blocks ({`layers.L.mlp.experts.N.gate_proj`: (uint8 rows, MXFP4)}, gguf_layers.adopt_gguf's)."""

    def __init__(self, source: Mapping, num_experts: int, layout: str = "gpt_oss") -> None:
        self.source, self._names, self._cache = source, {}, {}
        self.layout = layout  # "gpt_oss" (see the module's doc) | "stacked": [E, out, in], gate rows then up rows
        self.blocks = _Blocks(self)
        for k in source:
            m = _FUSED.match(k)
            if m is None:
                if not k.endswith("_scales") or _FUSED.match(k.removesuffix("_scales") + "_blocks") is None:
                    self._names[k] = None
                continue
            kind = "bias" if m.group(3) == "_bias" else "weight"
            for e in range(num_experts):
                for part, half in _PARTS[m.group(2)]:
                    name = f"{m.group(1)}.{e}.{part}"
                    self._names[f"{name}.{kind}"] = (k, e, half)
                    if m.group(3) == "_blocks":
                        self.blocks.names[name.removeprefix("model.")] = (k, e, half)

    def _fused(self, name: str) -> torch.Tensor:
        if name not in self._cache:
            if len(self._cache) >= 6:  # (a layer's fused tensors at most: the previous layer's go)
                self._cache.clear()
            self._cache[name] = self.source[name]
        return self._cache[name]

    def raw(self, fused: str, e: int, half: int | None) -> torch.Tensor:
        """An MXFP4 expert projection's rows as GGUF blocks (gate rows: half 0, up rows: half 1)."""
        blocks = self._fused(fused)[e]
        scales = self._fused(fused.removesuffix("_blocks") + "_scales")[e]
        if half is not None:
            blocks, scales = blocks[half::2], scales[half::2]
        return mxfp4_rows(blocks, scales)

    def __getitem__(self, name: str) -> torch.Tensor:
        where = self._names[name]
        if where is None:
            return self.source[name]
        fused, e, half = where
        if fused.endswith("_blocks"):  # (widened: only where the blocks were not adopted)
            from llmserve.model.kernels import gguf_kernels

            raw = self.raw(fused, e, half)
            return gguf_kernels.dequantize(raw, MXFP4, raw.shape[1] // 17 * 32)
        t = self._fused(fused)[e]
        if self.layout == "stacked":  # (Granite 4.0-H: nn.Linear's [out, in] already, gate and up halves)
            return (t if half is None else t.chunk(2)[half]).contiguous()
        if t.dim() == 2:
            t = t.t()  # (x @ W -> nn.Linear's [out, in])
        return (t if half is None else t[half::2]).contiguous()

    def __contains__(self, name) -> bool:  # (without reading the tensor, as Mapping's would)
        return name in self._names

    def __iter__(self):
        return iter(self._names)

    def __len__(self) -> int:
        return len(self._names)


class _Blocks(Mapping):
    def __init__(self, tensors: ExpertTensors) -> None:
        self.tensors, self.names = tensors, {}

    def __getitem__(self, name: str) -> tuple[torch.Tensor, int]:
        return self.tensors.raw(*self.names[name]), MXFP4

    def __contains__(self, name) -> bool:
        return name in self.names

    def __iter__(self):
        return iter(self.names)

    def __len__(self) -> int:
        return len(self.names)


def checkpoint_tensors(cfg, weights: Mapping) -> Mapping:
    """gpt-oss's checkpoint (after its renames) under the model's names (see the module's doc)."""
    return ExpertTensors(weights, cfg.num_experts)
