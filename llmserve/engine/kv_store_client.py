"""Reaching the shared store of `--kv-cache-url` (its forms: llmserve/store_url.py): the redis-py client for it
(kv_remote.py calls it).

A cluster's client is redis-py's `RedisCluster`: its non-transactional pipeline splits one pipelined call into
one pipeline per node, sent to all of them before any answer is read. It is made on first use, so that a
cluster unreachable at start does not stop the server (the breaker opens and the writer's probe makes it later).
"""

from __future__ import annotations

import threading

from llmserve.store_url import CLUSTER, client_url, cluster_nodes, is_cluster, split_url


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

    scheme, auth, _, tail = split_url(url)
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
        """Every primary of the slots map answers (a cluster missing one serves none of its slots: not usable), and
        each says cluster_state:ok: a node that has just come back answers PING before the cluster serves its slots
        again (CLUSTERDOWN), and a breaker closed on PING alone would drop the next writes."""
        from redis.exceptions import ClusterDownError

        client = self._get()
        client.ping(target_nodes=client.PRIMARIES)
        infos = client.cluster_info(target_nodes=client.PRIMARIES)
        for info in infos.values() if all(isinstance(v, dict) for v in infos.values()) else [infos]:
            if info.get("cluster_state") != "ok":
                raise ClusterDownError(f"cluster_state:{info.get('cluster_state')}")
        return True

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
