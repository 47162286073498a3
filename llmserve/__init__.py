"""llmserve: a small, readable LLM serving stack."""

from __future__ import annotations

__version__ = "0.1.0"

__all__ = ["LLM", "LoRARequest", "SamplingParams", "__version__"]


def __getattr__(name):  # lazy: `import llmserve` must not import torch
    if name == "LLM":
        from llmserve.engine.llm import LLM

        return LLM
    if name == "LoRARequest":
        from llmserve.engine.lora import LoRARequest

        return LoRARequest
    if name == "SamplingParams":
        from llmserve.sampling_params import SamplingParams

        return SamplingParams
    raise AttributeError(name)
