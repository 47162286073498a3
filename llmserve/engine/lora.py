"""The engine's LoRA adapters (`--enable-lora`): which are loaded, under which names, within the limits.

    registry = LoRARegistry(model, max_loras, max_lora_rank)
    registry.load("sql", "/path/to/peft-adapter")     # LoRAError: missing, malformed, too big, too many
    adapter = registry.get("sql")                      # a request holds its adapter until it finishes
    registry.unload("sql")                             # KeyError if not loaded

A request names an adapter (`LLM.generate(..., lora_request=...)`, or the server's `model` field); the
request holds the adapter object, so unloading one only drops the name: requests already running with it
finish, and its weights are freed with the last of them. The weights themselves and how they are applied
are the model layer's (llmserve.model.lora).
"""

from __future__ import annotations

import itertools
import threading
from dataclasses import dataclass

import torch.nn as nn

from llmserve.model.lora import LoRAAdapter, LoRAError, LoRALayers, load_peft_adapter

__all__ = ["LoRAAdapter", "LoRAError", "LoRARegistry", "LoRARequest", "parse_lora_modules"]


@dataclass(frozen=True)
class LoRARequest:
    """vLLM's shape: an adapter by name, and where to load it from if it is not loaded yet."""

    lora_name: str
    lora_int_id: int = 0
    lora_path: str = ""


def parse_lora_modules(specs: list[str] | None) -> list[tuple[str, str]]:
    """`--lora-modules name=path ...` -> [(name, path)]."""
    out = []
    for spec in specs or ():
        name, eq, path = str(spec).partition("=")
        if not eq or not name.strip() or not path.strip():
            raise ValueError(f"lora_modules: {spec!r} is not name=path")
        out.append((name.strip(), path.strip()))
    return out


class LoRARegistry:
    def __init__(
        self, model: nn.Module, max_loras: int, max_lora_rank: int, dtype=None, reserved: tuple[str, ...] = ()
    ) -> None:
        self.model = model
        self.reserved = set(reserved)  # names adapters may not take (the base model's)
        self.max_loras = max_loras
        self.max_lora_rank = max_lora_rank
        self.dtype = dtype
        self.layers = LoRALayers(model)
        self._adapters: dict[str, LoRAAdapter] = {}
        self._ids = itertools.count(1)
        self._lock = threading.Lock()  # the server loads and unloads from its handlers' threads

    def load(self, name: str, path: str) -> LoRAAdapter:
        if not isinstance(name, str) or not name.strip():
            raise LoRAError("lora_name: must be a non-empty string")
        if not isinstance(path, str) or not path:
            raise LoRAError("lora_path: must be a non-empty string")
        if name in self.reserved:
            raise LoRAError(f"lora_name: {name!r} is the base model's name")
        with self._lock:
            if name in self._adapters:
                raise LoRAError(f"lora_name: an adapter named {name!r} is already loaded")
            if len(self._adapters) >= self.max_loras:
                raise LoRAError(
                    f"lora_name: {len(self._adapters)} adapters are loaded, the most --max-loras "
                    f"({self.max_loras}) allows; unload one first"
                )
        adapter = load_peft_adapter(path, self.model, self.max_lora_rank, name, next(self._ids), dtype=self.dtype)
        with self._lock:  # checked again: another load may have finished meanwhile
            if name in self._adapters:
                raise LoRAError(f"lora_name: an adapter named {name!r} is already loaded")
            if len(self._adapters) >= self.max_loras:
                raise LoRAError(f"lora_name: --max-loras ({self.max_loras}) adapters are already loaded")
            self._adapters[name] = adapter
        return adapter

    def unload(self, name: str) -> LoRAAdapter:
        with self._lock:
            if name not in self._adapters:
                raise KeyError(name)
            return self._adapters.pop(name)

    def get(self, name: str) -> LoRAAdapter | None:
        return self._adapters.get(name)

    def names(self) -> list[str]:
        return list(self._adapters)

    def adapters(self) -> list[LoRAAdapter]:
        return list(self._adapters.values())
