"""The router proxy over fake backends: real HTTP on 127.0.0.1, servers in threads, no model.

Each test starts its own fake backends and router and stops them on exit (context managers)."""

from __future__ import annotations

import asyncio
import concurrent.futures as cf
import json

import httpx
import openai
import pytest

from llmserve.bench.scrape import metric_sum
from llmserve.bench.sse import iter_sse
from llmserve.testing.launcher import ServerThread, fake_backends, free_port, router_thread, wait_until

pytestmark = pytest.mark.timeout(60)

CHAT = [{"role": "user", "content": "Say hi"}]


def test_openai_client_stream_and_non_stream_pass_through_intact():
    with fake_backends("m", itl=0.001) as (a,), router_thread(backends=[a.url], health_interval=0.2) as r:
        direct = openai.OpenAI(base_url=a.url + "/v1", api_key="x")
        routed = openai.OpenAI(base_url=r.url + "/v1", api_key="x")
        want = direct.chat.completions.create(model="m", messages=CHAT, max_tokens=7)
        got = routed.chat.completions.create(model="m", messages=CHAT, max_tokens=7)
        assert got.choices[0].message.content == want.choices[0].message.content
        assert got.usage.completion_tokens == 7
        stream = routed.chat.completions.create(model="m", messages=CHAT, max_tokens=7, stream=True)
        chunks = list(stream)
        assert "".join(c.choices[0].delta.content or "" for c in chunks) == want.choices[0].message.content
        assert chunks[-1].choices[0].finish_reason == "length"
        comp = routed.completions.create(model="m", prompt="Once", max_tokens=4, stream=True)
        assert "".join(c.choices[0].text for c in comp) == "tok0 tok1 tok2 tok3"


def test_stream_is_not_buffered():
    """The first token reaches the client long before the backend finishes."""
    with fake_backends("m", itl=0.1) as (a,), router_thread(backends=[a.url]) as r:
        with httpx.stream(
            "POST",
            r.url + "/v1/chat/completions",
            timeout=10,
            json={"model": "m", "messages": CHAT, "max_tokens": 20, "stream": True},
        ) as s:
            events = iter_sse(s.iter_bytes())
            first = next(events)
            assert a.fake.running == 1 and a.fake.completed == 0  # still generating
            rest = list(events)
        assert first.json()["choices"] and rest[-1].done
        assert a.fake.completed == 1


def test_models_union_routing_by_name_and_unknown_model_404():
    with fake_backends("alpha", "beta") as (a, b), router_thread(backends=[a.url, b.url], policy="round_robin") as r:
        client = openai.OpenAI(base_url=r.url + "/v1", api_key="x")
        assert sorted(m.id for m in client.models.list()) == ["alpha", "beta"]
        for _ in range(3):
            rsp = client.chat.completions.with_raw_response.create(model="beta", messages=CHAT, max_tokens=2)
            assert rsp.headers["x-llmserve-backend"] == b.url
            assert rsp.parse().model == "beta"
        with pytest.raises(openai.NotFoundError) as e:
            client.chat.completions.create(model="gamma", messages=CHAT)
        assert e.value.status_code == 404
        assert e.value.body["code"] == "model_not_found" and e.value.body["type"]
        raw = httpx.post(r.url + "/v1/completions", json={"model": "gamma", "prompt": "x"})
        assert set(raw.json()["error"]) == {"message", "type", "param", "code"}
        assert b.fake.requests == 3 and a.fake.requests == 0


def test_503_and_429_before_first_byte_are_retried_elsewhere():
    with (
        fake_backends("m", "m") as (a, b),
        router_thread(backends=[a.url, b.url], policy="round_robin", max_retries=1) as r,
    ):
        a.fake.fail_next.extend([503, 429])
        b.fake.fail_next.extend([])
        for _ in range(4):
            rsp = httpx.post(r.url + "/v1/completions", json={"model": "m", "prompt": "p", "max_tokens": 2})
            assert rsp.status_code == 200
        m = httpx.get(r.url + "/metrics").text
        assert metric_sum(m, "llmserve_router:retries_total", backend=a.url) == 2
        # every backend says 429: the last answer is passed through, not a router error
        a.fake.fail_next.extend([429])
        b.fake.fail_next.extend([429])
        rsp = httpx.post(r.url + "/v1/completions", json={"model": "m", "prompt": "p"})
        assert rsp.status_code == 429 and rsp.json()["error"]["message"] == "injected 429"


