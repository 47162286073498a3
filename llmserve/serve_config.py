"""The HTTP server's settings, all of them: `ServerSettings` (`llmserve serve`'s server flags), `ModelsDirSettings`
(its `models`: --models-dir and the per-model settings of its models.yaml, `scan_models_dir`), and its command line:
the engine's flags (llmserve/config.py) and the server's, in one parser. Below the server and the router, so that
the launcher needs neither. (The engine's settings: llmserve/config.py; the router's: llmserve/router/config.py.)

--models-dir: one server, a folder of models (llmserve/server/models_dir.py loads and unloads them).

`ModelsDirSettings` declares the flags (a part of ServerSettings, as `models`); `scan_models_dir` lists the
folder: every `*.gguf` file and every Hugging Face folder (one with a config.json) is a model named by its
stem, with its settings from the optional `models.yaml` beside them:

    smol:                     # a model's name (its file's or folder's stem)
      quantization: int8      # any engine flag, as in --config: kv-cache-memory, max-model-len, dtype, ...
      kv-cache-memory: 0.5
      chat-template: t.jinja  # and the per-model server settings of PER_MODEL_SERVER_SETTINGS
"""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass, field

from llmserve.config import EngineConfig, add_engine_arguments, engine_config_from_args
from llmserve.flags import add_arguments, comma_list, flag, from_args
from llmserve.security import api_key_field, api_key_file_field, resolve_api_keys, ssl_field

# the tool-call parsers (llmserve/server/tool_parsers/: its PARSERS, which a unit test holds to this list)
TOOL_CALL_PARSERS = ("hermes", "llama3_json", "mistral", "openai", "pythonic", "qwen3_coder")


# -- --models-dir ----------------------------------------------------------------------------------------------------
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


# -- the server ------------------------------------------------------------------------------------------------------


