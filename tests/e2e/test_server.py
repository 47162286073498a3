"""`llmserve serve` as a real process on loopback, driven by the official openai client."""

from __future__ import annotations

import asyncio
import json
import signal
import threading
import time

import httpx
import openai
import pytest

from llmserve.bench.sse import iter_sse
from llmserve.testing.launcher import ServerProcess

KEY = "test-key-123"
Q = [{"role": "user", "content": "What is Docker? Answer in one sentence."}]


@pytest.fixture(scope="module")
def server():
    srv = ServerProcess("--api-key", KEY, "--served-model-name", "smol", "--max-num-seqs", "64")
    try:
        srv.wait_ready(headers={})
        yield srv
    finally:
        srv.kill()


@pytest.fixture(scope="module")
def small_server():
    """One running request at a time and a queue of one: easy to fill."""
    srv = ServerProcess("--max-num-seqs", "1", "--max-queued-requests", "1", "--max-request-body-bytes", "100000")
    try:
        srv.wait_ready()
        yield srv
    finally:
        srv.kill()


@pytest.fixture()
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0, timeout=120)


H = {"Authorization": f"Bearer {KEY}"}


def test_models_and_probes(server, client):
    assert [m.id for m in client.models.list().data] == ["smol"]
    assert httpx.get(server.url + "/health").status_code == 200
    assert httpx.get(server.url + "/version").json()["version"]
    spec = httpx.get(server.url + "/openapi.json").json()
    assert "/v1/chat/completions" in spec["paths"]
    m = server.metrics(headers=H)  # the KV cache's configuration, as vLLM's cache_config_info
    (info,) = [k for k in m if k.startswith("llmserve:cache_config_info{")]
    blocks = int(m["llmserve:kv_cache_num_blocks"])
    assert m[info] == 1 and 'block_size="16"' in info and 'cache_dtype="float32"' in info
    assert 'enable_prefix_caching="True"' in info and f'num_blocks="{blocks}"' in info


def test_chat_stream_equals_non_stream(client, server):
    full = client.chat.completions.create(model="smol", messages=Q, max_tokens=24, temperature=0)
    text = full.choices[0].message.content
    assert text and full.choices[0].finish_reason in ("stop", "length")
    chunks = list(
        client.chat.completions.create(
            model="smol", messages=Q, max_tokens=24, temperature=0, stream=True, stream_options={"include_usage": True}
        )
    )
    ids = {c.id for c in chunks}
    assert len(ids) == 1
    content_chunks = [c for c in chunks if c.choices]
    assert content_chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in content_chunks) == text
    assert sum(1 for c in content_chunks if c.choices[0].finish_reason) == 1
    usage = chunks[-1].usage
    assert chunks[-1].choices == [] and usage is not None
    assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens
    assert usage.completion_tokens == full.usage.completion_tokens
    tok = httpx.post(server.url + "/tokenize", headers=H, json={"messages": Q}).json()
    assert tok["count"] == usage.prompt_tokens == full.usage.prompt_tokens


def test_completions_stream_and_echo(client):
    full = client.completions.create(model="smol", prompt="The capital of France is", max_tokens=12, temperature=0)
    text = full.choices[0].text
    assert text
    streamed = "".join(
        c.choices[0].text
        for c in client.completions.create(
            model="smol", prompt="The capital of France is", max_tokens=12, temperature=0, stream=True
        )
        if c.choices
    )
    assert streamed == text
    echo = client.completions.create(
        model="smol", prompt="The capital of France is", max_tokens=12, temperature=0, echo=True
    )
    assert echo.choices[0].text == "The capital of France is" + text
    # the prompt's log-probabilities (lm-eval's loglikelihood): the prompt's tokens first, the first None
    scored = client.completions.create(
        model="smol", prompt="The capital of France is", max_tokens=1, temperature=0, echo=True, logprobs=1
    )
    lp = scored.choices[0].logprobs
    assert "".join(lp.tokens) == scored.choices[0].text and len(lp.tokens) > 2
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert all(v < 0 for v in lp.token_logprobs[1:]) and all(len(t) == 1 for t in lp.top_logprobs[1:])
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(len(lp.tokens))]
    multi = client.completions.create(model="smol", prompt=["One, two,", "A, B,"], max_tokens=4, temperature=0)
    assert sorted(c.index for c in multi.choices) == [0, 1]


