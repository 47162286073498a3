"""Servers for tests (and benchmarks), on loopback, always stopped at the end.

- `ServerProcess`: a child process: `llmserve serve` by default, or `llmserve route` / `launch` /
  the fake OpenAI server (`cmd=ROUTE`, `LAUNCH`, `FAKE`), polled until `/ready` answers 200.
- `ServerThread`: an ASGI app (the fake, a Router) served by uvicorn in a thread of the test
  process, so that the test can look inside it; `fake_backends` and `router_thread` build on it.
- `free_port`, `free_ports`, `wait_until`.
"""

from __future__ import annotations

import os
import random
import signal
import socket
import ssl
import subprocess
import sys
import threading
import time
from contextlib import contextmanager

import httpx

from llmserve.bench.scrape import parse_prometheus

# the checkout's root (llmserve/testing/launcher.py -> ../../..): servers start there, logs go to
# its test-artifacts/
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

SERVE = ("-m", "llmserve.cli", "serve")
ROUTE = ("-m", "llmserve.cli", "route")
LAUNCH = ("-m", "llmserve.cli", "launch")
FAKE = ("-m", "llmserve.testing.fake_openai")


def _die_with_parent() -> None:
    """In the child, before exec (Linux): SIGTERM when the process that started it dies, even by SIGKILL, so
    that a killed test run leaves no server behind (its own session keeps it out of the run's process group).
    The signal follows the starting thread: servers are started from the test's main thread."""
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM, 0, 0, 0)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):  # not Linux: the context manager still stops it
        pass


def free_port(*hosts: str) -> int:
    """A TCP port free on every one of `hosts` (default 127.0.0.1); from the range LLMSERVE_TEST_PORTS=LOW-HIGH
    where that is set (a machine shared by several runs, each given its own range)."""
    hosts = hosts or ("127.0.0.1",)
    span = os.environ.get("LLMSERVE_TEST_PORTS")
    for _ in range(200):
        try:
            want = random.randint(*map(int, span.split("-"))) if span else 0
            if want in _HANDED_OUT:  # free now, but given to a server that has not bound it yet
                continue
            with socket.socket() as s:
                s.bind((hosts[0], want))
                port = s.getsockname()[1]
            for h in hosts[1:]:
                with socket.socket() as s:
                    s.bind((h, port))
            if span:
                low, high = map(int, span.split("-"))
                if len(_HANDED_OUT) > (high - low) // 2:  # most given out: the earliest servers are long gone
                    _HANDED_OUT.clear()
                _HANDED_OUT.add(port)
            return port
        except OSError:
            continue
    raise RuntimeError(f"no port free on all of {hosts}")


_HANDED_OUT: set[int] = set()  # ports of LLMSERVE_TEST_PORTS given out by this process (never twice)


def free_ports(n: int, host: str = "127.0.0.1") -> int:
    """The first of `n` consecutive TCP ports free on `host`, below the kernel's ephemeral range.

    For a server that numbers its children from a base port (`llmserve launch`): a port taken
    from the ephemeral range can be held, a moment later, by any client socket's source port."""
    low, high = 20000, 32768
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            high = min(high, int(f.read().split()[0]))
    except (OSError, ValueError):
        pass
    for _ in range(200):
        base = random.randrange(low, high - n)
        try:
            for p in range(base, base + n):
                with socket.socket() as s:
                    s.bind((host, p))
            return base
        except OSError:
            continue
    raise RuntimeError(f"no {n} consecutive ports free on {host}")


