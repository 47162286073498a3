"""`llmserve serve --models-dir DIR` against real servers on loopback: a folder with the bundled GGUF (as
"smol"), a tiny random Hugging Face folder written here ("tiny"), a truncated GGUF ("broken") and a model whose
models.yaml asks more KV cache than the machine has ("huge"). Listed with their states in /v1/models and
/api/tags; loaded on first request (greedy text equal to transformers' on the same weights); two models under
concurrent mixed load (OpenAI, Ollama); unknown models 404 in each API's shape; the broken file failed (503,
its error in /v1/models and the log) while the others serve; the memory check's 503; keep_alive (0 unloads,
durations, -1) in /api/ps; the ollama client. A second server, --models-max 1 and --model-idle-timeout: the
least recently used model unloaded (never one with a request in flight) and the idle one unloaded with the
process's RSS falling (psutil)."""

from __future__ import annotations

import os
import time
from concurrent.futures import ThreadPoolExecutor
from datetime import datetime, timezone

import httpx
import ollama
import psutil
import pytest

from llmserve.bench.scrape import metric_sum
from llmserve.cli import main
from llmserve.testing.launcher import ServerProcess, router_thread, wait_until
from llmserve.testing.lora import write_random_adapter
from tests.checkpoints import tiny_llama

pytestmark = pytest.mark.timeout(1800)

PROMPT = [{"role": "user", "content": "Name three colors."}]


def _tiny_folder(path: str, bundled_gguf: str) -> None:
    tiny_llama(path, bundled_gguf, head_dim=32)


@pytest.fixture(scope="module")
def models_dir(tmp_path_factory, bundled_gguf):
    d = tmp_path_factory.mktemp("models")
    os.symlink(bundled_gguf, d / "smol.gguf")
    os.symlink(bundled_gguf, d / "huge.gguf")
    with open(bundled_gguf, "rb") as f:
        (d / "broken.gguf").write_bytes(f.read(3_000_000))  # cut inside the header's vocabulary
    _tiny_folder(str(d / "tiny"), bundled_gguf)
    (d / "notes.txt").write_text("not a model")
    adapter = write_random_adapter(str(d.parent / f"{d.name}-adapter"), model=str(d / "tiny"), rank=4, std=0.5)
    (d / "models.yaml").write_text(
        f"tiny:\n  max-model-len: 256\n  lora-modules: [tinysql={adapter}]\nhuge:\n  kv-cache-memory: 100000\n"
    )
    return d


@pytest.fixture(scope="module")
def server(models_dir):
    flags = ("--models-dir", str(models_dir), "--num-threads", "1", "--kv-cache-memory", "0.1", "--models-max", "3")
    with ServerProcess(*flags) as srv:
        yield srv.wait_ready()


def _cards(srv) -> dict:
    return {c["id"]: c for c in httpx.get(srv.url + "/v1/models", timeout=10).json()["data"]}


def _ps(srv) -> dict:
    return {m["name"]: m for m in httpx.get(srv.url + "/api/ps", timeout=10).json()["models"]}


def _chat(srv, model, n=8, timeout=600, **extra):
    body = {"model": model, "messages": PROMPT, "max_tokens": n, "temperature": 0, **extra}
    return httpx.post(srv.url + "/v1/chat/completions", json=body, timeout=timeout)


def test_lists_every_model_with_its_state(server):
    cards = _cards(server)
    assert set(cards) == {"smol", "tiny", "broken", "huge"}  # notes.txt is not a model
    assert wait_until(lambda: _cards(server)["broken"]["status"]["value"] == "failed", timeout=120)
    broken = _cards(server)["broken"]["status"]
    assert "truncated or corrupt" in broken["error"] and "broken.gguf" in broken["error"]
    assert "broken.gguf" in server.log() and "failed" in server.log()
    tags = {m["name"] for m in httpx.get(server.url + "/api/tags", timeout=10).json()["models"]}
    assert {"smol:latest", "tiny:latest"} <= tags and "broken:latest" not in tags