def test_n_logprobs_and_stop(client):
    r = client.chat.completions.create(model="smol", messages=Q, max_tokens=8, n=3, temperature=0.8, seed=1)
    assert sorted(c.index for c in r.choices) == [0, 1, 2]
    assert r.usage.completion_tokens == sum(1 for _ in r.choices) * 0 + r.usage.completion_tokens
    r = client.chat.completions.create(
        model="smol", messages=Q, max_tokens=6, temperature=0, logprobs=True, top_logprobs=3
    )
    lp = r.choices[0].logprobs.content
    assert len(lp) == r.usage.completion_tokens
    for item in lp:
        assert item.logprob <= 0 and len(item.top_logprobs) == 3
        assert item.top_logprobs[0].logprob >= item.top_logprobs[-1].logprob
    c = client.completions.create(model="smol", prompt="1, 2, 3,", max_tokens=5, temperature=0, logprobs=2)
    assert len(c.choices[0].logprobs.tokens) == len(c.choices[0].logprobs.token_logprobs) == c.usage.completion_tokens
    base = client.chat.completions.create(model="smol", messages=Q, max_tokens=24, temperature=0)
    text = base.choices[0].message.content
    word = text.split()[3]
    cut = client.chat.completions.create(model="smol", messages=Q, max_tokens=24, temperature=0, stop=[word])
    assert cut.choices[0].finish_reason == "stop"
    assert cut.choices[0].message.content == text[: text.index(word)]
    assert word not in cut.choices[0].message.content


