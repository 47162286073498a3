"""A Redis-protocol store for tests and benchmarks (`--kv-cache-url`): Debian's `redis-server` on a loopback
port, a throwaway data folder, nothing saved; started, stopped, killed and started again on the same port.
`RedisClusterStore`: a real Redis Cluster of such servers (`redis-cli --cluster create`), every port (the
clients' and the cluster bus's) taken from LLMSERVE_TEST_PORTS."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import tempfile

from llmserve.testing.launcher import _die_with_parent, free_port, wait_until

CLUSTER_SLOTS = 16384


def redis_binary() -> str | None:
    return shutil.which("redis-server")


class RedisServer:
    def __init__(
        self,
        *,
        port: int | None = None,
        password: str | None = None,
        maxmemory: str | None = None,
        policy: str = "allkeys-lru",
        log_path: str | None = None,
        tls: tuple[str, str] | None = None,
        cluster: bool = False,
    ) -> None:
        self.port = port or free_port()
        self.password = password
        self.maxmemory = maxmemory
        self.policy = policy
        self.dir = tempfile.mkdtemp(prefix="llmserve-redis-")
        self.log_path = log_path or os.path.join(self.dir, "redis.log")
        self.tls = tls  # (key file, certificate file, its own CA): TLS only, rediss://
        self.cluster = cluster  # a node of a Redis Cluster (cluster mode on, its bus on a port of its own)
        self.bus_port = free_port() if cluster else None
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        auth = f":{self.password}@" if self.password else ""
        if self.tls:
            return f"rediss://{auth}127.0.0.1:{self.port}/0?ssl_ca_certs={self.tls[1]}"
        return f"redis://{auth}127.0.0.1:{self.port}/0"

    def client(self):
        import redis

        tls = dict(ssl=True, ssl_ca_certs=self.tls[1]) if self.tls else {}
        return redis.Redis(host="127.0.0.1", port=self.port, password=self.password, socket_timeout=10, **tls)

    def start(self) -> RedisServer:
        args = [
            redis_binary() or "redis-server",
            "--port",
            str(self.port),
            "--bind",
            "127.0.0.1",
            "--save",
            "",
            "--appendonly",
            "no",
            "--dir",
            self.dir,
            "--logfile",
            self.log_path,
        ]
        if self.password:
            args += ["--requirepass", self.password]
        if self.tls:
            args[1:3] = ["--port", "0", "--tls-port", str(self.port), "--tls-key-file", self.tls[0]]
            args += ["--tls-cert-file", self.tls[1], "--tls-ca-cert-file", self.tls[1], "--tls-auth-clients", "no"]
        if self.cluster:
            args += ["--cluster-enabled", "yes", "--cluster-port", str(self.bus_port)]
            args += ["--cluster-config-file", os.path.join(self.dir, "nodes.conf"), "--cluster-node-timeout", "2000"]
        if self.maxmemory:
            args += ["--maxmemory", self.maxmemory, "--maxmemory-policy", self.policy]
        self.proc = subprocess.Popen(
            args,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            preexec_fn=_die_with_parent,
        )

        def up() -> bool:
            try:
                return bool(self.client().ping())
            except Exception:  # noqa: BLE001 - not listening yet
                return self.proc.poll() is not None

        if not wait_until(up, timeout=20, interval=0.05) or self.proc.poll() is not None:
            raise RuntimeError(f"redis-server did not start on {self.port}: {self.log_path}")
        return self

    def kill(self) -> None:
        """SIGKILL: the store vanishes at once (connections reset), as a crashed pod does."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGCONT)
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait()

    def pause(self, paused: bool = True) -> None:
        """SIGSTOP / SIGCONT: a store that accepts nothing and answers nothing (a hung host), then recovers."""
        self.proc.send_signal(signal.SIGSTOP if paused else signal.SIGCONT)

    def stop(self) -> None:
        self.kill()
        shutil.rmtree(self.dir, ignore_errors=True)

    def __enter__(self) -> RedisServer:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


class RedisClusterStore:
    """A Redis Cluster of `n` primaries (no replicas) on loopback: each a `RedisServer` in cluster mode, joined
    and given the 16,384 hash slots by `redis-cli --cluster create`; `url` is llmserve's cluster URL
    (`redis+cluster://` and every node as a seed)."""

    def __init__(self, n: int = 3, **kwargs) -> None:
        self.nodes = [RedisServer(cluster=True, **kwargs) for _ in range(n)]

    @property
    def url(self) -> str:
        seeds = ",".join(f"127.0.0.1:{node.port}" for node in self.nodes)
        return f"redis+cluster://{seeds}"

    def start(self) -> RedisClusterStore:
        for node in self.nodes:
            node.start()
        cli = shutil.which("redis-cli") or "redis-cli"
        addresses = [f"127.0.0.1:{node.port}" for node in self.nodes]
        create = [cli, "--cluster", "create", *addresses, "--cluster-replicas", "0", "--cluster-yes"]
        done = subprocess.run(create, capture_output=True, text=True, timeout=60)
        if done.returncode != 0:
            self.stop()
            raise RuntimeError(f"redis-cli --cluster create failed: {done.stdout}{done.stderr}")

        def ready() -> bool:
            for node in self.nodes:
                info = node.client().execute_command("CLUSTER", "INFO").decode()
                if "cluster_state:ok" not in info or f"cluster_slots_ok:{CLUSTER_SLOTS}" not in info:
                    return False
            return True

        if not wait_until(ready, timeout=30, interval=0.1):
            self.stop()
            raise RuntimeError("the redis cluster did not reach cluster_state:ok")
        return self

    def stop(self) -> None:
        for node in self.nodes:
            node.stop()

    def __enter__(self) -> RedisClusterStore:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