def test_unknown_model_is_a_404_in_each_apis_shape(server):
    u = server.url
    r = httpx.post(u + "/v1/chat/completions", json={"model": "nope", "messages": PROMPT}, timeout=30)
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
    assert "smol" in r.json()["error"]["message"]
    r = httpx.post(u + "/v1/messages", json={"model": "nope", "max_tokens": 4, "messages": PROMPT}, timeout=30)
    assert r.status_code == 404 and r.json()["type"] == "error" and r.json()["error"]["type"] == "not_found_error"
    r = httpx.post(u + "/api/chat", json={"model": "nope:latest", "messages": PROMPT}, timeout=30)
    assert r.status_code == 404 and "nope" in r.json()["error"]
    r = httpx.post(u + "/api/pull", json={"model": "nope"}, timeout=30)
    assert r.status_code == 404 and set(r.json()) == {"error"}
    assert httpx.get(u + "/v1/models/nope", timeout=10).status_code == 404


def test_broken_file_answers_503_and_others_serve(server):
    assert wait_until(lambda: _cards(server)["broken"]["status"]["value"] == "failed", timeout=120)
    r = _chat(server, "broken")
    assert r.status_code == 503 and r.json()["error"]["code"] == "model_load_failed"
    assert "truncated or corrupt" in r.json()["error"]["message"]


def test_memory_check_refuses_with_503(server):
    r = _chat(server, "huge")
    assert r.status_code == 503, r.text
    err = r.json()["error"]
    assert err["code"] == "insufficient_memory" and "does not fit in memory" in err["message"]
    assert _cards(server)["huge"]["status"]["value"] == "not loaded"  # it may fit later: not "failed"


def test_lazy_load_greedy_equals_transformers(server, models_dir):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    ids = [1, 504, 3458, 282, 253, 1345, 30]
    r = httpx.post(
        server.url + "/v1/completions",
        json={"model": "tiny", "prompt": ids, "max_tokens": 8, "temperature": 0},
        timeout=600,
    )
    assert r.status_code == 200, r.text
    assert r.json()["model"] == "tiny"
    tiny = str(models_dir / "tiny")
    hf = AutoModelForCausalLM.from_pretrained(tiny, torch_dtype=torch.float32).eval()
    out = hf.generate(torch.tensor([ids]), max_new_tokens=8, do_sample=False)[0, len(ids) :]
    assert r.json()["choices"][0]["text"] == AutoTokenizer.from_pretrained(tiny).decode(out)
    card = _cards(server)["tiny"]
    assert card["status"] == {"value": "loaded"} and card["max_model_len"] == 256  # models.yaml
    assert "tiny:latest" in _ps(server)


def test_lora_adapter_stays_with_its_base_model(server):
    body = {"prompt": [1, 504, 3458, 282], "max_tokens": 6, "temperature": 0}
    base = httpx.post(server.url + "/v1/completions", json={"model": "tiny", **body}, timeout=600)
    lora = httpx.post(server.url + "/v1/completions", json={"model": "tinysql", **body}, timeout=600)
    assert base.status_code == lora.status_code == 200, lora.text
    assert lora.json()["model"] == "tinysql"
    assert lora.json()["choices"][0]["text"] != base.json()["choices"][0]["text"]
    assert _cards(server)["tinysql"]["parent"] == "tiny"


def test_two_models_under_concurrent_mixed_load(server):
    alone = _chat(server, "smol")
    assert alone.status_code == 200, alone.text
    text = alone.json()["choices"][0]["message"]["content"]

    def smol(_):
        return _chat(server, "smol").json()

    def tiny(_):
        body = {"model": "tiny", "prompt": "Hello there", "max_tokens": 6, "temperature": 0}
        return httpx.post(server.url + "/v1/completions", json=body, timeout=600).json()

    def ollama_smol(_):
        body = {
            "model": "smol",
            "messages": PROMPT,
            "stream": False,
            "options": {"temperature": 0, "num_predict": 8, "repeat_penalty": 1.0},
        }
        return httpx.post(server.url + "/api/chat", json=body, timeout=600).json()

    with ThreadPoolExecutor(8) as ex:
        futs = [ex.submit(f, i) for i in range(3) for f in (smol, tiny, ollama_smol)]
        results = [f.result() for f in futs]
    for k, res in enumerate(results):
        kind = k % 3
        if kind == 0:
            assert res["model"] == "smol" and res["choices"][0]["message"]["content"] == text
        elif kind == 1:
            assert res["model"] == "tiny" and res["choices"][0]["text"]
        else:
            assert res["model"] == "smol" and res["message"]["content"] == text
    m = httpx.get(server.url + "/metrics", timeout=10).text
    assert 'llmserve:generation_tokens_total{model_name="smol"}' in m
    assert 'llmserve:generation_tokens_total{model_name="tiny"}' in m
    assert m.count("# TYPE llmserve:generation_tokens_total counter") == 1  # one family, two models


