"""llmserve tune end to end: the quality guard refuses a mode that breaks the answers (a small random model whose
int4 weights flip its greedy tokens), and `llmserve tune --budget 90s` on the bundled model writes a YAML that
`llmserve serve --config` starts with."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys

import httpx
import yaml

from llmserve.testing.launcher import ROOT, ServerProcess, free_port
from llmserve.tune import quality
from tests.checkpoints import tiny_llama

PROMPTS = [{"messages": [{"role": "user", "content": t}]} for t in ("What is Docker?", "Name three colours.")]


def _port() -> int:
    return int(os.environ.get("LLMSERVE_TEST_PORT", "0")) or free_port()


def test_quality_guard_refuses_int4_that_flips_greedy_tokens(tmp_path, bundled_gguf):
    folder = tmp_path / "tiny"
    tiny_llama(folder, bundled_gguf, seed=3, tie_word_embeddings=False)
    common = ("--model", str(folder), "--num-threads", "1", "--max-model-len", "512", "--dtype", "float32")
    with ServerProcess(*common, port=_port()) as ref_srv:
        ref_srv.wait_ready()
        model = httpx.get(ref_srv.url + "/v1/models").json()["data"][0]["id"]
        ref = asyncio.run(quality.reference(ref_srv.url, model, PROMPTS, 16))
        same = asyncio.run(quality.agreement(ref_srv.url, model, ref))
    assert same["agreement"] == 1.0 and same["logprob_diff"] < 1e-4 and same["positions"] >= 8
    with ServerProcess(*common, "--quantization", "int4", port=_port()) as q_srv:
        q_srv.wait_ready()
        model = httpx.get(q_srv.url + "/v1/models").json()["data"][0]["id"]
        broken = asyncio.run(quality.agreement(q_srv.url, model, ref))
    assert broken["agreement"] < 0.9, broken  # below --min-agreement's default: the tuner refuses it
    assert broken["logprob_diff"] > same["logprob_diff"]


def test_tune_budget_90s_writes_a_yaml_serve_starts_with(tmp_path):
    out = tmp_path / "tuned.yaml"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH")) if p)}
    cmd = [
        sys.executable,
        "-m",
        "llmserve.cli",
        "tune",
        "--slo",
        "ttft_p95=60000,tpot_p95=10000",
        "--budget",
        "90s",
        "--output-len",
        "16",
        "--probe-seconds",
        "6",
        "--max-probes",
        "2",
        "--min-agreement",
        "0",
        "--knobs",
        "max_num_seqs",
        "--port",
        str(_port()),
        "--out",
        str(out),
        "--rate",
        "3",
    ]
    done = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr[-3000:]
    settings = yaml.safe_load(out.read_text())
    assert {"max_num_seqs", "max_num_batched_tokens", "dtype", "quantization"} <= set(settings)
    report = (tmp_path / "tuned-report" / "report.md").read_text()
    assert "**Chosen**" in report and "**Capacity** for 3 requests/s" in report
    assert (tmp_path / "tuned-report" / "candidates.png").stat().st_size > 1000
    with ServerProcess("--config", str(out), port=_port()) as srv:
        srv.wait_ready()
        r = httpx.post(srv.url + "/v1/completions", json={"prompt": "Hi", "max_tokens": 2}, timeout=60)
        assert r.status_code == 200
        info = srv.metrics()
        assert any(k.startswith("llmserve:cache_config_info") for k in info)


def test_serve_log_requests_writes_the_log_tune_replays(tmp_path):
    """`serve --log-requests FILE`: one JSONL line per engine request (chat template applied, max_tokens, arrival
    in order), which `llmserve tune --workload FILE` reads as a replay with its timing."""
    from llmserve.tune.workload import read_log

    log = tmp_path / "requests.jsonl"
    with ServerProcess("--num-threads", "1", "--max-model-len", "512", "--log-requests", str(log), port=_port()) as srv:
        srv.wait_ready()
        model = httpx.get(srv.url + "/v1/models").json()["data"][0]["id"]
        chat = {"model": model, "messages": [{"role": "user", "content": "What is Docker?"}], "max_tokens": 5}
        assert httpx.post(srv.url + "/v1/chat/completions", json=chat, timeout=120).status_code == 200
        body = {"model": model, "prompt": ["Hello there", "Once upon a time"], "max_tokens": 3}
        assert httpx.post(srv.url + "/v1/completions", json=body, timeout=120).status_code == 200
        bad = {"model": model, "messages": "not a list"}
        assert httpx.post(srv.url + "/v1/chat/completions", json=bad, timeout=120).status_code == 400
    lines = [__import__("json").loads(x) for x in log.read_text().splitlines()]
    assert len(lines) == 3  # the chat, the two prompts; nothing for the refused request
    assert "What is Docker?" in lines[0]["prompt"] and "<|im_start|>" in lines[0]["prompt"]  # the template applied
    assert [x["max_tokens"] for x in lines] == [5, 3, 3] and lines[1]["prompt"] == "Hello there"
    assert 0 <= lines[0]["arrival"] <= lines[1]["arrival"] == lines[2]["arrival"]
    replay = read_log(str(log))
    assert [r.output_len for r in replay] == [5, 3, 3] and replay[0].arrival == 0.0
