"""`llmserve route`'s settings (RouterConfig): each field's metadata makes its flag (llmserve/flags.py)."""

from __future__ import annotations

import ssl
from dataclasses import dataclass, field

from llmserve.flags import flag
from llmserve.security import api_key_field, api_key_file_field, resolve_api_keys, ssl_field

from .policies import POLICIES

DEFAULT_POLICY = "cache_aware"
TIMEOUTS = "retries, timeouts, back-pressure"


@dataclass
class RouterConfig:
    """`llmserve route`'s settings: each field's metadata makes its flag (llmserve/flags.py's `flag`), in
    field order and in its --help group."""

    # -- backends
    backends: list[str] = field(
        default_factory=list,
        metadata=flag(
            "a backend server (repeat for several)", name="--backend", action="append", metavar="URL", group="backends"
        ),
    )
    config: str | None = field(  # the fleet file (discovery.load_config), read by the CLI
        default=None,
        metadata=flag(
            "YAML file listing backends with models, weights, prompt-length ranges (see docs/router.md)",
            metavar="YAML",
        ),
    )
    backend_dns: list[str] = field(
        default_factory=list,
        metadata=flag(
            "discover backends from every address of a DNS "
            "name (e.g. a Kubernetes headless Service), re-resolved every --dns-interval",
            action="append",
            metavar="NAME:PORT",
        ),
    )
    dns_interval: float = field(default=10.0, metadata=flag(None, metavar="S"))
    # -- listening (the CLI's: uvicorn's)
    host: str = field(default="127.0.0.1", metadata=flag(None, group="listening"))
    port: int = field(default=8080, metadata=flag(None))
    ssl_keyfile: str | None = ssl_field("ssl_keyfile")  # TLS (llmserve/security.py): uvicorn's ssl_* settings
    ssl_certfile: str | None = ssl_field("ssl_certfile")
    ssl_ca_certs: str | None = ssl_field("ssl_ca_certs")
    ssl_cert_reqs: int = ssl_field("ssl_cert_reqs")
    api_key: str | list[str] | None = api_key_field(  # the router's own keys (clients must send one)
        "clients must send this key (Bearer, or x-api-key); several keys: any one is accepted"
    )
    api_key_file: str | None = api_key_file_field()
    backend_api_key: str | None = field(  # sent to backends instead of the client's key
        default=None, metadata=flag("key sent to backends (default: none; the client's key is not passed on)")
    )
    forward_client_key: bool = field(  # pass the client's Authorization/x-api-key through to backends
        default=False,
        metadata=flag(
            "pass the client's Authorization / x-api-key through to backends (off by default; --backend-api-key wins)",
            action="store_true",
        ),
    )
    backend_ca_certs: str | None = field(  # https:// backends are verified against this (else the system's CAs)
        default=None,
        metadata=flag(
            "CA certificates (PEM) to verify https:// backends with (default: the system's trusted CAs)",
            metavar="FILE",
        ),
    )
    log_level: str = field(default="info", metadata=flag(None))
    # -- routing (policies/)
    policy: str = field(
        default=DEFAULT_POLICY,
        metadata=flag(  # None: the fleet file's policy, else the default (the CLI's build_router)
            f"routing policy (default {DEFAULT_POLICY})", choices=tuple(sorted(POLICIES)), default=None, group="routing"
        ),
    )
    power_of_two: bool = field(
        default=False,
        metadata=flag("least_outstanding: pick the better of two random backends", action="store_true"),
    )
    cache_threshold: float = field(
        default=0.5, metadata=flag("cache_aware: minimum matched prefix fraction to follow the cache")
    )
    balance_abs_threshold: float = field(
        default=32, metadata=flag("cache_aware: load gap (requests) beyond which balance wins ...")
    )
    balance_rel_threshold: float = field(default=1.5, metadata=flag("... when also max load > min load * this"))
    session_header: str = field(
        default="x-session-id", metadata=flag("session: header with the session key (else the body's `user`)")
    )
    chars_per_token: float = field(default=4.0, metadata=flag("prompt length estimate for length buckets and timeouts"))
    kv_events_interval: float = field(
        default=1.0,
        metadata=flag(
            "cache_aware: seconds between reads of each backend's GET /kv_events (its real KV cache; "
            "backends without it keep the guessed prefix tree); 0: off",
            metavar="S",
        ),
    )
    scrape_metrics: bool = field(
        default=False,
        metadata=flag(
            "read running/waiting/KV usage from each backend's /metrics and use it "
            "in least_outstanding and cache_aware",
            action="store_true",
        ),
    )
    # -- health (health.py)
    health_interval: float = field(default=5.0, metadata=flag(None, metavar="S", group="health"))
    health_timeout: float = field(default=2.0, metadata=flag(None, metavar="S"))
    unhealthy_threshold: int = field(
        default=3, metadata=flag("failed checks in a row that eject a backend (refused connections: 1)")
    )
    healthy_threshold: int = field(default=1, metadata=flag("good checks in a row that re-admit an ejected backend"))
    # -- retries, timeouts, back-pressure (proxy.py, and the router queue below)
    max_retries: int = field(  # extra attempts on other backends, before the 1st byte
        default=2, metadata=flag("attempts on other backends for failures before the first byte", group=TIMEOUTS)
    )
    connect_timeout: float = field(default=5.0, metadata=flag(None, metavar="S"))
    first_byte_timeout: float = field(  # streams: until the backend's first byte
        default=120.0, metadata=flag("streams: limit until the backend's first byte", metavar="S")
    )
    request_timeout: float | None = field(  # fixed per-request limit; None: from the request's size
        default=None,
        metadata=flag(
            "fixed per-request limit (default: computed from prompt length and "
            "max_tokens; clients may send X-Request-Timeout)",
            metavar="S",
        ),
    )
    # the computed limit: base + prompt_tokens * per_prompt + max_tokens * per_output
    timeout_base: float = field(default=60.0, metadata=flag(None, metavar="S"))
    timeout_per_prompt_token: float = field(default=0.02, metadata=flag(None))
    timeout_per_output_token: float = field(default=0.25, metadata=flag(None))
    default_max_tokens: int = field(
        default=1024, metadata=flag("max_tokens assumed for the timeout when a request gives none")
    )
    max_outstanding: int = field(  # per backend; 0: unlimited (no router queue)
        default=64, metadata=flag("in-flight requests per backend before it counts as saturated (0: no limit)")
    )
    max_queued: int = field(  # beyond this, 429 with Retry-After
        default=256,
        metadata=flag(
            "requests that may wait at the router when all backends are saturated; beyond, 429 with Retry-After"
        ),
    )
    queue_timeout: float = field(default=60.0, metadata=flag(None, metavar="S"))

    def api_keys(self) -> tuple[str, ...]:
        """The keys clients may send (--api-key's and --api-key-file's); empty: none needed. Reads the file."""
        return resolve_api_keys(self.api_key, self.api_key_file)

    def backend_ssl_context(self) -> ssl.SSLContext:
        """How https:// backends are verified: against --backend-ca-certs, else the system's CAs."""
        return ssl.create_default_context(cafile=self.backend_ca_certs or None)
