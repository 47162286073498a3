"""Hugging Face checkpoint folders: their safetensors files, each tensor read from its memory map when asked."""

from __future__ import annotations

import glob
import json
import os
from collections.abc import Mapping

import numpy as np
import torch
import torch.nn as nn

from llmserve.model.formats.gguf_layers import adopt_gguf
from llmserve.model.formats.quant import WEIGHT_KIND, quantize_model
from llmserve.model.loader.build import Lazy, build_model, check_fits, checkpoint_names, release_freed_memory
from llmserve.model.loader.request import LoadRequest
from llmserve.model.registry import make_model


class SafetensorsWeights(Mapping):
    """The tensors of a folder's safetensors files by name, each read from the file's memory map when asked
    (and dropped by the caller once copied into the model): the checkpoint is never in memory whole."""

    def __init__(self, folder: str, skip: set[str] = frozenset()) -> None:
        from safetensors import safe_open

        files = sorted(glob.glob(os.path.join(folder, "*.safetensors")))
        if not files:
            raise ValueError(f"model: no *.safetensors files in {folder!r}")
        index = os.path.join(folder, "model.safetensors.index.json")
        if os.path.exists(index):
            with open(index) as f:
                names = set(json.load(f)["weight_map"].values())
            files = [os.path.join(folder, n) for n in sorted(names)]
        self._files, self._where, self._numel, self._bytes = {}, {}, {}, set()
        for path in files:
            try:
                f = self._files[path] = safe_open(path, framework="pt")
            except Exception as e:  # noqa: BLE001 - safetensors raises its own error types
                raise ValueError(
                    f"model: {path} is not a readable safetensors file, truncated or corrupt "
                    f"({type(e).__name__}: {e}); download or convert it again"
                ) from e
            for k in f.keys():
                if k not in skip:
                    self._where[k] = path
                    self._numel[k] = int(np.prod(f.get_slice(k).get_shape()))
                    if f.get_slice(k).get_dtype() == "U8":  # (MXFP4 blocks and exponents: served as they are)
                        self._bytes.add(k)

    def __getitem__(self, name: str) -> torch.Tensor:
        return self._files[self._where[name]].get_tensor(name)

    def __iter__(self):
        return iter(self._where)

    def __len__(self) -> int:
        return len(self._where)

    def served_bytes(self, quantization: str | None, dtype: torch.dtype) -> int:
        """About what the served weights take: float tensors in `dtype`, or rounded to int8 (+ fbgemm's
        float16 copy) / int4."""
        size = torch.empty((), dtype=dtype).element_size()
        per = {None: size, "int8": 3, "int4": 1}[WEIGHT_KIND.get(quantization)]
        return sum(
            n * (1 if k in self._bytes else per if "norm" not in k and k.endswith(".weight") else size)
            for k, n in self._numel.items()
        )


def load_hf_weights(folder: str, skip: set[str] = frozenset()) -> SafetensorsWeights:
    """Every tensor of the folder's safetensors files, but those named in `skip` (never read), each read when
    asked."""
    return SafetensorsWeights(folder, skip)


def load_hf_model(request: LoadRequest) -> nn.Module:
    """The model from a Hugging Face folder, tensor by tensor: each copied into its parameter (float) or
    rounded into its quantized layer (int8 / int4 on CPU) as it is read; no float32 copy of the checkpoint.
    Blocks the family's checkpoint_tensors offer (`blocks`: gpt-oss's MXFP4 experts) stay blocks on CPU
    (gguf_layers.GGUFLinear: float32-exact without `quantization`, llama.cpp's integer dots with it)."""
    folder, cfg, device, dtype = request.path, request.cfg, request.device, request.dtype
    max_positions, quantization = request.max_positions, request.quantization
    files = load_hf_weights(folder)
    check_fits(folder, files.served_bytes(quantization, dtype), request.kv_bytes)
    weights = checkpoint_names(cfg, files)
    blocks = getattr(weights, "blocks", None)
    model = None
    if (quantization or blocks) and device.type == "cpu":
        with torch.device("meta"):
            model = make_model(cfg, max_positions)
        skip = adopt_gguf(model, blocks, exact=quantization is None, floats=weights) if blocks else set()
        if quantization:
            skip |= quantize_model(model, quantization, weights=weights)
        weights = Lazy(weights, {n: None for n in weights if n not in skip})
    model = build_model(cfg, weights, device, dtype, max_positions, quantization, model)
    del weights
    release_freed_memory()
    return model