def test_refused_connection_is_retried_and_the_backend_ejected_passively():
    with (
        fake_backends("m", "m") as (a, b),
        router_thread(backends=[a.url, b.url], policy="round_robin", health_interval=3600) as r,
    ):
        # the first active check done before a goes away (else it, not a request, may eject a: a race under load)
        assert wait_until(lambda: len(r.router.healthy_backends()) == 2)
        a.stop()  # a now refuses connections
        for _ in range(4):
            rsp = httpx.post(r.url + "/v1/completions", json={"model": "m", "prompt": "p"})
            assert rsp.status_code == 200 and rsp.headers["x-llmserve-backend"] == b.url
        backends = {x["url"]: x for x in httpx.get(r.url + "/router/backends").json()["backends"]}
        assert backends[a.url]["healthy"] is False
        m = httpx.get(r.url + "/metrics").text
        assert metric_sum(m, "llmserve_router:ejections_total", backend=a.url, reason="passive") == 1
        assert metric_sum(m, "llmserve_router:retries_total", backend=a.url) == 1


def test_active_health_checks_eject_and_readmit():
    with (
        fake_backends("m", "m") as (a, b),
        router_thread(backends=[a.url, b.url], health_interval=0.1, unhealthy_threshold=2) as r,
    ):
        router = r.router
        ba = router.registry.get(a.url)
        assert wait_until(lambda: len(router.healthy_backends()) == 2)
        a.fake.cfg.ready = False
        assert wait_until(lambda: not ba.healthy, timeout=5)
        assert httpx.get(r.url + "/ready").status_code == 200  # b is still there
        b.fake.cfg.ready = False
        assert wait_until(lambda: httpx.get(r.url + "/ready").status_code == 503, timeout=5)
        rsp = httpx.post(r.url + "/v1/completions", json={"model": "m", "prompt": "p"})
        assert rsp.status_code == 503 and rsp.json()["error"]["code"] == "no_healthy_backend"
        a.fake.cfg.ready = True
        assert wait_until(lambda: ba.healthy, timeout=5)
        assert httpx.get(r.url + "/ready").json()["healthy_backends"] == 1
        m = httpx.get(r.url + "/metrics").text
        assert metric_sum(m, "llmserve_router:ejections_total", backend=a.url, reason="active") == 1
        assert metric_sum(m, "llmserve_router:readmissions_total", backend=a.url) == 1


@pytest.mark.parametrize("stream", [True, False])
def test_client_disconnect_aborts_the_backend_request(stream):
    with fake_backends("m", itl=0.05) as (a,), router_thread(backends=[a.url]) as r:
        body = {"model": "m", "messages": CHAT, "max_tokens": 200, "stream": stream}
        if stream:
            with httpx.stream("POST", r.url + "/v1/chat/completions", json=body) as s:
                events = iter_sse(s.iter_bytes())
                next(events), next(events)  # two chunks, then hang up
        else:
            with pytest.raises(httpx.ReadTimeout):
                httpx.post(r.url + "/v1/chat/completions", json=body, timeout=0.5)
        assert wait_until(lambda: a.fake.aborted == 1, timeout=10)
        assert a.fake.completed == 0
        backend_metrics = httpx.get(a.url + "/metrics").text
        assert metric_sum(backend_metrics, "llmserve:request_success_total", finished_reason="abort") == 1
        assert wait_until(lambda: r.router.registry.get(a.url).outstanding == 0)
        m = httpx.get(r.url + "/metrics").text
        assert metric_sum(m, "llmserve_router:client_disconnects_total") == 1


def test_back_pressure_queues_then_answers_429_with_retry_after():
    with (
        fake_backends("m", ttft=1.0) as (a,),
        router_thread(backends=[a.url], max_outstanding=1, max_queued=1, queue_timeout=30) as r,
    ):

        def post():
            return httpx.post(
                r.url + "/v1/completions", timeout=30, json={"model": "m", "prompt": "p", "max_tokens": 1}
            )

        with cf.ThreadPoolExecutor(3) as pool:
            first = pool.submit(post)
            assert wait_until(lambda: a.fake.running == 1)
            second = pool.submit(post)
            assert wait_until(lambda: r.router.queued == 1)
            third = post()
            assert third.status_code == 429 and third.headers["retry-after"]
            assert third.json()["error"]["code"] == "router_queue_full"
            assert first.result().status_code == 200
            assert second.result().status_code == 200  # waited at the router, then ran
        assert a.fake.completed == 2
        m = httpx.get(r.url + "/metrics").text
        assert metric_sum(m, "llmserve_router:rejected_requests_total", reason="queue_full") == 1


def test_request_timeout_header_gives_504_and_aborts_the_backend():
    with fake_backends("m", ttft=5.0) as (a,), router_thread(backends=[a.url]) as r:
        rsp = httpx.post(
            r.url + "/v1/completions",
            headers={"X-Request-Timeout": "0.3"},
            json={"model": "m", "prompt": "p"},
            timeout=10,
        )
        assert rsp.status_code == 504 and rsp.json()["error"]["type"] == "timeout_error"
        assert wait_until(lambda: a.fake.aborted == 1, timeout=5)


