"""The router in front of real `llmserve serve` replicas (the bundled SmolLM2-135M, 1 thread each).

Three replicas on loopback: two serve "smol" (the pair for failover), one serves "smol-b" (so
/v1/models merges two names). The router is the `llmserve route` command. Everything is started
once for the module and always killed at the end."""

from __future__ import annotations

import concurrent.futures as cf
import time

import httpx
import openai
import pytest

from llmserve.bench.scrape import parse_prometheus
from llmserve.bench.sse import iter_sse
from llmserve.testing.launcher import ROUTE, ServerProcess, free_port, wait_until

pytestmark = pytest.mark.timeout(300)

HEALTH_INTERVAL = 0.5
SERVE_FLAGS = [
    "--num-threads",
    "1",
    "--max-model-len",
    "1024",
    "--num-kv-blocks",
    "256",
    "--max-num-seqs",
    "16",
    "--log-level",
    "warning",
]


def replica(port: int, name: str, log_dir) -> ServerProcess:
    return ServerProcess(
        "--served-model-name", name, *SERVE_FLAGS, port=port, log_path=str(log_dir / f"serve-{name}-{port}.log")
    )


def metrics(url: str) -> dict[str, float]:
    """{name: value summed over labels, 'name{labels}': value}."""
    return parse_prometheus(httpx.get(url + "/metrics", timeout=5).text, labelled=True)


@pytest.fixture(scope="module")
def fleet(tmp_path_factory):
    log_dir = tmp_path_factory.mktemp("router-e2e")
    ports = {"a1": free_port(), "a2": free_port(), "b": free_port()}
    procs: dict[str, ServerProcess] = {}
    try:
        procs["a1"] = replica(ports["a1"], "smol", log_dir)
        procs["a2"] = replica(ports["a2"], "smol", log_dir)
        procs["b"] = replica(ports["b"], "smol-b", log_dir)
        for p in procs.values():
            p.wait_ready(180)
        rport = free_port()
        procs["router"] = ServerProcess(
            *[x for p in ("a1", "a2", "b") for x in ("--backend", procs[p].url)],
            "--policy",
            "least_outstanding",
            "--max-retries",
            "2",
            "--health-interval",
            str(HEALTH_INTERVAL),
            "--unhealthy-threshold",
            "2",
            "--log-level",
            "warning",
            cmd=ROUTE,
            port=rport,
            log_path=str(log_dir / "router.log"),
        ).wait_ready(30)
        assert wait_until(lambda: httpx.get(procs["router"].url + "/ready").json()["healthy_backends"] == 3, timeout=30)
        procs["_log_dir"] = log_dir
        yield procs
    finally:
        for p in procs.values():
            if isinstance(p, ServerProcess):
                p.stop()


def client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0, timeout=120)


def test_streamed_and_plain_answers_pass_through_intact(fleet):
    msgs = [{"role": "user", "content": "Name three colours."}]
    direct = client(fleet["a1"].url).chat.completions.create(model="smol", messages=msgs, max_tokens=12, temperature=0)
    routed = client(fleet["router"].url)
    plain = routed.chat.completions.create(model="smol", messages=msgs, max_tokens=12, temperature=0)
    assert plain.choices[0].message.content == direct.choices[0].message.content
    assert plain.usage.completion_tokens == direct.usage.completion_tokens
    chunks = list(
        routed.chat.completions.create(model="smol", messages=msgs, max_tokens=12, temperature=0, stream=True)
    )
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == direct.choices[0].message.content
    comp = routed.completions.create(
        model="smol", prompt="The capital of France is", max_tokens=6, temperature=0, stream=True
    )
    want = client(fleet["a2"].url).completions.create(
        model="smol", prompt="The capital of France is", max_tokens=6, temperature=0
    )
    assert "".join(c.choices[0].text for c in comp if c.choices) == want.choices[0].text


def test_models_are_merged_and_requests_routed_by_name(fleet):
    routed = client(fleet["router"].url)
    assert sorted(m.id for m in routed.models.list()) == ["smol", "smol-b"]
    for _ in range(3):
        rsp = routed.completions.with_raw_response.create(model="smol-b", prompt="Hi", max_tokens=2, temperature=0)
        assert rsp.headers["x-llmserve-backend"] == fleet["b"].url
        assert rsp.parse().model == "smol-b"
    rsp = routed.completions.with_raw_response.create(model="smol", prompt="Hi", max_tokens=2)
    assert rsp.headers["x-llmserve-backend"] in (fleet["a1"].url, fleet["a2"].url)
    with pytest.raises(openai.NotFoundError) as e:
        routed.completions.create(model="smol-c", prompt="Hi", max_tokens=2)
    assert e.value.body["code"] == "model_not_found"


