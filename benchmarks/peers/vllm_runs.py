"""llmserve against vLLM's CPU build and llama.cpp's server, one server after another (issue #21): the
servers (`Served`), `vllm bench serve` and `llmserve bench` against each, the table. The entry point is
`python -m benchmarks.peers.compare vllm` (its docstring says what is measured)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

from benchmarks.common import ROOT, start_llama_server
from benchmarks.peers.client_commands import parse_result
from benchmarks.peers.servers import OFFLINE, hf_folder, vllm_sh, wait_ready

NAME = "bench-model"  # every server serves the model under this name
LLAMA_BIN = os.path.expanduser("~/.cache/llmserve-peers/llama.cpp/build/bin")


def load() -> float:
    return round(os.getloadavg()[0], 1)


def model_files(model: str) -> tuple[str | None, str, str | None]:
    """(llmserve's --model, the Hugging Face folder for vLLM and the clients' tokenizer, llama.cpp's GGUF)."""
    if model == "bundled":
        from llmserve.model.loader import bundled_model_path

        return None, hf_folder(), bundled_model_path()
    gguf = next(
        (
            os.path.join(model, f)
            for f in ("model-Q8_0.gguf", "model-Q4_K_M.gguf")
            if os.path.exists(os.path.join(model, f))
        ),
        None,
    )
    return model, model, gguf


def vllm_dtype(a) -> str:
    """vLLM's dtype for the run: --vllm-dtype, auto: bfloat16 where oneDNN has native bf16 (vLLM's CPU default
    there), float32 elsewhere."""
    dtype = getattr(a, "vllm_dtype", "auto")
    if dtype == "auto":
        from llmserve.model.formats import bf16

        dtype = "bfloat16" if bf16.supported() else "float32"
    return dtype


class Served:
    """One server on the machine at a time: `kind` is vllm, llama.cpp, llmserve or llmserve-int8/int4, with
    "-kv16" for a float16 KV cache (llmserve-int8-kv16), "-mbtN" for a token budget, "-gguf" for llama-server's
    GGUF file (llmserve-gguf: its Q4_K_M / Q8_0 blocks as they are)."""

    def __init__(self, kind: str, model: str, a) -> None:
        self.kind, self.model, self.a = kind, model, a
        self.proc = self.url = None

    def __enter__(self):
        flags, folder, gguf = model_files(self.model)
        if self.kind == "vllm":
            port = 18000 + os.getpid() % 1000
            subprocess.run(
                ["bash", vllm_sh(), "serve", folder, str(port), "--served-model-name", NAME]
                + ["--dtype", vllm_dtype(self.a)],
                env={**os.environ, **OFFLINE},
                check=False,
            )
            self.url = f"http://127.0.0.1:{port}"
            self.port = port
            wait_ready(self.url, "/v1/models", 1200)
        elif self.kind == "llama.cpp":
            self.proc, self.url = start_llama_server(
                os.path.join(LLAMA_BIN, "llama-server"),
                self.a.threads,
                16,
                # each slot holds its share: room for the TTFT prompt and for random prompts that re-tokenize longer
                16 * (max(self.a.input_len + self.a.output_len, self.a.ttft_len) + 256),
                gguf,
            )
        else:
            from llmserve.testing.launcher import ServerProcess

            args = ["--served-model-name", NAME, "--num-threads", str(self.a.threads)]
            parts = self.kind.split("-")[1:]  # llmserve-int8, llmserve-int8-kv16, llmserve-mbt2048, llmserve-gguf ...
            if "gguf" in parts:  # the same GGUF file llama-server serves (a folder of --gguf-only has no safetensors)
                args += ["--model", gguf]
            elif flags:
                args += ["--model", flags]
            for part in parts:
                if part == "gguf":
                    continue
                if part == "kv16":
                    args += ["--kv-cache-dtype", "float16"]
                elif part.startswith("mbt"):  # a chunked-prefill token budget: --max-num-batched-tokens N
                    args += ["--max-num-batched-tokens", part[3:]]
                else:
                    args += ["--quantization", part]
            self.proc = ServerProcess(*args)
            self.proc.wait_ready(timeout=1200)
            self.url = self.proc.url
        return self

    def __exit__(self, *exc):
        if self.kind == "vllm":
            subprocess.run(["bash", vllm_sh(), "stop", str(self.port)], check=False)
            time.sleep(10)  # its engine process lets go of the memory after the API server
        elif self.kind == "llama.cpp":
            self.proc.terminate()
            self.proc.wait(60)
        else:
            self.proc.terminate()


def vllm_bench(url: str, tokenizer: str, d: str, *, n: int, c: int, isl: int, osl: int, prefix: int = 0) -> dict:
    """`vllm bench serve` (completions, random dataset, EOS ignored); parse_result's dict plus the per-request
    TTFTs (ms)."""
    os.makedirs(d, exist_ok=True)
    cmd = [
        "bash",
        vllm_sh(),
        "bench",
        "--backend",
        "openai",
        "--base-url",
        url,
        "--endpoint",
        "/v1/completions",
        "--model",
        NAME,
        "--tokenizer",
        tokenizer,
        "--dataset-name",
        "random",
        "--random-input-len",
        str(isl),
        "--random-output-len",
        str(osl),
        "--random-prefix-len",
        str(prefix),
        "--ignore-eos",
        "--num-prompts",
        str(n),
        "--max-concurrency",
        str(c),
        "--save-result",
        "--save-detailed",
        "--result-dir",
        d,
        "--result-filename",
        "result.json",
        "--disable-tqdm",
    ]
    with open(os.path.join(d, "client.log"), "wb") as log:
        subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=d, env={**os.environ, **OFFLINE})
    try:
        res = parse_result("vllm-completions", d)
        raw = json.load(open(os.path.join(d, "result.json")))
        res["ttfts"] = list(raw.get("ttfts", []))
        res["p99_itl_ms"] = raw.get("p99_itl_ms")
    except Exception as e:  # noqa: BLE001 - a crashed client leaves no result: say so in the table
        res = dict(ok=0, failed=n, out_tok_s=None, ttft_ms=None, errors=[f"{type(e).__name__}: {e}"], ttfts=[])
    return res


