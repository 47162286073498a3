"""LoRA adapters through a real `llmserve serve --enable-lora` and the official clients: a request picks an
adapter by `model` (chat, completions, Responses, Messages), /v1/models lists adapters with their base as
`parent`, runtime load / unload (LLMSERVE_ALLOW_RUNTIME_LORA_UPDATING), errors with the right status and
body, base and adapter requests batched together. (Outputs against PEFT: tests/integration/test_lora.py.)"""

from __future__ import annotations

import concurrent.futures as cf
import threading

import httpx
import openai
import pytest

from llmserve.testing.launcher import ROUTE, ServerProcess, wait_until
from llmserve.testing.lora import write_random_adapter

PROMPT = [{"role": "user", "content": "Name three colours."}]


@pytest.fixture(scope="module")
def adapters(tmp_path_factory):
    root = tmp_path_factory.mktemp("adapters")
    return {
        "sql": write_random_adapter(str(root / "sql"), rank=8, seed=1),
        "poet": write_random_adapter(str(root / "poet"), rank=4, targets=("q_proj", "v_proj", "down_proj"), seed=2),
        "big": write_random_adapter(str(root / "big"), rank=16, targets=("q_proj",), seed=3),
    }


@pytest.fixture(scope="module")
def server(adapters):
    srv = ServerProcess(
        "--num-threads",
        "1",
        "--served-model-name",
        "base",
        "--max-model-len",
        "512",
        "--enable-lora",
        "--lora-modules",
        f"sql={adapters['sql']}",
        "--max-loras",
        "2",
        "--max-lora-rank",
        "8",
        env={"LLMSERVE_ALLOW_RUNTIME_LORA_UPDATING": "1"},
    )
    try:
        srv.wait_ready()
        yield srv
    finally:
        srv.kill()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)


def _chat(client, model: str) -> str:
    r = client.chat.completions.create(model=model, messages=PROMPT, max_tokens=8, temperature=0)
    assert r.model == model
    return r.choices[0].message.content


def test_models_lists_adapters_with_parent(client, adapters):
    cards = {m.id: m for m in client.models.list().data}
    assert set(cards) == {"base", "sql"}
    assert cards["sql"].parent == "base" and cards["sql"].root == adapters["sql"]
    assert getattr(cards["base"], "parent", None) is None


def test_adapter_by_model_name_batched_with_base(server, client):
    base, sql = _chat(client, "base"), _chat(client, "sql")
    assert base != sql
    seen, done = [], threading.Event()

    def scrape():
        while not done.is_set():
            seen.append(httpx.get(server.url + "/metrics").text)
            done.wait(0.05)

    with cf.ThreadPoolExecutor(7) as pool:  # base and adapter rows in the same steps
        scraper = pool.submit(scrape)
        try:
            got = list(pool.map(lambda m: _chat(client, m), ["base", "sql"] * 3))
        finally:
            done.set()
        scraper.result()
    assert got == [base, sql] * 3
    info = [line for text in seen for line in text.splitlines() if line.startswith("llmserve:lora_requests_info{")]
    assert info and all('max_lora="2"' in line for line in info)
    assert any('running_lora_adapters="sql"' in line or 'waiting_lora_adapters="sql"' in line for line in info)
    c = client.completions.create(model="sql", prompt="Hello", max_tokens=4, temperature=0)
    assert c.model == "sql" and c.choices[0].text
    r = client.responses.create(model="sql", input="Name three colours.", max_output_tokens=8, temperature=0)
    assert r.model == "sql" and r.output_text
    anthropic = pytest.importorskip("anthropic")
    claude = anthropic.Anthropic(base_url=server.url, api_key="unused", max_retries=0)
    m = claude.messages.create(model="sql", max_tokens=8, messages=PROMPT)
    assert m.model == "sql" and m.content[0].text
    with pytest.raises(anthropic.NotFoundError):
        claude.messages.create(model="nope", max_tokens=8, messages=PROMPT)


def test_unknown_model_is_404(client):
    with pytest.raises(openai.NotFoundError) as e:
        _chat(client, "nope")
    assert e.value.body["code"] == "model_not_found" and "sql" in e.value.body["message"]