@dataclass
class ServerSettings:
    """`llmserve serve`'s HTTP server (llmserve/server/): each field's metadata makes its flag, in the group
    "server"; `add_serve_arguments` adds them with the engine's, `llmserve launch` offers them for its
    replicas. Here, below the server and the router, so that the launcher needs neither."""

    host: str = field(default="127.0.0.1", metadata=flag("address to listen on"))
    port: int = field(default=8000, metadata=flag("port to listen on"))
    ssl_keyfile: str | None = ssl_field("ssl_keyfile")  # TLS (llmserve/security.py): uvicorn's ssl_* settings
    ssl_certfile: str | None = ssl_field("ssl_certfile")
    ssl_ca_certs: str | None = ssl_field("ssl_ca_certs")
    ssl_cert_reqs: int = ssl_field("ssl_cert_reqs")
    # one key (a str) or several: any one is accepted (api_keys())
    api_key: str | list[str] | None = api_key_field(
        "require 'Authorization: Bearer KEY' (or 'x-api-key: KEY') on the API; several keys: any one "
        "is accepted (also LLMSERVE_API_KEY)",
        env="LLMSERVE_API_KEY",
    )
    api_key_file: str | None = api_key_file_field()
    protect_metrics: bool = field(  # /metrics, /health, /ready and /version need the key too
        default=False,
        metadata=flag(
            "with --api-key, also require the key on /metrics, /health, /ready and /version", action="store_true"
        ),
    )
    allowed_origins: list[str] = field(
        default_factory=list,
        metadata=flag(
            "comma-separated CORS origins (default: none, CORS closed)", type=str, default="", parse=comma_list
        ),
    )
    allowed_media_domains: list[str] = field(  # images by http(s) URL: only from these hosts (none: refused)
        default_factory=list,
        metadata=flag(
            "comma-separated hosts that image URLs (http/https) may name; default: none, only data: URLs",
            type=str,
            default="",
            parse=comma_list,
        ),
    )
    log_requests: str | None = field(  # server/request_log.py
        default=None,
        metadata=flag(
            "append every generating request (its prompt as the engine saw it, max_tokens, arrival time) to this "
            "JSONL file: the request log `llmserve tune --workload FILE` replays with its timing",
            metavar="FILE",
        ),
    )
    request_timeout: float | None = field(  # seconds; past it a request is aborted
        default=None,
        metadata=flag("seconds after which a request is aborted and answered with a timeout error"),
    )
    max_request_body_bytes: int = field(default=4 * 1024 * 1024, metadata=flag("larger request bodies get 413"))
    read_timeout: float = field(  # seconds for a request's headers, and again for its body
        default=30.0,
        metadata=flag(
            "seconds a client has to send a request's headers, and again its body (slow clients "
            "are cut off: slowloris); 0: no limit"
        ),
    )
    sse_ping_interval: float = field(  # seconds between ': ping' comments while a stream waits; 0: none
        default=0.0,
        metadata=flag(
            "seconds between SSE comment pings (': ping') while a stream waits for its next "
            "token; 0 (default): none, as vLLM and OpenAI send none. Set it behind proxies that "
            "cut idle streams; some clients (vllm bench serve) drop streams that carry comments"
        ),
    )
    graceful_shutdown_timeout: float = field(
        default=30.0, metadata=flag("on SIGTERM, seconds to let running requests finish")
    )
    reasoning_parser: str | None = field(  # split <think>...</think> (llmserve/server/reasoning.py)
        default=None,
        metadata=flag(
            "split a thinking model's <think>...</think> from its answer: reasoning_content in chat, "
            "a reasoning item in /v1/responses, a thinking block in /v1/messages. deepseek_r1: the "
            "output starts inside the reasoning; qwen3: only an output that opens with the marker",
            choices=("deepseek_r1", "qwen3"),
        ),
    )
    reasoning_start_marker: str | None = field(
        default=None, metadata=flag("with --reasoning-parser: the start marker", default="<think>")
    )
    reasoning_end_marker: str | None = field(
        default=None, metadata=flag("with --reasoning-parser: the end marker", default="</think>")
    )
    enable_auto_tool_choice: bool = field(  # tool calls parsed from the output (llmserve/server/tool_parsers/)
        default=True,
        metadata=flag(
            'tool_choice "auto" (the default with tools): the model may answer or call tools, its calls '
            "read by --tool-call-parser and streamed as they are written. On by default; "
            '--no-enable-auto-tool-choice refuses "auto" with tools (400), as vLLM does without the flag'
        ),
    )
    tool_call_parser: str | None = field(
        default=None,
        metadata=flag(
            "the format of the model's tool calls (vLLM's names): hermes (Hermes, Qwen2.5, Qwen3), "
            "llama3_json (Llama 3.x JSON), mistral ([TOOL_CALLS]), openai (gpt-oss harmony), pythonic "
            "(Llama 3.2 / 4 pythonic), qwen3_coder (XML). Default: chosen from the chat template",
            choices=TOOL_CALL_PARSERS,
        ),
    )
    chat_template: str | None = field(
        default=None,
        metadata=flag("a chat template instead of the model's: a Jinja file or text", metavar="FILE|STRING"),
    )
    pooling: str = field(  # /v1/embeddings (llmserve/server/api/embeddings.py)
        default="last",
        metadata=flag(
            "/v1/embeddings: pool the prompt's final hidden states by its last token (as vLLM pools "
            "decoder models) or their mean; the vector is normalized",
            choices=("last", "mean"),
        ),
    )
    batch_dir: str | None = field(  # the Files and Batches APIs (llmserve/server/batch_store.py)
        default=None,
        metadata=flag(
            "keep OpenAI Files and Batches API state here (uploaded files, batches, their results; they survive a "
            "restart, a batch in progress resumes); one server per folder. Default: none, /v1/files and "
            "/v1/batches answer 404",
            metavar="DIR",
        ),
    )
    max_batch_file_bytes: int = field(
        default=64 * 1024 * 1024, metadata=flag("with --batch-dir: larger uploads to /v1/files get 413")
    )
    log_level: str = field(default="info", metadata=flag(None, choices=("debug", "info", "warning", "error")))
    log_prompts: bool = field(
        default=False, metadata=flag("log prompts and completions (off by default)", action="store_true")
    )
    otlp_traces_endpoint: str | None = field(  # llmserve/server/tracing.py
        default=None,
        metadata=flag(
            "export a span per request (vLLM's llm_request, gen_ai.* attributes) to this OTLP HTTP/protobuf "
            "endpoint, e.g. http://127.0.0.1:4318/v1/traces (also OTEL_EXPORTER_OTLP_TRACES_ENDPOINT); needs "
            "pip install 'llmserve[otlp]'",
            metavar="URL",
            env="OTEL_EXPORTER_OTLP_TRACES_ENDPOINT",
        ),
    )
    engine: EngineConfig = field(default_factory=EngineConfig)
    models: ModelsDirSettings = field(default_factory=ModelsDirSettings)  # --models-dir (ModelsDirSettings, above)
    ready_stall_seconds: float = 120.0  # /ready fails if the engine loop made no progress this long
    retry_after_seconds: int = 1

    def api_keys(self) -> tuple[str, ...]:
        """The accepted API keys (--api-key's and --api-key-file's); empty: the API is open. Reads the file."""
        return resolve_api_keys(self.api_key, self.api_key_file)


def add_serve_arguments(parser: argparse.ArgumentParser) -> None:
    """`llmserve serve`'s flags: --config, the engine's and the HTTP server's."""
    parser.add_argument("--config", default=None, help="YAML file of settings (keys as flag names); flags win")
    add_engine_arguments(parser)
    add_arguments(parser, ServerSettings, "server")
    add_arguments(parser, ModelsDirSettings)


def read_config_file(path: str) -> dict:
    """--config's YAML: a mapping of settings (keys as flag names); SystemExit for anything else."""
    import yaml

    with open(path) as f:
        data = yaml.safe_load(f) or {}
    if not isinstance(data, dict):
        raise SystemExit(f"--config: {path} must hold a mapping of settings")
    return data


def serve_settings_from_args(args: argparse.Namespace) -> ServerSettings:
    return from_args(
        ServerSettings, args, engine=engine_config_from_args(args), models=from_args(ModelsDirSettings, args)
    )
