"""Each third-party load client's command line (`vllm bench serve`, GuideLLM, AIPerf, `llmserve bench`) and the
parser of the result file it writes: ok / failed requests, output tok/s, median TTFT, errors."""

from __future__ import annotations

import json
import os
import re
import sys

from benchmarks.peers.servers import MODEL_NAME, hf_folder, venv_bin, vllm_sh

PATHS = {
    "chat": "/v1/chat/completions",
    "completions": "/v1/completions",
    "responses": "/v1/responses",
    "embeddings": "/v1/embeddings",
}


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
