"""`llmserve serve`: flags (named as vLLM names them), YAML config, uvicorn (TLS with --ssl-*), graceful shutdown."""

from __future__ import annotations

import argparse
import logging
import signal
import sys

from llmserve.config import flag_dests
from llmserve.serve_config import add_serve_arguments as add_arguments  # noqa: F401 (the subcommand's flags)
from llmserve.serve_config import read_config_file, serve_settings_from_args


def _apply_config_file(args: argparse.Namespace, argv_flags: set[str]) -> None:
    if not args.config:
        return
    data = read_config_file(args.config)
    for key, value in data.items():
        attr = key.replace("-", "_")
        if attr == "replicas":  # `llmserve tune`'s fleet size: `llmserve launch --config` reads it
            if value and int(value) > 1:
                print(
                    f"llmserve serve: {args.config} asks for {value} replicas; this starts one "
                    f"(`llmserve launch --config {args.config}` starts them behind the router)",
                    file=sys.stderr,
                )
            continue
        if not hasattr(args, attr):
            raise SystemExit(f"--config: unknown setting {key!r}")
        if attr not in argv_flags:
            setattr(args, attr, value)


def run(args: argparse.Namespace) -> int:
    import uvicorn

    from llmserve.security import uvicorn_ssl
    from llmserve.server.app import build_app
    from llmserve.server.http_limits import http_protocol

    _apply_config_file(args, flag_dests(sys.argv[2:]))
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)  # batches' in-process calls: the request log says enough
    try:
        settings = serve_settings_from_args(args)
    except ValueError as e:  # a bad setting (--models-dir not a folder, ...)
        raise SystemExit(f"llmserve serve: {e}") from e
    if settings.engine.tensor_parallel_size > 1:
        from llmserve.engine import tp

        ext = tp.external_launch()
        if ext is not None and ext[0] != 0:  # torchrun / RANK>0: a worker, no HTTP
            return tp.run_external_worker(settings.engine)
    try:
        tls = uvicorn_ssl(settings, "llmserve serve")
        app = build_app(settings)
    except ValueError as e:  # a bad setting (--tool-call-parser from --config, --chat-template, TLS files, ...)
        raise SystemExit(f"llmserve serve: {e}") from e
    config = uvicorn.Config(
        app,
        host=settings.host,
        port=settings.port,
        log_level=settings.log_level,
        timeout_graceful_shutdown=settings.graceful_shutdown_timeout,
        h11_max_incomplete_event_size=64 * 1024,
        timeout_keep_alive=5,
        http=http_protocol(settings.read_timeout, 64 * 1024),
        **tls,
    )
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
