"""Reaching the shared store of `--kv-cache-url`: its URL, and the redis-py client for it (kv_remote.py calls it).

Two forms, the schemes redis-py and Redis' own tools use, `+cluster` for a cluster (as a driver is named in a
database URL's scheme):

    redis://[[USER]:PASSWORD@]HOST:PORT[/DB][?OPTIONS]                   one server (or a proxy, a Sentinel's
                                                                          stable address, a managed endpoint)
    redis+cluster://[[USER]:PASSWORD@]HOST:PORT[,HOST:PORT...][?OPTIONS] a Redis Cluster: any of its nodes, as
                                                                          seeds; the client asks one for the slots
                                                                          map and talks to every primary itself

`rediss` is TLS, `valkey` and `valkeys` the same protocol (`valkey+cluster://`, `rediss+cluster://`...). OPTIONS
are redis-py's URL options (`ssl_ca_certs=...`). A cluster has one database: `/0` or none.

A cluster's client is redis-py's `RedisCluster`: its non-transactional pipeline splits one pipelined call into
one pipeline per node, sent to all of them before any answer is read. It is made on first use, so that a
cluster unreachable at start does not stop the server (the breaker opens and the writer's probe makes it later).
"""

from __future__ import annotations

import threading
from urllib.parse import urlsplit, urlunsplit

SCHEMES = ("redis", "rediss", "valkey", "valkeys")
CLUSTER = "+cluster"


def check_url(url: str) -> None:
    """ValueError, saying what is wrong, unless `url` is a store URL llmserve can use."""
    scheme = url.split("://", 1)[0] if "://" in url else ""
    base = scheme.removesuffix(CLUSTER)
    if base not in SCHEMES:
        raise ValueError(
            "kv_cache_url: must be redis://, rediss://, valkey:// or valkeys:// (a Redis Cluster: redis+cluster://"
            f"HOST:PORT[,HOST:PORT...]), got {scheme or url!r}"
        )
    if scheme.endswith(CLUSTER):
        cluster_nodes(url)


def is_cluster(url: str) -> bool:
    return url.split("://", 1)[0].endswith(CLUSTER)


def client_url(url: str) -> str:
    """redis-py's URL for `url` (valkey:// and valkeys:// are the same protocol as redis:// and rediss://)."""
    scheme, rest = url.split("://", 1)
    base = scheme.removesuffix(CLUSTER)
    return {"valkey": "redis", "valkeys": "rediss"}.get(base, base) + scheme[len(base) :] + "://" + rest


def redacted(url: str) -> str:
    """`url` without its password (for logs)."""
    parts = urlsplit(url)
    if parts.password is None:
        return url
    netloc = parts.netloc.rsplit("@", 1)[1]
    user = parts.username or ""
    return urlunsplit(parts._replace(netloc=f"{user}:***@{netloc}"))


def _split(url: str) -> tuple[str, str, str, str]:
    """(scheme, user info with its '@' or '', the hosts, the path and query) of a URL whose host part may list
    several HOST:PORT (urlsplit reads one port only)."""
    scheme, rest = url.split("://", 1)
    end = min((i for i in (rest.find("/"), rest.find("?")) if i >= 0), default=len(rest))
    netloc, tail = rest[:end], rest[end:]
    auth, at, hosts = netloc.rpartition("@")
    return scheme, auth + at, hosts, tail


def cluster_nodes(url: str) -> list[tuple[str, int]]:
    """The seed nodes of a cluster URL (a port missing is 6379); ValueError for a malformed one."""
    _, _, hosts, tail = _split(url)
    path = tail.split("?", 1)[0]
    if path not in ("", "/", "/0"):
        raise ValueError(f"kv_cache_url: a Redis Cluster has one database (/0), got {path!r}")
    nodes = []
    for seed in (s.strip() for s in hosts.split(",")):
        if seed.startswith("["):  # [IPv6]:PORT
            host, _, port = seed[1:].partition("]")
            port = port.removeprefix(":") or "6379"
        else:
            host, _, port = seed.partition(":")
            port = port or "6379"
        if not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise ValueError(f"kv_cache_url: {seed!r} is not HOST:PORT")
        nodes.append((host, int(port)))
    return nodes