def wait_until(predicate, timeout: float = 10.0, interval: float = 0.02) -> bool:
    """Poll `predicate` until it is true; False after `timeout` seconds."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if predicate():
            return True
        time.sleep(interval)
    return bool(predicate())


class ServerProcess:
    """`python <cmd> --port PORT <flags>` from the checkout's root, this checkout's llmserve first on
    PYTHONPATH, in its own process group; output appended to `log_path` (default
    test-artifacts/<command>-<port>.log). `stop()` / `kill()` / the context manager end it and
    whatever it started."""

    def __init__(
        self,
        *flags: str,
        cmd: tuple[str, ...] = SERVE,
        port: int | None = None,
        env: dict | None = None,
        log_path: str | None = None,
        ready_path: str = "/ready",
        verify: str | None = None,
    ) -> None:
        self.port = port or free_port()
        # a CA file: the server speaks https (its --ssl-* flags), verified against it
        self.verify = ssl.create_default_context(cafile=verify) if verify else True
        self.url = f"{'https' if verify else 'http'}://127.0.0.1:{self.port}"
        self.ready_path = ready_path
        name = cmd[-1].rsplit(".", 1)[-1]
        self.log_path = log_path or os.path.join(ROOT, "test-artifacts", f"{name}-{self.port}.log")
        os.makedirs(os.path.dirname(self.log_path), exist_ok=True)
        self._log = open(self.log_path, "ab")
        self._log_start = self._log.tell()
        full_env = {**os.environ, **(env or {})}
        full_env["PYTHONPATH"] = os.pathsep.join(p for p in (ROOT, full_env.get("PYTHONPATH")) if p)
        self.proc = subprocess.Popen(
            [sys.executable, *cmd, "--port", str(self.port), *flags],
            cwd=ROOT,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            env=full_env,
            start_new_session=True,
            preexec_fn=_die_with_parent if sys.platform.startswith("linux") else None,
        )

    def wait_ready(self, timeout: float = 180.0, headers: dict | None = None) -> ServerProcess:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(
                    f"{self.proc.args} exited with {self.proc.returncode}; {self.log_path}:\n" + self.log()[-3000:]
                )
            try:
                if (
                    httpx.get(self.url + self.ready_path, timeout=2, headers=headers, verify=self.verify).status_code
                    == 200
                ):
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        raise TimeoutError(
            f"{self.url}{self.ready_path} not ready in {timeout}s; {self.log_path}:\n" + self.log()[-3000:]
        )

    def metrics(self, headers: dict | None = None) -> dict[str, float]:
        """/metrics -> {'name{labels}': value} and bare names summed over labels."""
        r = httpx.get(self.url + "/metrics", timeout=5, headers=headers, verify=self.verify)
        return parse_prometheus(r.text, labelled=True)

    def log(self) -> str:
        """What this process has written to its log so far."""
        self._log.flush()
        with open(self.log_path, "rb") as f:
            f.seek(self._log_start)
            return f.read().decode("utf-8", errors="replace")

    def terminate(self, sig: int = signal.SIGTERM, timeout: float = 60.0) -> int:
        """Send `sig` to the process, wait up to `timeout` s, then SIGKILL its whole group."""
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                pass
        self._kill_group()
        self._log.close()
        return self.proc.returncode

    def stop(self) -> int:
        """SIGTERM, then SIGKILL after 10 s."""
        return self.terminate(signal.SIGTERM, timeout=10)

    def kill(self) -> int:
        return self.terminate(signal.SIGKILL)

    def _kill_group(self) -> None:
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        self.proc.wait()

    def __enter__(self) -> ServerProcess:
        return self

    def __exit__(self, *exc) -> None:
        self.kill()


class ServerThread:
    """Serves an ASGI app with uvicorn in a daemon thread of this process (lifespan included), on a
    socket bound before it starts (port 0: any free one)."""

    def __init__(self, app, host: str = "127.0.0.1", port: int = 0) -> None:
        import uvicorn

        self.sock = socket.socket()
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind((host, port))
        self.host, self.port = host, self.sock.getsockname()[1]
        self.server = uvicorn.Server(
            uvicorn.Config(app, log_level="warning", lifespan="on", timeout_graceful_shutdown=2)
        )
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True)

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def start(self, timeout: float = 20.0) -> ServerThread:
        self.thread.start()
        deadline = time.monotonic() + timeout
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError(f"server on {self.url} did not start")
            time.sleep(0.01)
        return self

    def stop(self) -> None:
        self.server.should_exit = True
        if self.thread.is_alive():
            self.thread.join(timeout=10)
        self.sock.close()

    def __enter__(self) -> ServerThread:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


@contextmanager
def fake_backends(*models: str, host: str = "127.0.0.1", port: int = 0, **config):
    """One fake OpenAI server per model name, each in its own thread; FakeConfig fields as keywords.
    Yields the ServerThreads; each has `.fake` (the FakeOpenAI: its `cfg` and counters)."""
    from llmserve.testing.fake_openai import FakeConfig, FakeOpenAI

    servers = []
    try:
        for m in models:
            fake = FakeOpenAI(FakeConfig(models=[m], **config))
            servers.append(ServerThread(fake.app, host=host, port=port).start())
            servers[-1].fake = fake
        yield servers
    finally:
        for s in servers:
            s.stop()


@contextmanager
def router_thread(dns_resolver=None, registry=None, **config):
    """A Router (RouterConfig fields as keywords) served in a thread; the yielded ServerThread has
    `.router` for inspection."""
    from llmserve.router.app import Router, RouterConfig, build_app

    router = Router(RouterConfig(**config), registry=registry, dns_resolver=dns_resolver)
    server = ServerThread(build_app(router))
    server.router = router
    with server:
        yield server