def test_client_disconnect_at_the_router_aborts_the_backend_request(fleet):
    b = fleet["b"].url
    before = metrics(b)
    with httpx.stream(
        "POST",
        fleet["router"].url + "/v1/completions",
        timeout=60,
        json={
            "model": "smol-b",
            "prompt": "Write a very long story about a dragon.",
            "max_tokens": 600,
            "temperature": 0,
            "ignore_eos": True,
            "stream": True,
        },
    ) as s:
        events = iter_sse(s.iter_bytes())
        for got, _ in enumerate(events, 1):
            if got == 3:
                break  # hang up mid-stream
    # the backend stops generating: nothing running, the request never finished normally,
    # far fewer than 600 tokens generated (600 tokens on 1 thread would take many seconds)
    assert wait_until(lambda: metrics(b).get("llmserve:num_requests_running", 0) == 0, timeout=15)
    after = metrics(b)
    success = "llmserve:request_success_total"
    finished_normally = sum(v for k, v in after.items() if k.startswith(success + "{") and "abort" not in k) - sum(
        v for k, v in before.items() if k.startswith(success + "{") and "abort" not in k
    )
    assert finished_normally == 0
    # the backend counts it as aborted, as vLLM does (recorded just after the blocks are freed)
    aborted = lambda m: sum(v for k, v in m.items() if k.startswith(success + "{") and "abort" in k)  # noqa: E731
    assert wait_until(lambda: aborted(metrics(b)) - aborted(before) == 1, timeout=5), metrics(b)
    generated = after.get("llmserve:generation_tokens_total", 0) - before.get("llmserve:generation_tokens_total", 0)
    assert generated < 600
    r = metrics(fleet["router"].url)
    assert r.get("llmserve_router:client_disconnects_total", 0) >= 1


def test_sigkill_a_replica_during_40_requests(fleet):
    router, a1 = fleet["router"].url, fleet["a1"]
    routed = client(router)
    results = []

    def one(i: int):
        stream = i % 2 == 0
        first_from = None
        msgs = [{"role": "user", "content": f"Count to {i % 7 + 3}."}]
        try:
            if stream:
                rsp = routed.chat.completions.with_raw_response.create(
                    model="smol", messages=msgs, max_tokens=16, temperature=0, stream=True
                )
                first_from = rsp.headers["x-llmserve-backend"]
                text = "".join(c.choices[0].delta.content or "" for c in rsp.parse() if c.choices)
            else:
                text = (
                    routed.chat.completions.create(model="smol", messages=msgs, max_tokens=16, temperature=0)
                    .choices[0]
                    .message.content
                )
            results.append((i, stream, first_from, bool(text), None))
        except openai.APIError as e:
            results.append((i, stream, first_from, False, e))

    def in_flight(url):
        bs = httpx.get(router + "/router/backends").json()["backends"]
        return next(b for b in bs if b["url"] == url)

    with cf.ThreadPoolExecutor(8) as pool:
        futures = [pool.submit(one, i) for i in range(40)]
        assert wait_until(lambda: in_flight(a1.url)["outstanding"] >= 2, timeout=60)
        a1.kill()  # SIGKILL
        t_kill = time.monotonic()
        assert wait_until(lambda: not in_flight(a1.url)["healthy"], timeout=HEALTH_INTERVAL * 2 + 1)
        ejected_after = time.monotonic() - t_kill
        for f in futures:
            f.result(timeout=240)

    assert len(results) == 40
    for i, stream, first_from, ok, err in results:
        if not ok:  # only streams already under way on the killed replica may fail
            assert stream and first_from == a1.url, (i, stream, first_from, err)
    assert all(ok for _, stream, _, ok, _ in results if not stream)
    assert ejected_after <= HEALTH_INTERVAL * 2 + 1
    # No retry count is asserted: when the requests on the killed replica were all streams past their
    # first byte and it was ejected before another was routed there, nothing needed a retry (that case
    # failed CI once). Retries before the first byte are asserted in tests/unit/test_router_proxy.py.

    # restarted on the same port: re-admitted within a few health intervals of being ready
    fleet["a1"] = replica(int(a1.url.rsplit(":", 1)[1]), "smol", fleet["_log_dir"]).wait_ready(180)
    assert wait_until(lambda: in_flight(a1.url)["healthy"], timeout=HEALTH_INTERVAL * 4 + 2)
    m = metrics(router)
    assert m.get(f'llmserve_router:readmissions_total{{backend="{a1.url}"}}') == 1
    seen = {
        routed.completions.with_raw_response.create(model="smol", prompt=f"Hello {i}", max_tokens=2).headers[
            "x-llmserve-backend"
        ]
        for i in range(6)
    }
    assert a1.url in seen
