"""One image per request: llmserve against llama.cpp's `llama-server --mmproj` on the same GGUF pair (issue #36).

The pair: a random-weight checkpoint of SmolVLM-256M-Instruct's shapes (Idefics3: a 30-layer 576-wide SmolLM2
decoder, a 12-layer 768-wide SigLIP tower of 512x512 tiles in 16-pixel patches, 4x4 pixel shuffle: 64 image
tokens a tile), the bundled SmolLM2 tokenizer with the image tokens added (tests/vision_files.py), the image
processor resizing to 1024 a side (2x2 tiles and the whole picture: 5 tiles, 320 image tokens), written with
transformers and converted by llama.cpp's own convert_hf_to_gguf.py: the text GGUF (q8_0) and the projector
(`--mmproj`, f16). Made once, kept in ~/ckpt/smolvlm-256m/.

One server at a time on the same threads (llmserve serve --model TEXT --mmproj MMPROJ; llama-server -m TEXT
--mmproj MMPROJ -np SLOTS -cb -t THREADS), over the OpenAI chat API (httpx): each request is one PNG (a different
synthetic picture each, so no cache helps) and ~20 words, greedy, `max_tokens` output tokens with EOS ignored
(`ignore_eos`; llama.cpp: `n_predict` too). First, that the server sees the image: prompt tokens with the image
and without it (usage). Then median TTFT (streaming, one at a time, after a warm-up) and output throughput with
`--concurrency` requests in flight (`--requests` in all); peak RSS of the server process.

    PYTHONPATH=.:/work/.sp python -m benchmarks.serving.vision_peers [--ttft-runs 5] [--requests 8]
        [--concurrency 4] [--tokens 32] [--threads 2] [--only llmserve,llama.cpp] [--no-write]

(/work/.sp: sentencepiece, which llama.cpp's converter imports.)
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import io
import json
import os
import statistics
import subprocess
import sys
import time

import httpx

from benchmarks.common import CKPT, machine, start_llama_server, write_section
from benchmarks.peers.gguf_loader import LLAMA_SERVER, PeakRSS

PAIR = os.path.join(CKPT, "smolvlm-256m")
TEXT, MMPROJ = os.path.join(PAIR, "model-Q8_0.gguf"), os.path.join(PAIR, "mmproj-F16.gguf")
NAME = "smolvlm"
# SmolVLM-256M-Instruct's config (the public config.json): the decoder (llama) and the SigLIP tower
SMOLVLM_256M = dict(
    text=dict(
        architectures=["VLlama3ForCausalLM"],  # (what llama.cpp's converter reads the decoder as)
        hidden_size=576,
        intermediate_size=1536,
        num_hidden_layers=30,
        num_attention_heads=9,
        num_key_value_heads=3,
        head_dim=64,
        rms_norm_eps=1e-5,
        rope_parameters={"rope_type": "default", "rope_theta": 100000.0},
        max_position_embeddings=8192,
    ),
    vision=dict(hidden_size=768, intermediate_size=3072, num_hidden_layers=12, num_attention_heads=12, image_size=512),
    patch_size=16,
    scale_factor=4,
    # 1024 a side: 2x2 tiles and the whole picture, 5 tower passes in both servers (at 512, llama.cpp's mtmd slices the
    # one tile and adds the overview, two passes, where transformers' processor and llmserve run one; SmolVLM's
    # own processor goes to 2048, 17 passes)
    longest_edge=1024,
    loud=False,
)
WORDS = [
    "Describe this picture in a few words, then say which colours you see most and where they are.",
    "What shapes are in this image? List them briefly and say roughly where each one of them sits.",
    "Look at the picture and tell me whether it looks like a photo, a drawing or random noise, and why.",
    "Give this image a short title, then explain in one sentence what made you choose that title.",
]


def make_pair(llama_cpp: str) -> tuple[str, str]:
    """The GGUF pair, made once: the checkpoint folder (transformers), then llama.cpp's converter twice."""
    if os.path.exists(TEXT) and os.path.exists(MMPROJ):
        return TEXT, MMPROJ
    import pathlib

    from llmserve.model.loader import bundled_model_path
    from tests.vision_files import write_idefics3

    folder = pathlib.Path(PAIR) / "hf"
    if not (folder / "model.safetensors").exists():
        folder.mkdir(parents=True, exist_ok=True)
        write_idefics3(folder, bundled_model_path(), shapes=SMOLVLM_256M)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [llama_cpp, os.getenv("PYTHONPATH")]))}
    for path, flags in ((TEXT, ["--outtype", "q8_0"]), (MMPROJ, ["--outtype", "f16", "--mmproj"])):
        run = subprocess.run(
            [sys.executable, os.path.join(llama_cpp, "convert_hf_to_gguf.py"), str(folder), *flags, "--outfile", path],
            capture_output=True,
            text=True,
            env=env,
        )
        if run.returncode or not os.path.exists(path):
            raise SystemExit(f"llama.cpp's converter failed on {folder} ({' '.join(flags)}):\n{run.stderr[-3000:]}")
    return TEXT, MMPROJ


