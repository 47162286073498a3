"""`llmserve route`: an OpenAI-API router over several llmserve / vLLM servers.

    llmserve route --backend http://127.0.0.1:8001 --backend http://127.0.0.1:8002 \\
                   --port 8080 --policy cache_aware
    llmserve route --config fleet.yaml
    llmserve route --backend-dns llmserve-headless.default.svc.cluster.local:8000
"""

from __future__ import annotations

import argparse
import logging

from .policies import POLICIES


def add_arguments(p: argparse.ArgumentParser) -> None:
    from .app import RouterConfig

    d = RouterConfig()
    g = p.add_argument_group("backends")
    g.add_argument(
        "--backend",
        dest="backends",
        action="append",
        default=[],
        metavar="URL",
        help="a backend server (repeat for several)",
    )
    g.add_argument(
        "--config",
        default=None,
        metavar="YAML",
        help="YAML file listing backends with models, weights, prompt-length ranges (see docs/router.md)",
    )
    g.add_argument(
        "--backend-dns",
        dest="backend_dns",
        action="append",
        default=[],
        metavar="NAME:PORT",
        help="discover backends from every address of a DNS "
        "name (e.g. a Kubernetes headless Service), re-resolved every --dns-interval",
    )
    g.add_argument("--dns-interval", type=float, default=d.dns_interval, metavar="S")

    g = p.add_argument_group("listening")
    g.add_argument("--host", default="127.0.0.1")
    g.add_argument("--port", type=int, default=8080)
    g.add_argument("--api-key", default=None, help="clients must send this key (Bearer, or x-api-key)")
    g.add_argument(
        "--backend-api-key",
        default=None,
        help="key sent to backends (default: none; the client's key is not passed on)",
    )
    g.add_argument(
        "--forward-client-key",
        action="store_true",
        help="pass the client's Authorization / x-api-key through to backends (off by default; --backend-api-key wins)",
    )
    g.add_argument("--log-level", default="info")

    g = p.add_argument_group("routing")
    g.add_argument("--policy", choices=sorted(POLICIES), default=None, help=f"routing policy (default {d.policy})")
    g.add_argument(
        "--power-of-two", action="store_true", help="least_outstanding: pick the better of two random backends"
    )
    g.add_argument(
        "--cache-threshold",
        type=float,
        default=d.cache_threshold,
        help="cache_aware: minimum matched prefix fraction to follow the cache",
    )
    g.add_argument(
        "--balance-abs-threshold",
        type=float,
        default=d.balance_abs_threshold,
        help="cache_aware: load gap (requests) beyond which balance wins ...",
    )
    g.add_argument(
        "--balance-rel-threshold",
        type=float,
        default=d.balance_rel_threshold,
        help="... when also max load > min load * this",
    )
    g.add_argument(
        "--session-header",
        default=d.session_header,
        help="session: header with the session key (else the body's `user`)",
    )
    g.add_argument(
        "--chars-per-token",
        type=float,
        default=d.chars_per_token,
        help="prompt length estimate for length buckets and timeouts",
    )
    g.add_argument(
        "--scrape-metrics",
        action="store_true",
        help="read running/waiting/KV usage from each backend's /metrics and use it "
        "in least_outstanding and cache_aware",
    )

    g = p.add_argument_group("health")
    g.add_argument("--health-interval", type=float, default=d.health_interval, metavar="S")
    g.add_argument("--health-timeout", type=float, default=d.health_timeout, metavar="S")
    g.add_argument(
        "--unhealthy-threshold",
        type=int,
        default=d.unhealthy_threshold,
        help="failed checks in a row that eject a backend (refused connections: 1)",
    )
    g.add_argument(
        "--healthy-threshold",
        type=int,
        default=d.healthy_threshold,
        help="good checks in a row that re-admit an ejected backend",
    )

    g = p.add_argument_group("retries, timeouts, back-pressure")
    g.add_argument(
        "--max-retries",
        type=int,
        default=d.max_retries,
        help="attempts on other backends for failures before the first byte",
    )
    g.add_argument("--connect-timeout", type=float, default=d.connect_timeout, metavar="S")
    g.add_argument(
        "--first-byte-timeout",
        type=float,
        default=d.first_byte_timeout,
        metavar="S",
        help="streams: limit until the backend's first byte",
    )
    g.add_argument(
        "--request-timeout",
        type=float,
        default=None,
        metavar="S",
        help="fixed per-request limit (default: computed from prompt length and "
        "max_tokens; clients may send X-Request-Timeout)",
    )
    g.add_argument("--timeout-base", type=float, default=d.timeout_base, metavar="S")
    g.add_argument("--timeout-per-prompt-token", type=float, default=d.timeout_per_prompt_token)
    g.add_argument("--timeout-per-output-token", type=float, default=d.timeout_per_output_token)
    g.add_argument(
        "--default-max-tokens",
        type=int,
        default=d.default_max_tokens,
        help="max_tokens assumed for the timeout when a request gives none",
    )
    g.add_argument(
        "--max-outstanding",
        type=int,
        default=d.max_outstanding,
        help="in-flight requests per backend before it counts as saturated (0: no limit)",
    )
    g.add_argument(
        "--max-queued",
        type=int,
        default=d.max_queued,
        help="requests that may wait at the router when all backends are saturated; beyond, 429 with Retry-After",
    )
    g.add_argument("--queue-timeout", type=float, default=d.queue_timeout, metavar="S")


def build_router(args, dns_resolver=None):
    """A Router from parsed arguments (and the YAML file, when given)."""
    from .app import Router, RouterConfig
    from .discovery import Registry, load_config

    registry = Registry()
    cfg = RouterConfig.from_namespace(args)
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

    from .app import build_app

    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per health check otherwise
    router = build_router(args)
    log = logging.getLogger("llmserve.router")
    log.info(
        "routing with policy %s over %d backends%s",
        router.policy.name,
        len(router.registry),
        f" + DNS {', '.join(router.config.backend_dns)}" if router.config.backend_dns else "",
    )
    uvicorn.run(
        build_app(router),
        host=args.host,
        port=args.port,
        log_level=args.log_level,
        access_log=False,
        proxy_headers=False,
        timeout_graceful_shutdown=5,
    )
    return 0
