"""A model straight from a GGUF file, tensor by tensor: its quantized tensors kept as the file's blocks
(GGUFLinear) or converted into llmserve's packed layers, its float ones widened or rounded, and what that
takes in memory."""

from __future__ import annotations

import logging
from collections import ChainMap
from collections.abc import Mapping

import torch
import torch.nn as nn

from llmserve.model.formats.gguf_layers import adopt_gguf
from llmserve.model.formats.quant import WEIGHT_KIND, quantize_model, round_x_as_llama_cpp
from llmserve.model.kernels.gguf_kernels import NAMES as GGUF_TYPE_NAMES
from llmserve.model.kernels.gguf_kernels import PACKED, repack
from llmserve.model.loader.build import Lazy, build_model, check_fits, checkpoint_names
from llmserve.model.loader.gguf import GGUFTensors
from llmserve.model.loader.mmproj import MmprojTensors
from llmserve.model.loader.request import LoadRequest
from llmserve.model.registry import make_model

log = logging.getLogger("llmserve.loader")


class GGUFPackedBlocks(Mapping):
    """The Q4_0 / Q4_1 / Q8_0 weight tensors in llmserve's packed formats (quant.QuantLinear), straight from
    the file's blocks (no dequantizing, no re-rounding), each converted when asked (one layer's parts at a
    time): {name without "model." and ".weight": (kind, q, scale, min)} with kind "int4" (q [N, K/2] uint8
    nibbles, scale and min [N, K/32] float16; Q4_0's min is -8 d) or "int8" (q [N, K] int8, scale [N, K/32]
    float32)."""

    def __init__(self, tensors: GGUFTensors) -> None:
        self.tensors = tensors
        self._names = {
            n.removeprefix("model.").removesuffix(".weight"): n
            for n in tensors
            if n.endswith(".weight") and tensors.qtype(n) in PACKED and tensors.keeps_blocks(n)
        }

    def __iter__(self):
        return iter(self._names)

    def __len__(self) -> int:
        return len(self._names)

    def __getitem__(self, key: str) -> tuple:
        if key == "embed_tokens":  # asked twice when the LM head is tied to it: converted once
            if not hasattr(self, "_embed"):
                self._embed = self._convert(key)
            return self._embed
        return self._convert(key)

    def _convert(self, key: str) -> tuple:
        name = self._names[key]
        kind, tensors = repack(self.tensors.blocks(name)[0], self.tensors.qtype(name))
        self.tensors.release(name)
        return (kind, *tensors, None) if kind == "int8" else (kind, *tensors)


FLOAT_TYPES = (0, 1, 30)  # F32, F16, BF16: read as float weights; every other type is kept as blocks
Q4_TYPES = (2, 3)  # Q4_0, Q4_1
# a GGUF served without --quantization keeps its blocks (GGUFLinear, float32-exact) when its float32 weights
# would take more than this; a smaller one is widened tensor by tensor to plain float32 layers (the same
# values, the fused decode kernels: the bundled 135M model takes 0.5 GiB)
WIDEN_GGUF_BYTES = 2 << 30


def gguf_kept_blocks(tensors: GGUFTensors, skip: set[str]) -> dict[str, tuple[torch.Tensor, int]]:
    """The quantized weight tensors not in `skip`, as their own blocks for gguf_layers.adopt_gguf."""
    return {
        name.removeprefix("model.").removesuffix(".weight"): tensors.blocks(name)
        for name in tensors
        if name.endswith(".weight")
        and name not in skip
        and tensors.qtype(name) not in FLOAT_TYPES
        and tensors.keeps_blocks(name)
    }


def gguf_served_bytes(tensors: GGUFTensors, quantization: str | None, dtype: torch.dtype) -> int:
    """About what the served weights take in memory: quantized tensors their file size, float ones widened to
    `dtype` (or rounded to int8 / int4)."""
    total = 0
    for name in tensors:
        if tensors.qtype(name) not in FLOAT_TYPES:
            total += tensors.nbytes(name) * (9 if tensors.qtype(name) == 8 and quantization else 8) // 8
        elif quantization in WEIGHT_KIND and name.endswith(".weight") and "norm" not in name:
            total += tensors.numel(name) * (1 if WEIGHT_KIND[quantization] == "int4" else 3)  # int8: + fbgemm's float16
        else:
            total += tensors.numel(name) * torch.empty((), dtype=dtype).element_size()
    return total


