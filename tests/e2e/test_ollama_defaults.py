"""Ollama's sampling defaults and model descriptions on a real `llmserve serve` (issue #55): a request without
options samples as Ollama's defaults spelled out (same seed, same text); a model's own parameters (a GGUF file's
general.sampling.*, a folder's generation_config.json) come before them and a request's options before both;
/api/tags, /api/show and /api/ps name the file's type as Ollama does (the bundled model: Q4_1; a K-quant file:
Q4_K_M), its parameter size, family and format; /api/version is the package's."""

from __future__ import annotations

import json

import httpx
import pytest

import llmserve
from llmserve.server.api.ollama_options import OLLAMA_DEFAULTS
from llmserve.testing.launcher import ServerProcess
from tests.checkpoints import tiny_llama
from tests.gguf_files import MIXED, write_tiny_gguf

Q = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def http(ollama_server):
    with httpx.Client(base_url=ollama_server.url, timeout=300) as c:
        yield c


def _text(http, route: str, model: str, options: dict) -> str:
    body = {"model": model, "stream": False, "options": options}
    body.update({"messages": Q} if route == "/api/chat" else {"prompt": Q[0]["content"]})
    r = http.post(route, json=body)
    assert r.status_code == 200, r.text
    d = r.json()
    return d["message"]["content"] if route == "/api/chat" else d["response"]


@pytest.mark.parametrize("route", ["/api/generate", "/api/chat"])
def test_no_options_equals_ollamas_defaults_spelled_out(http, route):
    run = {"seed": 42, "num_predict": 16}
    plain = _text(http, route, "smol", run)
    assert plain and plain == _text(http, route, "smol", {**run, **OLLAMA_DEFAULTS})
    # an option given wins over its default (a greedy answer is the same whatever the seed)
    greedy = _text(http, route, "smol", {**run, "temperature": 0})
    assert greedy == _text(http, route, "smol", {**run, "seed": 7, "temperature": 0})


def test_the_bundled_model_is_described_as_ollama_does(http):
    (tag,) = http.get("/api/tags").json()["models"]
    details = tag["details"]
    assert details == {
        "parent_model": "",
        "format": "gguf",
        "family": "llama",
        "families": ["llama"],
        "parameter_size": "134.52M",
        "quantization_level": "Q4_1",
    }
    assert len(tag["digest"]) == 64 and int(tag["digest"], 16) >= 0
    show = http.post("/api/show", json={"model": "smol:latest"}).json()
    assert show["details"] == details and show["model_info"]["general.parameter_count"] == 134_515_008
    lines = dict(line.split(None, 1) for line in show["parameters"].splitlines())
    assert (lines["temperature"], lines["top_k"], lines["top_p"], lines["repeat_penalty"]) == (
        "0.8",
        "40",
        "0.9",
        "1.1",
    )
    assert http.get("/api/ps").json()["models"][0]["details"] == details
    assert http.get("/api/version").json() == {"version": llmserve.__version__}


# -- a model's own parameters: a K-quant GGUF with general.sampling.temp 0, a folder whose generation config says 0
@pytest.fixture(scope="module")
def own(tmp_path_factory, bundled_gguf):
    d = tmp_path_factory.mktemp("own-params")
    write_tiny_gguf(str(d / "kq.gguf"), MIXED, file_type=15, sampling={"temp": 0.0, "top_k": 20})
    tiny_llama(str(d / "gen"), bundled_gguf, head_dim=32)
    with open(d / "gen" / "generation_config.json", "w") as f:
        json.dump({"bos_token_id": 1, "eos_token_id": 2, "temperature": 0.0}, f)
    flags = ("--models-dir", str(d), "--num-threads", "1", "--kv-cache-memory", "0.1", "--max-model-len", "256")
    with ServerProcess(*flags) as srv:
        srv.wait_ready()
        with httpx.Client(base_url=srv.url, timeout=300) as c:
            yield c


def test_a_k_quant_file_says_q4_k_m_before_and_after_loading(own):
    tags = {m["name"]: m["details"] for m in own.get("/api/tags").json()["models"]}
    assert tags["kq:latest"]["quantization_level"] == "Q4_K_M" and tags["kq:latest"]["family"] == "llama"
    assert tags["gen:latest"]["format"] == "safetensors"
    own.post("/api/generate", json={"model": "kq", "prompt": "", "stream": False})  # loads it
    (loaded,) = [m for m in own.get("/api/ps").json()["models"] if m["name"] == "kq:latest"]
    assert loaded["details"]["quantization_level"] == "Q4_K_M"


@pytest.mark.parametrize("model", ["kq", "gen"])
def test_the_models_own_temperature_is_used_and_options_win(own, model):
    def text(options):
        return _text(own, "/api/generate", model, {"num_predict": 12, **options})

    default = text({"seed": 1})
    assert default == text({"seed": 2}) == text({"seed": 3, "temperature": 0})  # greedy: the model's temperature 0
    assert {text({"seed": s, "temperature": 1.5}) for s in (1, 2, 3)} != {default}  # options win
    show = own.post("/api/show", json={"model": model}).json()
    assert "temperature                    0.0" in show["parameters"]
