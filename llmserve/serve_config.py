"""`llmserve serve`'s HTTP server settings (`ServerSettings`) and its command line: the engine's flags
(llmserve/config.py) and the server's, in one parser. Below the server and the router, so that the launcher
needs neither."""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field

from llmserve.config import TOOL_CALL_PARSERS, EngineConfig, add_engine_arguments, comma_list, engine_config_from_args
from llmserve.flags import add_arguments, flag, from_args
from llmserve.models_config import ModelsDirSettings
from llmserve.security import api_key_field, api_key_file_field, resolve_api_keys, ssl_field


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
    models: ModelsDirSettings = field(default_factory=ModelsDirSettings)  # --models-dir (llmserve/models_config.py)
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