def test_timeout_grows_with_prompt_and_max_tokens():
    from starlette.datastructures import Headers

    from llmserve.router.app import Router, RouterConfig
    from llmserve.router.policies import RouteRequest

    r = Router(RouterConfig(timeout_base=10, timeout_per_prompt_token=0.01, timeout_per_output_token=0.1))
    h = Headers({})
    assert r.request_timeout(RouteRequest(prompt_tokens=1000, max_tokens=100), h) == 30
    assert r.request_timeout(RouteRequest(prompt_tokens=1000, max_tokens=2000), h) == 220
    assert r.request_timeout(RouteRequest(), Headers({"x-request-timeout": "5"})) == 5
    r.config.request_timeout = 42
    assert r.request_timeout(RouteRequest(max_tokens=10_000), h) == 42


def test_router_api_key_and_backend_key():
    with (
        fake_backends("m") as (a,),
        router_thread(backends=[a.url], api_key="router-key", backend_api_key="backend-key") as r,
    ):
        a.fake.cfg.api_key = "backend-key"
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=r.url + "/v1", api_key="wrong").models.list()
        client = openai.OpenAI(base_url=r.url + "/v1", api_key="router-key")
        assert [m.id for m in client.models.list()] == ["m"]
        out = client.completions.create(model="m", prompt="p", max_tokens=2)
        assert out.choices[0].text == "tok0 tok1"
        assert a.fake.headers[-1]["authorization"] == "Bearer backend-key"
        assert httpx.get(r.url + "/health").status_code == 200  # probes need no key


def test_client_key_not_forwarded_by_default():
    with fake_backends("m") as (a,), router_thread(backends=[a.url]) as r:
        client = openai.OpenAI(base_url=r.url + "/v1", api_key="client-secret")
        assert client.completions.create(model="m", prompt="p", max_tokens=1).choices[0].text
        assert "authorization" not in a.fake.headers[-1]


def test_api_key_passthrough_when_configured():
    with fake_backends("m") as (a,), router_thread(backends=[a.url], forward_client_key=True) as r:
        a.fake.cfg.api_key = "k"
        client = openai.OpenAI(base_url=r.url + "/v1", api_key="k")
        assert client.completions.create(model="m", prompt="p", max_tokens=1).choices[0].text
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=r.url + "/v1", api_key="bad").completions.create(model="m", prompt="p", max_tokens=1)


def test_cache_aware_keeps_tenants_on_one_backend_and_raises_hit_rate():
    systems = [
        f"System prompt {i}: " + ("you are a careful assistant number %d. " % i) * 30 for i in range(3)
    ]  # odd: round robin spreads each over both
    results = {}
    for policy in ("round_robin", "cache_aware"):
        with (
            fake_backends("m", "m", cache_blocks=200) as (a, b),
            router_thread(backends=[a.url, b.url], policy=policy) as r,
        ):
            client = openai.OpenAI(base_url=r.url + "/v1", api_key="x")
            for u in range(6):
                for s in systems:
                    client.chat.completions.create(
                        model="m",
                        max_tokens=1,
                        messages=[{"role": "system", "content": s}, {"role": "user", "content": f"user {u} question"}],
                    )
            q = a.fake.queries + b.fake.queries
            results[policy] = (a.fake.hits + b.fake.hits) / q
            if policy == "cache_aware":
                for s in systems:  # each system prompt lives on one backend only
                    assert sum(any(p.startswith("<system>" + s) for p in x.fake.prompts) for x in (a, b)) == 1
                m = httpx.get(r.url + "/metrics").text
                assert metric_sum(m, "llmserve_router:routing_decisions_total", reason="cache_hit") == 15
    assert results["cache_aware"] > results["round_robin"]


def test_session_header_sticks_to_a_backend():
    with fake_backends("m", "m", "m") as fakes, router_thread(backends=[f.url for f in fakes], policy="session") as r:
        for user in ("alice", "bob", "carol", "dave"):
            seen = {
                httpx.post(
                    r.url + "/v1/completions",
                    headers={"X-Session-Id": user},
                    json={"model": "m", "prompt": "p", "max_tokens": 1},
                ).headers["x-llmserve-backend"]
                for _ in range(4)
            }
            assert len(seen) == 1
            seen = {
                httpx.post(
                    r.url + "/v1/completions", json={"model": "m", "prompt": "p", "max_tokens": 1, "user": user}
                ).headers["x-llmserve-backend"]
                for _ in range(3)
            }
            assert len(seen) == 1


