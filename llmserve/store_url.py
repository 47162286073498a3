"""The URL of the shared KV store (`--kv-cache-url`): its forms, checked when the settings are read (config.py)
and taken apart when the engine connects (engine/kv_store_client.py). Pure string work, no client.

Two forms, the schemes redis-py and Redis' own tools use, `+cluster` for a cluster (as a driver is named in a
database URL's scheme):

    redis://[[USER]:PASSWORD@]HOST:PORT[/DB][?OPTIONS]                   one server (or a proxy, a Sentinel's
                                                                          stable address, a managed endpoint)
    redis+cluster://[[USER]:PASSWORD@]HOST:PORT[,HOST:PORT...][?OPTIONS] a Redis Cluster: any of its nodes, as
                                                                          seeds; the client asks one for the slots
                                                                          map and talks to every primary itself

`rediss` is TLS, `valkey` and `valkeys` the same protocol (`valkey+cluster://`, `rediss+cluster://`...). OPTIONS
are redis-py's URL options (`ssl_ca_certs=...`). A cluster has one database: `/0` or none.
"""

from __future__ import annotations

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


def split_url(url: str) -> tuple[str, str, str, str]:
    """(scheme, user info with its '@' or '', the hosts, the path and query) of a URL whose host part may list
    several HOST:PORT (urlsplit reads one port only)."""
    scheme, rest = url.split("://", 1)
    end = min((i for i in (rest.find("/"), rest.find("?")) if i >= 0), default=len(rest))
    netloc, tail = rest[:end], rest[end:]
    auth, at, hosts = netloc.rpartition("@")
    return scheme, auth + at, hosts, tail


def cluster_nodes(url: str) -> list[tuple[str, int]]:
    """The seed nodes of a cluster URL (a port missing is 6379); ValueError for a malformed one."""
    _, _, hosts, tail = split_url(url)
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