def load_gguf_model(request: LoadRequest) -> nn.Module:
    """The model straight from a GGUF file, tensor by tensor: no float32 copy of the model anywhere.

    On CPU every quantized tensor stays as the file's blocks (never rounded again): with `quantization`
    None float32-exact (gguf_layers.GGUFLinear widens tiles to float32: transformers' values), with int8 / w8a8 / int4
    Q4_0 / Q4_1 / Q8_0 tensors go into llmserve's packed layers (its fused decode kernels) and the other types
    run llama.cpp's integer dots on their own blocks; only float tensors (F32 / F16 / BF16) are rounded to
    int8 / int4, and under int8 the Q4_0 / Q4_1 tensors (int8 is the accurate mode: int16 activations,
    which the Q4 kernels lack), rounded to int8 per channel from the file's values. `gguf` (the default for
    a quantized file, loader.mode): int4's handling of the blocks, float tensors kept float.
    Elsewhere (CUDA), and on CPU without `quantization` for a model whose float32 weights take at most
    WIDEN_GGUF_BYTES, tensors are dequantized one at a time into the model's dtype: the same values as
    GGUFLinear's, served by the fused float32 decode kernels (the bundled model: the fast default)."""
    path, cfg, device, dtype = request.path, request.cfg, request.device, request.dtype
    max_positions, quantization = request.max_positions, request.quantization
    tensors = GGUFTensors(path, request.reader, cfg)
    float_bytes = sum(tensors.numel(n) for n in tensors) * torch.finfo(dtype).bits // 8
    tower = None  # a vision-language model's tower and projector, from its --mmproj file (float32, always)
    if getattr(cfg.mm_config, "mmproj_path", None):
        tower = MmprojTensors(cfg.mm_config.mmproj_path)
        float_bytes += sum(tower.numel(n) for n in tower) * 4
    widen = device.type != "cpu" or (not quantization and float_bytes <= WIDEN_GGUF_BYTES)
    check_fits(path, float_bytes if widen else gguf_served_bytes(tensors, quantization, dtype), request.kv_bytes)
    with torch.device("meta"):
        model = make_model(cfg, max_positions)
    # gguf: the file's blocks only (int4's packed layers for Q4_0 / Q4_1 / Q8_0, llama.cpp's dots for the rest);
    # its float tensors stay float, as llama.cpp keeps them
    mode, blocks_only = quantization, quantization == "gguf"
    if blocks_only:
        quantization = "int4"
    if not widen:
        skip = set()
        if quantization:
            skip = quantize_model(model, quantization, GGUFPackedBlocks(tensors), only_blocks=True, weights=tensors)
        if blocks_only:  # llama.cpp's arithmetic: x's blocks stored as its Q8_1 (int4 mode keeps its own rounding)
            round_x_as_llama_cpp(model)
        kept = gguf_kept_blocks(tensors, skip)
        if WEIGHT_KIND.get(quantization) == "int8":  # Q4_0 / Q4_1: rounded to int8 per channel (see quant._from_blocks)
            kept = {k: v for k, v in kept.items() if v[1] not in Q4_TYPES}
        if quantization and kept:
            log.info(
                "%s: %d tensors of %s served from their own blocks with llama.cpp's integer dots "
                "(--quantization %s never rounds a quantized tensor again)",
                path,
                len(kept),
                "/".join(sorted({GGUF_TYPE_NAMES[q] for _, q in kept.values()})),
                mode,
            )
        skip |= adopt_gguf(model, kept, exact=quantization is None, floats=tensors)
    else:
        skip = set()
    weights = Lazy(tensors, {n: None for n in tensors if n not in skip})
    if tower is not None:
        weights = ChainMap(weights, tower)
    rest = None if blocks_only else quantization  # the layers no block covered: rounded (int8 / int4) or float
    return build_model(cfg, checkpoint_names(cfg, weights), device, dtype, max_positions, rest, model)
