"""Start and stop real `llmserve serve` processes on loopback for end-to-end tests."""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time

import httpx

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    def __init__(self, *flags: str, port: int | None = None, env: dict | None = None,
                 log_path: str | None = None) -> None:
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path or os.path.join(ROOT, "test-artifacts", f"server-{self.port}.log")
        os.makedirs(os.path.dirname(self.log_path), exist_ok=True)
        self._log = open(self.log_path, "wb")
        cmd = [sys.executable, "-m", "llmserve.cli", "serve", "--port", str(self.port), *flags]
        self.proc = subprocess.Popen(cmd, cwd=ROOT, stdout=self._log, stderr=subprocess.STDOUT,
                                     env={**os.environ, **(env or {})})

    def wait_ready(self, timeout: float = 180.0, headers: dict | None = None) -> None:
        deadline = time.time() + timeout
        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}; see {self.log_path}")
            try:
                if httpx.get(self.url + "/ready", timeout=2, headers=headers).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.3)
        raise TimeoutError(f"server not ready in {timeout}s; see {self.log_path}")

    def metrics(self, headers: dict | None = None) -> dict[str, float]:
        """Prometheus text -> {'name{labels}': value} (and bare names summed over labels)."""
        text = httpx.get(self.url + "/metrics", timeout=5, headers=headers).text
        out: dict[str, float] = {}
        for line in text.splitlines():
            if not line or line.startswith("#"):
                continue
            key, _, value = line.rpartition(" ")
            out[key] = float(value)
            bare = key.split("{")[0]
            if "{" in key:
                out[bare] = out.get(bare, 0.0) + float(value)
        return out

    def terminate(self, sig: int = signal.SIGTERM, timeout: float = 60.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()
        return self.proc.returncode

    def kill(self) -> None:
        self.terminate(signal.SIGKILL)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.kill()
