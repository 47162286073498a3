"""`--models-dir`: one server, a folder of models (llmserve/server/models_dir.py loads and unloads them).

`ModelsDirSettings` declares the flags (a part of ServerSettings, as `models`); `scan_models_dir` lists the
folder: every `*.gguf` file and every Hugging Face folder (one with a config.json) is a model named by its
stem, with its settings from the optional `models.yaml` beside them:

    smol:                     # a model's name (its file's or folder's stem)
      quantization: int8      # any engine flag, as in --config: kv-cache-memory, max-model-len, dtype, ...
      kv-cache-memory: 0.5
      chat-template: t.jinja  # and the per-model server settings of PER_MODEL_SERVER_SETTINGS
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from llmserve.flags import flag

MODELS_YAML = "models.yaml"
# the server settings a model's entry in models.yaml may set (the others are the whole server's)
PER_MODEL_SERVER_SETTINGS = frozenset(
    {
        "chat_template",
        "reasoning_parser",
        "reasoning_start_marker",
        "reasoning_end_marker",
        "tool_call_parser",
        "enable_auto_tool_choice",
        "pooling",
    }
)


@dataclass
class ModelsDirSettings:
    models_dir: str | None = field(
        default=None,
        metadata=flag(
            "serve every GGUF file and Hugging Face folder in this folder, each named by its stem; a model loads "
            "on its first request (per-model settings: DIR/models.yaml). Instead of --model",
            group="models directory",
        ),
    )
    models_max: int = field(
        default=4, metadata=flag("with --models-dir: most models resident at once (least recently used unloaded)")
    )
    model_idle_timeout: float = field(
        default=0.0,
        metadata=flag(
            "with --models-dir: seconds a model may stay idle before it is unloaded (Ollama's keep_alive "
            "default per request); 0: kept until --models-max needs its room"
        ),
    )

    def __post_init__(self) -> None:
        if self.models_max < 1:
            raise ValueError(f"models_max: must be >= 1, got {self.models_max}")
        if self.model_idle_timeout < 0:
            raise ValueError(f"model_idle_timeout: must be >= 0, got {self.model_idle_timeout}")
        if self.models_dir is not None and not os.path.isdir(self.models_dir):
            raise ValueError(f"models_dir: {self.models_dir!r} is not a folder")


@dataclass
class ModelEntry:
    name: str
    path: str
    engine: dict = field(default_factory=dict)  # EngineConfig fields from models.yaml
    server: dict = field(default_factory=dict)  # PER_MODEL_SERVER_SETTINGS from models.yaml


def _is_hf_folder(path: str) -> bool:
    return os.path.isdir(path) and os.path.isfile(os.path.join(path, "config.json"))


def scan_models_dir(folder: str, engine_fields: set[str]) -> list[ModelEntry]:
    """The models in `folder` in name order; a ValueError for a models.yaml that is not a mapping of known
    model names to known settings."""
    import yaml

    entries = {}
    for f in sorted(os.listdir(folder)):
        path = os.path.join(folder, f)
        if f.endswith(".gguf") and os.path.isfile(path):
            entries[f[: -len(".gguf")]] = ModelEntry(f[: -len(".gguf")], path)
        elif _is_hf_folder(path):
            entries[f] = ModelEntry(f, path)
    yaml_path = os.path.join(folder, MODELS_YAML)
    if os.path.isfile(yaml_path):
        with open(yaml_path) as fh:
            data = yaml.safe_load(fh) or {}
        if not isinstance(data, dict):
            raise ValueError(f"models_dir: {yaml_path} must map model names to their settings")
        for name, values in data.items():
            if name not in entries:
                raise ValueError(f"models_dir: {yaml_path} names {name!r}, which is not a model in {folder}")
            if not isinstance(values, dict):
                raise ValueError(f"models_dir: {yaml_path}: {name}'s settings must be a mapping")
            for key, value in values.items():
                attr = str(key).replace("-", "_")
                if attr in ("model", "served_model_name"):
                    raise ValueError(f"models_dir: {yaml_path}: {name}.{key}: the file and the name are the folder's")
                if attr in engine_fields:
                    entries[name].engine[attr] = value
                elif attr in PER_MODEL_SERVER_SETTINGS:
                    entries[name].server[attr] = value
                else:
                    raise ValueError(f"models_dir: {yaml_path}: {name}.{key}: not a per-model setting")
    return list(entries.values())