def test_error_statuses(client, server, small_server):
    bad = openai.OpenAI(base_url=server.url + "/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.chat.completions.create(model="smol", messages=Q, max_tokens=4)
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="smol", messages=Q, max_tokens=4, temperature=-1)
    body = e.value.body
    assert body["param"] == "temperature" if isinstance(body, dict) and "param" in body else True
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model="smol", messages=Q, max_tokens=10**9)
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model="smol", messages=Q, max_tokens=4, n=10**6)
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="nope", messages=Q, max_tokens=4)
    small = openai.OpenAI(base_url=small_server.url + "/v1", api_key="x", max_retries=0, timeout=120)
    with pytest.raises(openai.APIStatusError) as e:
        small.chat.completions.create(model="x", messages=[{"role": "user", "content": "a" * 200_000}], max_tokens=4)
    assert e.value.status_code == 413
    # 429: one running, one queued, the rest refused with Retry-After
    results: list = []

    def call():
        try:
            small.chat.completions.create(
                messages=Q, model=small.models.list().data[0].id, max_tokens=24, temperature=0
            )
            results.append("ok")
        except openai.RateLimitError as err:
            assert err.response.headers.get("retry-after")
            assert err.body["code"] == "queue_full" if isinstance(err.body, dict) else True
            results.append("429")

    threads = [threading.Thread(target=call) for _ in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert "429" in results and "ok" in results, results


def test_bad_json_and_wrong_types(server):
    r = httpx.post(
        server.url + "/v1/chat/completions", headers={**H, "content-type": "application/json"}, content=b"{not json"
    )
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"
    r = httpx.post(server.url + "/v1/chat/completions", headers=H, json={"messages": "hello", "max_tokens": "many"})
    assert r.status_code == 400 and "error" in r.json()
    r = httpx.post(server.url + "/v1/completions", headers=H, json={"prompt": "", "max_tokens": 3})
    assert r.status_code == 400


def _wait_idle(server, timeout=5.0):
    deadline = time.time() + timeout
    while time.time() < deadline:
        m = server.metrics(headers=H)
        if m.get("llmserve:num_requests_running") == 0 and m.get("llmserve:kv_cache_usage_perc") == 0:
            return m
        time.sleep(0.1)
    raise AssertionError(f"engine not idle: {m}")


def _aborted(m: dict) -> float:
    return sum(
        v for k, v in m.items() if k.startswith("llmserve:request_success_total{") and 'finished_reason="abort"' in k
    )


def test_disconnect_aborts(server):
    before = _aborted(_wait_idle(server))
    with httpx.Client(timeout=60) as c:
        with c.stream(
            "POST",
            server.url + "/v1/chat/completions",
            headers=H,
            json={"messages": Q, "max_tokens": 500, "stream": True, "ignore_eos": True},
        ) as r:
            # kept referenced: a dropped generator closes the connection early
            events = iter_sse(r.iter_bytes())
            for n, _ in enumerate(events, 1):
                if n == 3:
                    break
            m = server.metrics(headers=H)
            assert m["llmserve:num_requests_running"] == 1
    t0 = time.time()
    m = _wait_idle(server, timeout=2.0)
    assert time.time() - t0 < 1.5
    # counted as vLLM does: request_success_total{finished_reason="abort"} (recorded on the engine
    # thread just after the blocks are freed: allow it a moment)
    _wait_metric(server, _aborted, before + 1)
    # its log line carries the tokens it produced and the time to the first (issue #55)
    (line,) = [json.loads(x[x.index("{") :]) for x in server.log().splitlines() if '"finish_reason": "abort"' in x][-1:]
    assert line["output_tokens"] >= 2 and 0 < line["ttft"] <= line["total_time"]
    # a non-streamed request whose client gives up (a read timeout closes the connection): aborted too
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(
            server.url + "/v1/chat/completions",
            headers=H,
            timeout=1.0,
            json={"messages": Q, "max_tokens": 500, "ignore_eos": True},
        )
    _wait_idle(server, timeout=5.0)
    _wait_metric(server, _aborted, before + 2)


def _wait_metric(server, read, want: float, timeout: float = 2.0) -> None:
    deadline = time.time() + timeout
    while (got := read(server.metrics(headers=H))) != want and time.time() < deadline:
        time.sleep(0.05)
    assert got == want, (got, want)


def test_fifty_concurrent_streams_and_counters(server):
    before = server.metrics(headers=H)

    async def one(i, c: openai.AsyncOpenAI):
        stream = await c.chat.completions.create(
            model="smol",
            messages=[{"role": "user", "content": f"Count to {i % 7 + 2}."}],
            max_tokens=8 + i % 5,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
        text, usage = "", None
        async for ch in stream:
            if ch.choices:
                text += ch.choices[0].delta.content or ""
            if ch.usage:
                usage = ch.usage
        return text, usage

    async def main():
        async with openai.AsyncOpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0, timeout=300) as c:
            return await asyncio.gather(*(one(i, c) for i in range(50)))

    results = asyncio.run(main())
    assert len(results) == 50 and all(u is not None for _, u in results)
    after = _wait_idle(server)
    gen = sum(u.completion_tokens for _, u in results)
    prompt = sum(u.prompt_tokens for _, u in results)
    assert after["llmserve:generation_tokens_total"] - before.get("llmserve:generation_tokens_total", 0) == gen
    assert after["llmserve:prompt_tokens_total"] - before.get("llmserve:prompt_tokens_total", 0) == prompt
    ok = lambda m: sum(v for k, v in m.items() if k.startswith("llmserve:request_success_total{"))  # noqa: E731
    assert ok(after) - ok(before) == 50


def test_ready_before_load_and_sigterm_drains():
    srv = ServerProcess("--num-threads", "1")
    try:
        first = None
        deadline = time.time() + 60
        while first is None and time.time() < deadline:
            try:
                first = httpx.get(srv.url + "/ready", timeout=2).status_code
            except httpx.HTTPError:
                time.sleep(0.1)
        assert first == 503
        assert httpx.get(srv.url + "/health").status_code == 200
        srv.wait_ready()
        # requests in flight when SIGTERM arrives still finish; new ones are refused
        results = []

        def call():
            c = openai.OpenAI(base_url=srv.url + "/v1", api_key="x", max_retries=0, timeout=120)
            r = c.chat.completions.create(
                model="SmolLM2-135M-Instruct", messages=Q, max_tokens=40, temperature=0, extra_body={"ignore_eos": True}
            )
            results.append(r.usage.completion_tokens)

        threads = [threading.Thread(target=call) for _ in range(3)]
        for t in threads:
            t.start()
        time.sleep(1.0)
        srv.proc.send_signal(signal.SIGTERM)
        time.sleep(0.5)
        with pytest.raises(httpx.HTTPError):
            httpx.get(srv.url + "/health", timeout=2)
        for t in threads:
            t.join()
        assert results == [40, 40, 40]
        assert srv.proc.wait(60) == 0
    finally:
        srv.kill()
