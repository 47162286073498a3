"""`llmserve launch`: N replicas and a router started and stopped together.

Replicas are fake backends here (`--replica-command`), so the test needs no model; the command
line, process supervision and shutdown are the real ones."""

from __future__ import annotations

import os
import signal
import sys

import httpx
import pytest

from llmserve.testing.launcher import LAUNCH, ServerProcess, free_ports, wait_until

pytestmark = pytest.mark.timeout(120)


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie (exited, not yet reaped by its parent) is not alive either
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def test_launch_starts_routes_restarts_and_stops_the_fleet(tmp_path):
    port = free_ports(3)  # the router, then its two replicas, outside the ephemeral range
    base = port + 1
    replica = f"{sys.executable} -m llmserve.testing.fake_openai --host {{host}} --port {{port}} --model m"
    launcher = ServerProcess(
        "--replicas",
        "2",
        "--base-port",
        str(base),
        "--replica-command",
        replica,
        "--router-policy",
        "round_robin",
        "--router-health-interval",
        "0.3",
        cmd=LAUNCH,
        port=port,
        log_path=str(tmp_path / "launch.log"),
    )
    pids = []
    try:
        launcher.wait_ready(60)
        urls = {f"http://127.0.0.1:{base}", f"http://127.0.0.1:{base + 1}"}
        assert wait_until(lambda: httpx.get(launcher.url + "/ready").json()["healthy_backends"] == 2, timeout=30), (
            launcher.log()[-3000:]
        )
        seen = {
            httpx.post(
                launcher.url + "/v1/completions", json={"model": "m", "prompt": str(i), "max_tokens": 1}
            ).headers["x-llmserve-backend"]
            for i in range(4)
        }
        assert seen == urls
        pids = [httpx.get(u + "/_stats").json()["pid"] for u in sorted(urls)]

        # a replica dies: the launcher restarts it and the router re-admits it
        os.kill(pids[0], signal.SIGKILL)
        first = sorted(urls)[0]

        def restarted():
            try:
                return httpx.get(first + "/_stats", timeout=1).json()["pid"] != pids[0]
            except httpx.HTTPError:
                return False

        assert wait_until(restarted, timeout=30)
        pids.append(httpx.get(first + "/_stats").json()["pid"])
        assert wait_until(lambda: httpx.get(launcher.url + "/ready").json()["healthy_backends"] == 2, timeout=30), (
            launcher.log()[-3000:]
        )

        # SIGTERM to the launcher stops the router and every replica
        launcher.proc.send_signal(signal.SIGTERM)
        assert launcher.proc.wait(timeout=30) == 0
        assert wait_until(lambda: not any(alive(p) for p in pids[1:]), timeout=20)
        for u in urls:
            with pytest.raises(httpx.ConnectError):
                httpx.get(u + "/health", timeout=2)
    finally:
        launcher.stop()
        for p in pids:
            try:
                os.kill(p, signal.SIGKILL)
            except ProcessLookupError:
                pass