def test_keep_alive_sets_expiry_and_zero_unloads(server):
    u = server.url
    r = httpx.post(u + "/api/generate", json={"model": "tiny", "prompt": "", "keep_alive": "10m"}, timeout=600)
    assert r.json()["done_reason"] == "load"
    expires = datetime.fromisoformat(_ps(server)["tiny:latest"]["expires_at"].replace("Z", "+00:00"))
    left = (expires - datetime.now(timezone.utc)).total_seconds()
    assert 500 < left <= 600
    httpx.post(u + "/api/generate", json={"model": "tiny", "prompt": "", "keep_alive": -1}, timeout=60)
    assert _ps(server)["tiny:latest"]["expires_at"].startswith("9999")
    r = httpx.post(u + "/api/generate", json={"model": "tiny", "prompt": "", "keep_alive": 0}, timeout=60)
    assert r.status_code == 200 and r.json()["done_reason"] == "unload"
    assert wait_until(lambda: "tiny:latest" not in _ps(server), timeout=30)
    # /api/ps drops it as the unload starts ("unloading"); the card says "not loaded" once it is done
    assert wait_until(lambda: _cards(server)["tiny"]["status"]["value"] == "not loaded", timeout=30)
    # the request that loads it again reports the load in load_duration (part of total_duration)
    body = {"model": "tiny", "prompt": "Hi", "stream": False, "options": {"num_predict": 2}}
    again = httpx.post(u + "/api/generate", json=body, timeout=600).json()
    assert 0 < again["load_duration"] < again["total_duration"]
    bad = httpx.post(u + "/api/generate", json={"model": "smol", "prompt": "", "keep_alive": "soon"}, timeout=60)
    assert bad.status_code == 400 and "keep_alive" in bad.json()["error"]


def test_ollama_client(server):
    with ollama.Client(host=server.url, timeout=600) as c:
        names = {m.model for m in c.list().models}
        assert {"smol:latest", "tiny:latest"} <= names
        r = c.chat("smol", messages=PROMPT, options={"temperature": 0, "num_predict": 8})
        assert r.message.content
        assert "smol:latest" in {m.model for m in c.ps().models}
        assert c.pull("tiny").status == "success"  # a name in DIR: loaded
        assert "tiny:latest" in {m.model for m in c.ps().models}
        with pytest.raises(ollama.ResponseError) as e:
            c.pull("llama3")
        assert e.value.status_code == 404


def test_web_page_model_menu_shows_every_model_and_its_state(server):
    chromium = os.environ.get("LLMSERVE_CHROMIUM", "/usr/bin/chromium")
    if not os.path.exists(chromium):
        pytest.skip(f"{chromium} missing: run `make browser` (tests/e2e/test_web_page.py)")
    from playwright.sync_api import sync_playwright

    assert _chat(server, "smol", n=1).status_code == 200
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=chromium, args=["--headless", "--no-sandbox"], headless=True)
        try:
            page = browser.new_page()
            errors: list[str] = []
            page.on("pageerror", lambda e: errors.append(str(e)))
            page.goto(server.url + "/")
            page.wait_for_function("document.querySelectorAll('#model option').length >= 4", timeout=30_000)
            options = page.eval_on_selector_all(
                "#model option", "os => os.map(o => [o.value, o.textContent, o.disabled])"
            )
        finally:
            browser.close()
    shown = {value: (text, disabled) for value, text, disabled in options}
    states = {c["id"]: c["status"]["value"] for c in _cards(server).values() if not c["parent"]}  # (not adapters)
    for name, state in states.items():
        text, disabled = shown[name]
        assert text == (name if state == "loaded" else f"{name} ({state})") and disabled == (state == "failed")
    assert states["broken"] == "failed" and states["huge"] == "not loaded" and states["smol"] == "loaded"
    assert not errors, errors


