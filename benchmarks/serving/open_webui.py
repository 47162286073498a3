"""Open WebUI against llmserve, offline (issue #55; outside CI: it needs Open WebUI's own 2.9 GB venv).

Starts `llmserve serve` (the bundled model) and Open WebUI with both of its connections pointed at it
(OLLAMA_BASE_URL at the server's root, OPENAI_API_BASE_URL at /v1), signs in (WEBUI_AUTH=False: the
built-in admin), and through Open WebUI's own API: lists the models (the served model twice, once per
connection), reads the Ollama connection's version and tags through its proxy, and has one chat turn through
each connection (/api/chat/completions, non-streamed and streamed). Then reads llmserve's request log: what
Open WebUI sent (routes, prompt tokens, time to first token).

    python -m benchmarks.serving.open_webui [--owui /root/owui/venv] [--port 18110] [--owui-port 18111]

Open WebUI's venv (MACHINE-NOTES.md): `python3 -m venv /root/owui/venv && /root/owui/venv/bin/pip install
torch==2.13.0 && /root/owui/venv/bin/pip install open-webui` (0.12.4 checked; 320 s, 2.9 GB)."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

import httpx

from llmserve.testing.launcher import ServerProcess

QUESTION = "What is the capital of France? Answer in one sentence."


def start_open_webui(venv: str, port: int, llm_url: str, data_dir: str, log_path: str) -> subprocess.Popen:
    env = {
        **os.environ,
        "WEBUI_AUTH": "False",
        "OFFLINE_MODE": "true",
        "HF_HUB_OFFLINE": "1",
        "RAG_EMBEDDING_MODEL_AUTO_UPDATE": "false",
        "ENABLE_VERSION_UPDATE_CHECK": "false",
        "DATA_DIR": data_dir,
        "OLLAMA_BASE_URL": llm_url,
        "OPENAI_API_BASE_URL": llm_url + "/v1",
        "OPENAI_API_KEY": "unused",
    }
    env.pop("PYTHONPATH", None)  # Open WebUI runs in its own venv, without this checkout
    log = open(log_path, "ab")
    return subprocess.Popen(
        [os.path.join(venv, "bin", "open-webui"), "serve", "--host", "127.0.0.1", "--port", str(port)],
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
        cwd=data_dir,
    )


def wait_for(url: str, timeout: float, proc: subprocess.Popen) -> float:
    t0 = time.time()
    while time.time() - t0 < timeout:
        if proc.poll() is not None:
            raise SystemExit(f"Open WebUI exited ({proc.returncode}); see its log")
        try:
            if httpx.get(url, timeout=5).status_code == 200:
                return time.time() - t0
        except httpx.HTTPError:
            pass
        time.sleep(1)
    raise SystemExit(f"Open WebUI did not answer {url} within {timeout:.0f} s")


def chat(c: httpx.Client, model: str, stream: bool) -> tuple[str, float]:
    """One turn through Open WebUI's /api/chat/completions: (the answer, seconds to its first byte of text)."""
    body = {"model": model, "messages": [{"role": "user", "content": QUESTION}], "stream": stream}
    t0 = time.time()
    if not stream:
        r = c.post("/api/chat/completions", json=body)
        r.raise_for_status()
        d = r.json()
        return d["choices"][0]["message"]["content"], time.time() - t0
    text, first = "", None
    with c.stream("POST", "/api/chat/completions", json=body) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            choices = json.loads(line[6:]).get("choices") or [{}]
            piece = (choices[0].get("delta") or {}).get("content") or ""
            if piece and first is None:
                first = time.time() - t0
            text += piece
    return text, first or 0.0


def request_log(server: ServerProcess) -> list[dict]:
    out = []
    for line in server.log().splitlines():
        if "llmserve.requests" in line and "{" in line:
            out.append(json.loads(line[line.index("{") :]))
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--owui", default="/root/owui/venv", help="Open WebUI's venv")
    ap.add_argument("--port", type=int, default=18110, help="llmserve's port")
    ap.add_argument("--owui-port", type=int, default=18111, help="Open WebUI's port")
    ap.add_argument("--start-timeout", type=float, default=300.0)
    args = ap.parse_args(argv)
    data = tempfile.mkdtemp(prefix="owui-data-")
    with ServerProcess("--max-model-len", "8192", port=args.port) as srv:
        srv.wait_ready(timeout=300)
        owui = start_open_webui(args.owui, args.owui_port, srv.url, data, os.path.join(data, "open-webui.log"))
        try:
            started = wait_for(f"http://127.0.0.1:{args.owui_port}/health", args.start_timeout, owui)
            print(f"Open WebUI answered /health after {started:.0f} s (log: {data}/open-webui.log)")
            base = f"http://127.0.0.1:{args.owui_port}"
            with httpx.Client(base_url=base, timeout=900) as c:
                token = c.post("/api/v1/auths/signin", json={"email": "", "password": ""}).json()["token"]
                c.headers["Authorization"] = f"Bearer {token}"
                models = c.get("/api/models").json()["data"]
                names = sorted((m["id"], m.get("owned_by", "")) for m in models)
                print(f"models in Open WebUI: {names}")
                version = c.get("/ollama/api/version").json()
                tags = c.get("/ollama/api/tags").json()["models"]
                print(f"Ollama connection: version {version}, tags {[(t['name'], t['details']) for t in tags]}")
                ollama_model = next(m for m, owner in names if owner == "ollama")
                openai_model = next(m for m, owner in names if owner == "openai")
                for model in (ollama_model, openai_model):
                    for stream in (False, True):
                        text, first = chat(c, model, stream)
                        print(f"chat via {model!r} stream={stream}: {first:.1f} s to first text: {text[:160]!r}")
                        assert text.strip(), "an empty answer"
        finally:
            owui.terminate()
            try:
                owui.wait(30)
            except subprocess.TimeoutExpired:
                owui.kill()
        log = request_log(srv)
    print("llmserve's request log (what Open WebUI sent):")
    for r in log:
        print(
            f"  {r['request_id'].split('-')[0]}: prompt {r['prompt_tokens']} tokens ({r['cached_tokens']} cached), "
            f"output {r['output_tokens']}, ttft {r['ttft']} s, total {r['total_time']} s, {r['finish_reason']}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
