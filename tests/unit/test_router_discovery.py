"""Backend discovery: registry sync, YAML, and DNS with an injected resolver.

The DNS test serves fake backends on 127.0.0.2 and 127.0.0.3 (both loopback on Linux) on the same
port, and a test resolver answers for a made-up name with whichever addresses the test chooses,
as a Kubernetes headless Service would with one A record per ready pod."""

from __future__ import annotations

import asyncio
import concurrent.futures as cf
import contextlib
import socket

import httpx
import pytest

from llmserve.bench.sse import iter_sse
from llmserve.router.discovery import DnsDiscovery, DnsSource, Registry, load_config, normalize_url
from llmserve.router.policies import Backend
from llmserve.testing.launcher import fake_backends, free_port, router_thread, wait_until

pytestmark = pytest.mark.timeout(60)


def test_registry_sync_adds_and_removes_only_its_own_backends():
    reg = Registry()
    removed = []
    reg.on_removed(removed.append)
    reg.add(Backend(url="10.0.0.9:8000"))  # static, another source
    assert reg.sync("dns:x", ["http://10.0.0.1:8000", "http://10.0.0.2:8000"]) == (
        ["http://10.0.0.1:8000", "http://10.0.0.2:8000"],
        [],
    )
    kept = reg.get("http://10.0.0.1:8000")
    assert reg.sync("dns:x", ["http://10.0.0.1:8000", "http://10.0.0.3:8000"]) == (
        ["http://10.0.0.3:8000"],
        ["http://10.0.0.2:8000"],
    )
    assert reg.get("http://10.0.0.1:8000") is kept  # state survives a refresh
    assert sorted(b.url for b in reg) == ["http://10.0.0.1:8000", "http://10.0.0.3:8000", "http://10.0.0.9:8000"]
    assert [b.url for b in removed] == ["http://10.0.0.2:8000"]
    assert normalize_url("host:1/") == "http://host:1"


def test_dns_source_parse_and_failed_lookup_keeps_backends():
    assert DnsSource.parse("svc.ns.svc.cluster.local:8000") == DnsSource("svc.ns.svc.cluster.local", 8000)
    assert DnsSource.parse("https://svc:443").scheme == "https"
    with pytest.raises(ValueError):
        DnsSource.parse("no-port")
    reg = Registry()
    answers = [["10.1.0.1", "10.1.0.2"]]

    def resolver(name, port):
        if not answers:
            raise socket.gaierror("temporary failure")
        return answers.pop()

    d = DnsDiscovery(reg, DnsSource("svc", 9000), resolver=resolver)
    asyncio.run(d.refresh())
    assert sorted(b.url for b in reg) == ["http://10.1.0.1:9000", "http://10.1.0.2:9000"]
    asyncio.run(d.refresh())  # lookup fails: keep what we have
    assert len(reg) == 2


def test_yaml_config(tmp_path):
    f = tmp_path / "fleet.yaml"
    f.write_text("""
policy: session
backends:
  - url: 127.0.0.1:8001
    models: [a, b]
    weight: 2
    prompt_tokens: [0, 1024]
    max_outstanding: 8
  - http://127.0.0.1:8002
dns:
  - name: llm.default.svc.cluster.local
    port: 8000
  - other:9000
""")
    cfg = load_config(str(f))
    a, b = cfg.backends
    assert (a.url, a.models, a.models_declared, a.weight, a.max_prompt_tokens, a.max_outstanding) == (
        "http://127.0.0.1:8001",
        {"a", "b"},
        True,
        2.0,
        1024,
        8,
    )
    assert b.url == "http://127.0.0.1:8002" and not b.models_declared
    assert [(d.name, d.port) for d in cfg.dns] == [("llm.default.svc.cluster.local", 8000), ("other", 9000)]
    assert cfg.settings == {"policy": "session"}


def test_backend_dns_follows_the_name_and_spares_in_flight_requests():
    port = free_port("127.0.0.2", "127.0.0.3")
    answer = ["127.0.0.2"]  # what the name resolves to, set by the test
    with contextlib.ExitStack() as stack:
        fakes = {
            host: stack.enter_context(fake_backends("m", host=host, port=port, itl=0.02))[0]
            for host in ("127.0.0.2", "127.0.0.3")
        }

        async def resolver(name, p):
            assert (name, p) == ("llm-headless.test.svc", port)
            return list(answer)

        with router_thread(
            backend_dns=[f"llm-headless.test.svc:{port}"],
            dns_interval=0.2,
            dns_resolver=resolver,
            health_interval=0.2,
            policy="round_robin",
        ) as r:

            def backends():
                return {b["url"] for b in httpx.get(r.url + "/router/backends").json()["backends"] if b["healthy"]}

            def served_by(**kw):
                return httpx.post(
                    r.url + "/v1/completions", timeout=30, json={"model": "m", "prompt": "p", "max_tokens": 1, **kw}
                ).headers["x-llmserve-backend"]

            url2, url3 = f"http://127.0.0.2:{port}", f"http://127.0.0.3:{port}"
            assert backends() == {url2}
            assert {served_by() for _ in range(3)} == {url2}

            answer.append("127.0.0.3")  # a pod joins
            assert wait_until(lambda: backends() == {url2, url3}, timeout=5)
            assert {served_by() for _ in range(6)} == {url2, url3}

            # a long stream on .2, then .2 leaves the name: the stream finishes untouched
            with cf.ThreadPoolExecutor(1) as pool:

                def long_stream():
                    with httpx.stream(
                        "POST",
                        r.url + "/v1/completions",
                        timeout=30,
                        json={"model": "m", "prompt": "p", "max_tokens": 60, "stream": True},
                        headers={"X-Request-Timeout": "30"},
                    ) as s:
                        return s.headers["x-llmserve-backend"], list(iter_sse(s.iter_bytes()))

                futures = [pool.submit(long_stream)]
                assert wait_until(
                    lambda: fakes["127.0.0.2"].fake.running >= 1 or fakes["127.0.0.3"].fake.running >= 1, timeout=5
                )
                on = "127.0.0.2" if fakes["127.0.0.2"].fake.running else "127.0.0.3"
                answer.remove(on)  # its address leaves the name
                other = url3 if on == "127.0.0.2" else url2
                assert wait_until(lambda: backends() == {other}, timeout=5)
                assert {served_by() for _ in range(3)} == {other}
                who, events = futures[0].result()
            assert who.startswith(f"http://{on}:")
            assert events[-1].done and not any("error" in e.json() for e in events[:-1])
            assert fakes[on].fake.aborted == 0 and fakes[on].fake.completed >= 1