def picture(i: int, side: int = 512) -> str:
    """A different synthetic PNG for each `i` (stripes, a disc and noise), as a data: URL."""
    import numpy as np
    from PIL import Image, ImageDraw

    rng = np.random.default_rng(i)
    arr = rng.integers(0, 64, (side, side, 3), dtype=np.uint8)
    arr[:, :, i % 3] += np.uint8(128) * ((np.arange(side) // (8 + 4 * (i % 5))) % 2).astype(np.uint8)[None, :]
    img = Image.fromarray(arr)
    r = side // 4 + (i * 37) % (side // 4)
    c = (side // 2 + (i * 53) % (side // 3) - side // 6,) * 2
    ImageDraw.Draw(img).ellipse([c[0] - r, c[1] - r, c[0] + r, c[1] + r], fill=tuple(rng.integers(0, 255, 3).tolist()))
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def body(i: int, tokens: int, image: bool = True, stream: bool = False) -> dict:
    content = [{"type": "image_url", "image_url": {"url": picture(i)}}] if image else []
    b = {
        "model": NAME,
        "messages": [{"role": "user", "content": content + [{"type": "text", "text": WORDS[i % len(WORDS)]}]}],
        "max_tokens": tokens,
        "temperature": 0,
        "ignore_eos": True,
        "n_predict": tokens,  # (llama.cpp's name)
    }
    if stream:
        b.update(stream=True, stream_options={"include_usage": True})
    return b


def chat(url: str, b: dict) -> dict:
    r = httpx.post(url + "/v1/chat/completions", json=b, timeout=600)
    r.raise_for_status()
    return r.json()


def ttft(url: str, b: dict) -> float:
    """Seconds from sending to the first streamed chunk with content."""
    t = time.perf_counter()
    first = None
    with httpx.stream("POST", url + "/v1/chat/completions", json=b, timeout=600) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            choices = json.loads(line[6:]).get("choices") or []
            if first is None and choices and (choices[0].get("delta") or {}).get("content"):
                first = time.perf_counter() - t
    if first is None:
        raise RuntimeError(f"{url}: no content streamed")
    return first


async def throughput(url: str, n: int, concurrency: int, tokens: int, offset: int) -> tuple[float, list[int]]:
    """Output tokens per second with `concurrency` requests in flight, `n` in all (each its own picture)."""
    gate = asyncio.Semaphore(concurrency)

    async def one(client, i):
        async with gate:
            r = await client.post(url + "/v1/chat/completions", json=body(offset + i, tokens))
            r.raise_for_status()
            return r.json()["usage"]["completion_tokens"]

    async with httpx.AsyncClient(timeout=3600) as client:
        t = time.perf_counter()
        counts = await asyncio.gather(*(one(client, i) for i in range(n)))
        return sum(counts) / (time.perf_counter() - t), counts


def serve(kind: str, a):
    """(URL, pid, stop) of the server, once ready."""
    if kind == "llama.cpp":
        context = a.slots * 2048  # per slot: the image's tokens, the words and the output, with room
        proc, url = start_llama_server(LLAMA_SERVER, a.threads, a.slots, context, TEXT, ("--mmproj", MMPROJ))
        if proc.poll() is not None:
            raise RuntimeError(f"llama-server exited with {proc.returncode}")
        return url, proc.pid, lambda: (proc.terminate(), proc.wait(60))
    from llmserve.testing.launcher import ServerProcess

    srv = ServerProcess(
        *("--model", TEXT, "--mmproj", MMPROJ, "--served-model-name", NAME, "--num-threads", str(a.threads)),
        *("--kv-cache-memory", str(a.kv_gib), "--max-model-len", "2048", "--log-level", "warning"),
    )
    srv.wait_ready(timeout=1200)
    return srv.url, srv.proc.pid, srv.terminate


def run(kind: str, a) -> dict:
    url, pid, stop = serve(kind, a)
    sampler = PeakRSS(pid)
    sampler.start()
    try:
        # does it see the image: prompt tokens with and without it (the same words)
        with_image = chat(url, body(0, 1))["usage"]["prompt_tokens"]
        without = chat(url, body(0, 1, image=False))["usage"]["prompt_tokens"]
        ttft(url, body(1, a.tokens, stream=True))  # warm-up
        ttfts = [ttft(url, body(2 + i, a.tokens, stream=True)) for i in range(a.ttft_runs)]
        rate, counts = asyncio.run(throughput(url, a.requests, a.concurrency, a.tokens, 2 + a.ttft_runs))
    finally:
        sampler.stop = True
        stop()
    res = dict(
        server=kind,
        prompt_tokens_with_image=with_image,
        prompt_tokens_text_only=without,
        ttft_ms=[round(t * 1000, 1) for t in ttfts],
        ttft_median_ms=statistics.median(ttfts) * 1000,
        output_tok_s=rate,
        completion_tokens=counts,
        peak_rss_gib=sampler.peak / 2**30,
    )
    print(json.dumps(res), flush=True)
    return res


def table(rows: list[dict], a) -> str:
    lines = [
        "| server | prompt tokens: with the image / words only | median TTFT (ms) | "
        f"output tok/s, {a.concurrency} concurrent | output tokens a request | peak RSS (GiB) |",
        "|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['server']} | {r['prompt_tokens_with_image']} / {r['prompt_tokens_text_only']} | "
            f"{r['ttft_median_ms']:.0f} | {r['output_tok_s']:.1f} | {sorted(set(r['completion_tokens']))} | "
            f"{r['peak_rss_gib']:.2f} |"
        )
    by = {r["server"]: r for r in rows}
    if {"llmserve", "llama.cpp"} <= by.keys():
        ours, theirs = by["llmserve"], by["llama.cpp"]
        lines.append(
            f"\nllmserve / llama.cpp: TTFT {ours['ttft_median_ms'] / theirs['ttft_median_ms']:.2f}x (lower is "
            f"better), throughput {ours['output_tok_s'] / theirs['output_tok_s']:.2f}x (higher is better)."
        )
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--llama-cpp", default=os.path.expanduser("~/.cache/llmserve-peers/llama.cpp"))
    ap.add_argument("--only", default="llmserve,llama.cpp", help="comma-separated servers, run in this order")
    ap.add_argument("--ttft-runs", type=int, default=5)
    ap.add_argument("--requests", type=int, default=8)
    ap.add_argument("--concurrency", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--slots", type=int, default=4, help="llama-server's -np")
    ap.add_argument("--kv-gib", type=float, default=0.5, help="llmserve's --kv-cache-memory")
    ap.add_argument("--no-write", action="store_true")
    a = ap.parse_args()
    make_pair(a.llama_cpp)
    rows = [run(kind, a) for kind in a.only.split(",")]
    print(table(rows, a))
    if a.no_write:
        return
    command = " ".join(["python -m benchmarks.serving.vision_peers", *sys.argv[1:]])
    write_section(
        "One image per request vs llama-server --mmproj",
        f"`{command}` ({machine()}). The pair: {os.path.basename(TEXT)} + {os.path.basename(MMPROJ)}, random "
        "weights of SmolVLM-256M-Instruct's shapes converted by llama.cpp's convert_hf_to_gguf.py; a 512x512 PNG "
        "(resized to 1024: 2x2 tiles and the whole, 5 tower passes), "
        f"(a different one each request) and ~20 words a request, {a.tokens} output tokens (EOS ignored), greedy; "
        f"TTFT: median of {a.ttft_runs} streamed requests one at a time after a warm-up; throughput: {a.requests} "
        f"requests, {a.concurrency} in flight; llama-server -np {a.slots} -cb -t {a.threads}, llmserve "
        f"--num-threads {a.threads}. One server at a time.\n\n" + table(rows, a),
    )


if __name__ == "__main__":
    main()