def connect(url: str, password: str | None, timeout: float):
    """The client for `url` (llmserve's form, the password not yet applied): `redis.Redis` for one server, a
    `LazyCluster` for a cluster; every call gives up after `timeout` seconds and none is retried (the breaker
    decides when to try again)."""
    import redis
    from redis.backoff import NoBackoff
    from redis.retry import Retry

    url = client_url(url)
    if not is_cluster(url):
        return redis.Redis.from_url(
            url,
            password=password,
            socket_timeout=timeout,
            socket_connect_timeout=timeout,
            retry=Retry(NoBackoff(), 0),
            health_check_interval=0,
            command_packer=command_packer(),
        )
    from redis.cluster import ClusterNode, RedisCluster
    from redis.connection import parse_url

    scheme, auth, _, tail = _split(url)
    options = parse_url(f"{scheme.removesuffix(CLUSTER)}://{auth}seed{tail}")  # user, password, TLS options
    for key in ("host", "port", "db"):
        options.pop(key, None)
    if password is not None:
        options["password"] = password
    options["connection_class"] = _uncopied(options.get("connection_class", redis.Connection))
    nodes = [ClusterNode(host, port) for host, port in cluster_nodes(url)]

    def make() -> RedisCluster:
        return RedisCluster(
            startup_nodes=nodes,
            retry=Retry(NoBackoff(), 0),
            socket_timeout=timeout,
            socket_connect_timeout=timeout,
            health_check_interval=0,
            **options,
        )

    return LazyCluster(make)


def command_packer():
    """redis-py's own RESP packer, which hands a large value (a block: hundreds of KB) to the socket as it is.
    With hiredis installed redis-py packs with hiredis instead, copying every value twice (to bytes, then into
    one command) while holding the GIL: a block's worth of memcpy the engine's thread waits for, per block
    written (py-spy: the writer's second largest cost after the send)."""
    from redis.connection import Encoder, PythonRespSerializer

    return PythonRespSerializer(6000, Encoder("utf-8", "strict", False).encode)


def _uncopied(connection_class):
    """`connection_class` (plain or TLS) packing with `command_packer()`: RedisCluster takes no packer, only a
    connection class, for the connections to its nodes."""

    class Uncopied(connection_class):
        def __init__(self, *args, **kwargs) -> None:
            kwargs.setdefault("command_packer", command_packer())
            super().__init__(*args, **kwargs)

    return Uncopied


class LazyCluster:
    """A `RedisCluster` made on first use: its constructor reads the slots map from a seed, and a cluster that
    cannot be reached yet must not stop the start. A failure to make it is a `redis.ConnectionError`."""

    def __init__(self, make) -> None:
        self._make = make
        self._client = None
        self._lock = threading.Lock()

    def _get(self):
        from redis.exceptions import ConnectionError as StoreDown
        from redis.exceptions import RedisClusterException

        with self._lock:
            if self._client is None:
                try:
                    self._client = self._make()
                except RedisClusterException as e:
                    raise StoreDown(f"no node of the cluster answers: {e}") from e
            return self._client

    def pipeline(self, transaction: bool = False):
        return self._get().pipeline(transaction=transaction)

    def delete(self, *keys):
        return self._get().delete(*keys)  # split by hash slot, one DEL per node

    def ping(self):
        """Every primary of the slots map answers (a cluster missing one serves none of its slots: not usable)."""
        client = self._get()
        return client.ping(target_nodes=client.PRIMARIES)

    def close(self) -> None:
        if self._client is not None:
            self._client.close()


def store_errors() -> tuple[type[BaseException], ...]:
    """What a call to the store raises when it fails (redis-py's cluster errors are not all RedisError)."""
    import redis
    from redis.exceptions import RedisClusterException

    return (redis.RedisError, RedisClusterException, OSError)


def unreachable(error: BaseException) -> bool:
    """A failure no immediate retry mends (refused, reset, a wrong password, no node of a cluster answers): it
    opens the breaker at once; timeouts count towards its threshold instead."""
    import redis
    from redis.exceptions import RedisClusterException

    if isinstance(error, redis.TimeoutError):
        return False
    return isinstance(error, (redis.ConnectionError, RedisClusterException, OSError))


def refusal(error: BaseException) -> bool:
    """An answer refusing a command (a full store's OOM), not a failure to reach the store or a cluster down."""
    from redis.exceptions import ClusterError, ResponseError

    return isinstance(error, ResponseError) and not isinstance(error, ClusterError)
