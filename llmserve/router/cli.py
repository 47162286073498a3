"""`llmserve route`: an OpenAI-API router over several llmserve / vLLM servers.

    llmserve route --backend http://127.0.0.1:8001 --backend http://127.0.0.1:8002 \\
                   --port 8080 --policy cache_aware
    llmserve route --config fleet.yaml
    llmserve route --backend-dns llmserve-headless.default.svc.cluster.local:8000
    llmserve route --backend https://10.0.0.5:8000 --backend-ca-certs ca.pem \
                   --ssl-keyfile key.pem --ssl-certfile cert.pem --api-key k1 k2
"""

from __future__ import annotations

import argparse
import logging

from llmserve.flags import add_arguments as config_arguments
from llmserve.flags import from_args


def add_arguments(p: argparse.ArgumentParser) -> None:
    """RouterConfig's flags (llmserve/router/config.py)."""
    from .config import RouterConfig

    config_arguments(p, RouterConfig)


def build_router(args, dns_resolver=None):
    """A Router from parsed arguments (and the YAML file, when given)."""
    from .app import Router, RouterConfig
    from .discovery import Registry, load_config

    registry = Registry()
    cfg = from_args(RouterConfig, args)
    cfg.backend_dns = list(args.backend_dns or [])
    fleet = load_config(args.config) if args.config else None
    if fleet is not None:
        for b in fleet.backends:
            registry.add(b)
        cfg.backend_dns += [f"{d.scheme}://{d.name}:{d.port}" for d in fleet.dns]
    cfg.policy = args.policy or (fleet.settings.get("policy") if fleet else None) or RouterConfig.policy
    if not (cfg.backends or len(registry) or cfg.backend_dns):
        raise SystemExit("llmserve route: give at least one --backend, --config or --backend-dns")
    return Router(cfg, registry=registry, dns_resolver=dns_resolver)


def run(args) -> int:
    import uvicorn

    from llmserve.security import uvicorn_ssl

    from .app import build_app

    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per health check otherwise
    try:
        router = build_router(args)
        tls = uvicorn_ssl(router.config, "llmserve route")
    except ValueError as e:  # an unreadable --api-key-file, TLS files
        raise SystemExit(str(e)) from e
    log = logging.getLogger("llmserve.router")
    log.info(
        "routing with policy %s over %d backends%s",
        router.policy.name,
        len(router.registry),
        f" + DNS {', '.join(router.config.backend_dns)}" if router.config.backend_dns else "",
    )
    cfg = router.config
    uvicorn.run(
        build_app(router),
        host=cfg.host,
        port=cfg.port,
        log_level=cfg.log_level,
        access_log=False,
        proxy_headers=False,
        timeout_graceful_shutdown=5,
        **tls,
    )
    return 0