def test_runtime_load_unload_and_errors(server, client, adapters, tmp_path):
    url = server.url + "/v1"

    def post(path, **body):
        return httpx.post(url + path, json=body, timeout=60)

    r = post("/load_lora_adapter", lora_name="poet", lora_path=adapters["poet"])
    assert r.status_code == 200, r.text
    assert {m.id for m in client.models.list().data} == {"base", "sql", "poet"}
    poet = _chat(client, "poet")
    assert poet != _chat(client, "base")
    bad = {
        "over max loras": ({"lora_name": "x", "lora_path": adapters["sql"]}, "--max-loras"),
        "name taken": ({"lora_name": "sql", "lora_path": adapters["sql"]}, "already loaded"),
        "base name": ({"lora_name": "base", "lora_path": adapters["sql"]}, "base model"),
    }
    for what, (body, message) in bad.items():
        r = post("/load_lora_adapter", **body)
        assert r.status_code == 400 and message in r.json()["error"]["message"], (what, r.text)
    r = post("/unload_lora_adapter", lora_name="poet")
    assert r.status_code == 200, r.text
    r = post("/unload_lora_adapter", lora_name="poet")
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
    with pytest.raises(openai.NotFoundError):
        _chat(client, "poet")
    (tmp_path / "empty").mkdir()
    bad = {
        "missing": ({"lora_name": "m", "lora_path": str(tmp_path / "nowhere")}, "not a directory"),
        "malformed": ({"lora_name": "m", "lora_path": str(tmp_path / "empty")}, "no adapter_config.json"),
        "rank": ({"lora_name": "m", "lora_path": adapters["big"]}, "more than --max-lora-rank 8"),
        "no path": ({"lora_name": "m"}, "lora_path"),
    }
    for what, (body, message) in bad.items():
        r = post("/load_lora_adapter", **body)
        assert r.status_code == 400 and message in r.json()["error"]["message"], (what, r.text)
        assert r.json()["error"]["type"] == "invalid_request_error"
    assert {m.id for m in client.models.list().data} == {"base", "sql"}
    assert _chat(client, "sql") and _chat(client, "base")  # still serving


def test_router_routes_adapter_names(server, adapters):
    """The router's per-model pools come from each backend's /v1/models: adapters are routed like models,
    including one loaded at runtime (after the next health check)."""
    with ServerProcess(
        "--backend", server.url, "--health-interval", "0.3", "--log-level", "warning", cmd=ROUTE
    ).wait_ready(30) as router:
        via = openai.OpenAI(base_url=router.url + "/v1", api_key="x", max_retries=0, timeout=120)
        assert wait_until(lambda: {m.id for m in via.models.list().data} == {"base", "sql"}, timeout=30)
        assert {m.id: getattr(m, "parent", None) for m in via.models.list().data}["sql"] == "base"
        direct = openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0, timeout=120)
        assert _chat(via, "sql") == _chat(direct, "sql")
        r = httpx.post(server.url + "/v1/load_lora_adapter", json={"lora_name": "late", "lora_path": adapters["poet"]})
        assert r.status_code == 200, r.text
        try:
            assert wait_until(lambda: "late" in {m.id for m in via.models.list().data}, timeout=30)
            assert _chat(via, "late")
        finally:
            httpx.post(server.url + "/v1/unload_lora_adapter", json={"lora_name": "late"})
        with pytest.raises(openai.NotFoundError):
            _chat(via, "nope")


def test_runtime_updates_off_by_default(adapters):
    with ServerProcess(
        "--num-threads",
        "1",
        "--max-model-len",
        "256",
        "--enable-lora",
        env={"LLMSERVE_ALLOW_RUNTIME_LORA_UPDATING": ""},
    ) as srv:
        srv.wait_ready()
        r = httpx.post(srv.url + "/v1/load_lora_adapter", json={"lora_name": "a", "lora_path": adapters["sql"]})
        assert r.status_code == 404


def test_bad_adapter_at_startup_fails_clearly(tmp_path):
    with ServerProcess("--num-threads", "1", "--lora-modules", f"x={tmp_path}") as srv:
        assert srv.proc.wait(120) != 0
        assert "no adapter_config.json" in srv.log()
