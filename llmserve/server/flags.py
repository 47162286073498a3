"""`llmserve serve`'s flags: --config, the engine's (generated from EngineConfig, llmserve/config.py)
and the HTTP server's. Light (argparse only), so that `llmserve launch` can offer and pass on every
serve flag without importing the server."""

from __future__ import annotations

import argparse

from llmserve.config import add_engine_arguments


def add_serve_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", default=None, help="YAML file of settings (keys as flag names); flags win")
    add_engine_arguments(p)
    g = p.add_argument_group("server")
    g.add_argument("--host", default="127.0.0.1", help="address to listen on")
    g.add_argument("--port", type=int, default=8000, help="port to listen on")
    g.add_argument(
        "--api-key", default=None, help="require 'Authorization: Bearer KEY' on the API (also LLMSERVE_API_KEY)"
    )
    g.add_argument(
        "--protect-metrics",
        action="store_true",
        help="with --api-key, also require the key on /metrics, /health, /ready and /version",
    )
    g.add_argument("--allowed-origins", default="", help="comma-separated CORS origins (default: none, CORS closed)")
    g.add_argument(
        "--request-timeout",
        type=float,
        default=None,
        help="seconds after which a request is aborted and answered with a timeout error",
    )
    g.add_argument("--max-request-body-bytes", type=int, default=4 * 1024 * 1024, help="larger request bodies get 413")
    g.add_argument(
        "--read-timeout",
        type=float,
        default=30.0,
        help="seconds a client has to send a request's headers, and again its body (slow clients "
        "are cut off: slowloris); 0: no limit",
    )
    g.add_argument(
        "--sse-ping-interval",
        type=float,
        default=0.0,
        help="seconds between SSE comment pings (': ping') while a stream waits for its next "
        "token; 0 (default): none, as vLLM and OpenAI send none. Set it behind proxies that "
        "cut idle streams; some clients (vllm bench serve) drop streams that carry comments",
    )
    g.add_argument(
        "--graceful-shutdown-timeout",
        type=float,
        default=30.0,
        help="on SIGTERM, seconds to let running requests finish",
    )
    g.add_argument(
        "--reasoning-parser",
        default=None,
        choices=["deepseek_r1", "qwen3"],
        help="split a thinking model's <think>...</think> from its answer: reasoning_content in chat, "
        "a reasoning item in /v1/responses, a thinking block in /v1/messages. deepseek_r1: the "
        "output starts inside the reasoning; qwen3: only an output that opens with the marker",
    )
    g.add_argument("--reasoning-start-marker", default="<think>", help="with --reasoning-parser: the start marker")
    g.add_argument("--reasoning-end-marker", default="</think>", help="with --reasoning-parser: the end marker")
    g.add_argument(
        "--pooling",
        default="last",
        choices=["last", "mean"],
        help="/v1/embeddings: pool the prompt's final hidden states by its last token (as vLLM pools "
        "decoder models) or their mean; the vector is normalized",
    )
    g.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    g.add_argument("--log-prompts", action="store_true", help="log prompts and completions (off by default)")