def llmserve_bench(url: str, tokenizer: str, d: str, *, n: int, c: int, isl: int, osl: int) -> dict:
    os.makedirs(d, exist_ok=True)
    cmd = [
        sys.executable,
        "-m",
        "llmserve.cli",
        "bench",
        "--base-url",
        url,
        "--model",
        NAME,
        "--endpoint",
        "completions",
        "--concurrency",
        str(c),
        "--num-requests",
        str(n),
        "--dataset",
        "random",
        "--input-len",
        str(isl),
        "--output-len",
        str(osl),
        "--ignore-eos",
        "--tokenizer",
        tokenizer,
        "--metrics-url",
        "none",
        "--no-progress",
        "--output-json",
        f"{d}/bench.json",
        "--timeout",
        "3600",
    ]
    with open(os.path.join(d, "client.log"), "wb") as log:
        subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT, env={**os.environ, "PYTHONPATH": ROOT})
    try:
        return parse_result("llmserve-bench-completions", d)
    except Exception as e:  # noqa: BLE001
        return dict(ok=0, failed=n, out_tok_s=None, ttft_ms=None, errors=[f"{type(e).__name__}: {e}"])


def median(xs: list[float]) -> float | None:
    xs = sorted(xs)
    return xs[len(xs) // 2] if xs else None


def measure(model: str, kind: str, a) -> dict:
    _, folder, _ = model_files(model)
    out = os.path.join(a.out, os.path.basename(model.rstrip("/")), kind)
    res: dict = {"model": model, "server": kind, "runs": {}}
    with Served(kind, model, a) as s:
        # warm-up: a few requests (vLLM compiles per shape; llmserve measures its GEMV/GEMM crossovers)
        vllm_bench(s.url, folder, os.path.join(out, "warmup"), n=4, c=4, isl=a.input_len, osl=8)
        for c in a.concurrency:
            n = a.num_prompts or max(4, c)
            r = vllm_bench(s.url, folder, os.path.join(out, f"c{c}"), n=n, c=c, isl=a.input_len, osl=a.output_len)
            r["load"] = load()
            if a.llmserve_bench:
                b = llmserve_bench(
                    s.url,
                    folder,
                    os.path.join(out, f"c{c}-llmserve-bench"),
                    n=n,
                    c=c,
                    isl=a.input_len,
                    osl=a.output_len,
                )
                r["llmserve_bench_tok_s"] = b.get("out_tok_s")
            res["runs"][c] = r
            print(
                f"{model} {kind:14s} c={c:3d} out tok/s {r['out_tok_s'] or 0:7.1f} failed {r['failed']} "
                f"load {r['load']}",
                flush=True,
            )
        if a.ttft_len:
            cold = vllm_bench(s.url, folder, os.path.join(out, "ttft-cold"), n=3, c=1, isl=a.ttft_len, osl=1)
            warm = vllm_bench(
                s.url, folder, os.path.join(out, "ttft-cached"), n=6, c=1, isl=8, osl=1, prefix=a.ttft_len
            )
            res["ttft_cold_ms"] = median(cold["ttfts"]) and 1e3 * median(cold["ttfts"])
            res["ttft_cached_ms"] = median(warm["ttfts"][1:]) and 1e3 * median(warm["ttfts"][1:])
            res["ttft_load"] = load()
            print(
                f"{model} {kind:14s} TTFT {a.ttft_len} tokens: cold {res['ttft_cold_ms'] or 0:.0f} ms, "
                f"cached {res['ttft_cached_ms'] or 0:.0f} ms",
                flush=True,
            )
    return res


def table(results: list[dict], a) -> str:
    rows = [
        "| model | server | "
        + " | ".join(f"{c} concurrent tok/s (x vLLM), p99 ITL" for c in a.concurrency)
        + f" | TTFT {a.ttft_len} tok cold / cached ms | load |",
        "|---|---|" + "---|" * len(a.concurrency) + "---|---|",
    ]
    for model in a.models:
        mine = [r for r in results if r["model"] == model]
        ref = next((r for r in mine if r["server"] == "vllm"), None)
        for r in mine:
            cells = []
            for c in a.concurrency:
                run = r["runs"].get(c) or {}
                v = run.get("out_tok_s")
                base = ((ref or {}).get("runs", {}).get(c) or {}).get("out_tok_s")
                cell = "-" if v is None else f"{v:.1f}" + (f" ({v / base:.2f}x)" if base and r is not ref else "")
                if run.get("p99_itl_ms"):
                    cell += f", p99 ITL {run['p99_itl_ms']:.0f} ms"
                if run.get("failed"):
                    cell += f", {run['failed']} failed"
                cells.append(cell)
            ttft = (
                f"{r.get('ttft_cold_ms') or 0:.0f} / {r.get('ttft_cached_ms') or 0:.0f}"
                if r.get("ttft_cold_ms")
                else "-"
            )
            loads = ", ".join(str((r["runs"].get(c) or {}).get("load", "")) for c in a.concurrency)
            label = f"vllm --dtype {vllm_dtype(a)}" if r["server"] == "vllm" else r["server"]
            rows.append(
                f"| {os.path.basename(model.rstrip('/'))} | {label} | " + " | ".join(cells) + f" | {ttft} | {loads} |"
            )
    return "\n".join(rows)