def test_bench_spreads_load_over_models(server, tmp_path):
    def done(model):
        text = httpx.get(server.url + "/metrics", timeout=10).text
        return metric_sum(text, "llmserve:request_success_total", model_name=model)

    before = {m: done(m) for m in ("smol", "tiny")}
    flags = ["--base-url", server.url, "--model", "smol,tiny", "--concurrency", "2", "--num-requests", "4"]
    rc = main(["bench", *flags, "--output-len", "4", "--output-dir", str(tmp_path), "--no-progress"])
    assert rc == 0
    assert {m: done(m) - before[m] for m in ("smol", "tiny")} == {"smol": 2, "tiny": 2}


def test_router_routes_by_name_and_merges_ollama_lists(server):
    with router_thread(backends=[server.url], health_interval=0.2) as r, httpx.Client(base_url=r.url, timeout=600) as c:
        assert wait_until(lambda: r.router.healthy_backends(), timeout=30)
        cards = {m["id"]: m for m in c.get("/v1/models").json()["data"]}
        assert {"smol", "tiny", "huge"} <= set(cards) and "broken" not in cards  # failed there: not routed to it
        assert "status" in cards["tiny"]
        got = c.post(
            "/api/chat",
            json={
                "model": "smol:latest",
                "messages": PROMPT,
                "stream": False,
                "options": {"temperature": 0, "num_predict": 4},
            },
        )
        assert got.status_code == 200 and got.json()["message"]["content"]
        assert "smol:latest" in {m["name"] for m in c.get("/api/ps").json()["models"]}
        assert {"smol:latest", "tiny:latest"} <= {m["name"] for m in c.get("/api/tags").json()["models"]}
        assert c.get("/api/version").json()["version"]
        assert c.post("/api/pull", json={"model": "nope"}).status_code == 404


def test_wait_for_a_load_is_bounded_by_request_timeout(models_dir, tmp_path):
    os.symlink(models_dir / "tiny", tmp_path / "tiny")
    with ServerProcess("--models-dir", str(tmp_path), "--num-threads", "1", "--request-timeout", "0.05") as srv:
        srv.wait_ready()
        r = _chat(srv, "tiny", n=1)
        assert r.status_code == 503 and r.json()["error"]["code"] == "model_loading", r.text
        assert r.headers["retry-after"]
        # the load goes on without the request that started it
        assert wait_until(lambda: _cards(srv)["tiny"]["status"]["value"] == "loaded", timeout=300)


def _running(srv, model: str) -> float:
    return metric_sum(
        httpx.get(srv.url + "/metrics", timeout=10).text, "llmserve:num_requests_running", model_name=model
    )


def _rss(srv) -> int:
    return psutil.Process(srv.proc.pid).memory_info().rss


def test_lru_in_flight_and_idle_unload_with_rss(models_dir):
    flags = ("--models-dir", str(models_dir), "--num-threads", "1", "--kv-cache-memory", "0.1")
    with ServerProcess(*flags, "--models-max", "1", "--model-idle-timeout", "4") as srv:
        srv.wait_ready()
        base = _rss(srv)
        assert _chat(srv, "smol", n=2).status_code == 200
        loaded = _rss(srv)
        assert set(_ps(srv)) == {"smol:latest"}
        # a long request on smol in flight: the request for tiny waits for it (smol is never unloaded under it)
        with ThreadPoolExecutor(2) as ex:
            long = ex.submit(_chat, srv, "smol", 48, 600, ignore_eos=True)
            assert wait_until(lambda: _running(srv, "smol") == 1, timeout=120)
            other = ex.submit(_chat, srv, "tiny", 4)
            first, second = long.result(), other.result()
        assert first.status_code == 200 and first.json()["usage"]["completion_tokens"] == 48
        assert second.status_code == 200 and second.json()["model"] == "tiny"
        assert set(_ps(srv)) == {"tiny:latest"}  # LRU: smol made room
        assert "unloading model smol (least recently used)" in srv.log()
        # idle: after --model-idle-timeout nothing stays loaded, and the memory goes back
        assert wait_until(lambda: not _ps(srv), timeout=60)
        time.sleep(1)
        after = _rss(srv)
        assert after < loaded - 200 * 2**20, (base, loaded, after)