def test_length_policy_from_yaml(tmp_path):
    import argparse

    from llmserve.router.cli import add_arguments, build_router

    with fake_backends("m", "m") as (short, long_):
        cfg = tmp_path / "fleet.yaml"
        cfg.write_text(f"""
policy: length
backends:
  - url: {short.url}
    prompt_tokens: [0, 100]
  - url: {long_.url}
    min_prompt_tokens: 101
    weight: 2
""")
        p = argparse.ArgumentParser()
        add_arguments(p)
        router = build_router(p.parse_args(["--config", str(cfg)]))
        assert router.policy.name == "length"
        from llmserve.router.app import build_app

        with ServerThread(build_app(router)) as r:
            for text, who in (("short " * 10, short), ("long " * 200, long_), ("x", short)):
                rsp = httpx.post(r.url + "/v1/completions", json={"model": "m", "prompt": text, "max_tokens": 1})
                assert rsp.headers["x-llmserve-backend"] == who.url
            m = httpx.get(r.url + "/metrics").text
            assert metric_sum(m, "llmserve_router:routing_decisions_total", reason="length") == 3


def test_scraped_backend_load_is_visible_and_used():
    with (
        fake_backends("m", "m", itl=0.05) as (a, b),
        router_thread(
            backends=[a.url, b.url], policy="least_outstanding", scrape_metrics=True, health_interval=0.1
        ) as r,
    ):
        # someone else keeps `a` busy, directly, behind the router's back
        with cf.ThreadPoolExecutor(3) as pool:
            busy = [
                pool.submit(
                    httpx.post,
                    a.url + "/v1/completions",
                    timeout=30,
                    json={"model": "m", "prompt": "p", "max_tokens": 40},
                )
                for _ in range(3)
            ]
            ba = r.router.registry.get(a.url)
            assert wait_until(lambda: (ba.running or 0) >= 3, timeout=5)
            rsp = [
                httpx.post(r.url + "/v1/completions", json={"model": "m", "prompt": "p", "max_tokens": 1})
                for _ in range(3)
            ]
            assert {x.headers["x-llmserve-backend"] for x in rsp} == {b.url}
            for f in busy:
                f.result()
        m = httpx.get(r.url + "/metrics").text
        assert "llmserve_router:backend_scraped_load" in m


def test_router_not_ready_without_backends_and_bad_json():
    port = free_port()
    with router_thread(backends=[f"http://127.0.0.1:{port}"], health_interval=0.1) as r:
        assert httpx.get(r.url + "/health").status_code == 200
        assert httpx.get(r.url + "/ready").status_code == 503
        rsp = httpx.post(r.url + "/v1/completions", content=b"{not json")
        assert rsp.status_code == 400 and rsp.json()["error"]["code"] == "invalid_json"
        rsp = httpx.post(r.url + "/v1/completions", json={"model": "m", "prompt": "p"})
        assert rsp.status_code == 503
        assert json.loads(rsp.content)["error"]["type"] == "service_unavailable_error"


def test_a_queued_request_cancelled_as_a_slot_frees_stays_cancelled():
    """The client leaves (its task is cancelled) in the same loop turn a slot frees: the request
    must not be routed (Python 3.11's asyncio.wait_for returned the wake-up and dropped the cancel)."""
    from llmserve.router.app import Router, RouterConfig
    from llmserve.router.policies import RouteRequest

    async def main():
        r = Router(RouterConfig(backends=["http://127.0.0.1:9"], max_outstanding=1))
        b = next(iter(r.registry))
        b.healthy = True
        loop = asyncio.get_running_loop()
        held = await r.acquire(RouteRequest(), set(), loop.time() + 30)
        waiting = asyncio.create_task(r.acquire(RouteRequest(), set(), loop.time() + 30))
        await asyncio.sleep(0.01)
        assert r.queued == 1 and not waiting.done()
        r.release(held)  # wakes the waiter ...
        waiting.cancel()  # ... and its client goes away in the same turn
        with pytest.raises(asyncio.CancelledError):
            await waiting
        assert b.outstanding == 0 and r.queued == 0

    asyncio.run(main())


def test_a_model_goes_to_the_backends_that_have_it_loaded():
    """Backends started with --models-dir list models not loaded (`status`): a request goes to one that has its
    model loaded when there is one, to any that lists it otherwise; a model failed there is not routed to it."""
    from llmserve.router.app import Router, RouterConfig

    r = Router(RouterConfig(backends=["http://127.0.0.1:9", "http://127.0.0.1:10", "http://127.0.0.1:11"]))
    a, b, c = list(r.registry)
    for be, status in ((a, "not loaded"), (b, "loaded"), (c, "not loaded")):
        be.healthy = True
        be.models = {"m"}
        be.model_cards = {"m": {"id": "m", "status": {"value": status}}}
    assert r.candidates("m") == [b]
    assert r.candidates("m", {id(b)}) == [a, c]  # tried already: the others load it
    b.model_cards["m"]["status"]["value"] = "not loaded"
    assert r.candidates("m") == [a, b, c]
    c.model_cards = {}  # a backend without states (no --models-dir): its models are loaded
    assert r.candidates("m") == [c]
