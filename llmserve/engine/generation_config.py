"""The model's own sampling defaults (vLLM's `--generation-config` / `--override-generation-config`).

Model makers ship their recommended sampling in `generation_config.json` beside the weights (Qwen3: a
temperature of 0.6, top_p 0.95, top_k 20). With `auto` (the default) the engine reads it from the model's
folder; `vllm` ignores it (llmserve's own defaults: temperature 1, no filters); a folder reads that folder's.
The overrides (a JSON object of the same keys) apply on top in every mode. A request's own fields always win:
the defaults fill only what a request leaves out (the server's `prepare.sampling_params`, `LLM.generate`
without sampling params). A GGUF file has no such file: `auto` means no defaults for it."""

from __future__ import annotations

import json
import logging
import os

from llmserve.config import GENERATION_CONFIG_KEYS as KEYS
from llmserve.sampling_params import SamplingParams

log = logging.getLogger("llmserve.engine")


def default_sampling(mode: str, model_folder: str | None, overrides: dict) -> dict:
    """SamplingParams field -> default, from `mode` ('auto': the model's folder; 'vllm': none; else a folder)
    and the overrides. `model_folder`: the Hugging Face folder of the model (None for a GGUF file)."""
    folder = None if mode == "vllm" else model_folder if mode == "auto" else mode
    found: dict = {}
    if folder is not None:
        path = os.path.join(folder, "generation_config.json")
        if os.path.isfile(path):
            try:
                with open(path) as f:
                    found = json.load(f)
            except (OSError, json.JSONDecodeError) as e:
                raise ValueError(f"generation_config: {path} is not readable JSON: {e}") from None
        elif mode not in ("auto", "vllm"):
            raise ValueError(f"generation_config: {folder!r} has no generation_config.json")
    merged = {**(found if isinstance(found, dict) else {}), **overrides}
    out = {KEYS[k]: v for k, v in merged.items() if k in KEYS and v is not None}
    try:
        SamplingParams(**out)
    except ValueError as e:
        raise ValueError(f"generation_config: {e}") from None
    if out:
        log.info(
            "default sampling parameters from the model's generation config (a request's own fields win): %s; "
            "--generation-config vllm ignores them",
            out,
        )
    return out
