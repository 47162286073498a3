"""The engines the peers comparisons measure, one function or class each: llmserve offline (`LLM.generate`) and
through `llmserve serve`, transformers in this process, llama.cpp's llama-server, and requests over HTTP to any
OpenAI-compatible server. `compare.py` (and `benchmarks.engine.kv_dtype`) put them side by side."""

from __future__ import annotations

import asyncio
import os
import statistics
import time

import httpx
import psutil
import torch

from benchmarks.common import ALICE, ROOT, start_llama_server
from llmserve.testing.launcher import ServerProcess

MODEL = "SmolLM2-135M-Instruct"  # llmserve's name for the bundled model


def prompt_windows(tok, n: int = 512) -> list[list[int]]:
    """Three windows of n tokens of tests/data/alice.txt (repeated), 40 tokens apart: no prefix cache helps."""
    with open(ALICE) as f:
        ids = tok.encode(f.read() * 2)
    return [ids[o : o + n] for o in (0, 40, 80)]


def llmserve_offline(quantization, threads, prompts, max_tokens) -> dict:
    """Offline batched throughput, single stream and the TTFT of a 512-token prompt (median of 3 windows)."""
    from llmserve import LLM, SamplingParams

    llm = LLM(num_threads=threads, quantization=quantization, kv_cache_memory=1.0)
    tok = llm.get_tokenizer()
    ids = [tok.encode_chat(p) for p in prompts]
    greedy = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    llm.generate(ids[:2], SamplingParams(max_tokens=4, temperature=0), use_tqdm=False)  # warm-up
    t = time.perf_counter()
    outs = llm.generate(ids, greedy, use_tqdm=False)
    batched = sum(len(o.outputs[0].token_ids) for o in outs) / (time.perf_counter() - t)
    t = time.perf_counter()
    one = llm.generate(ids[:1], greedy, use_tqdm=False)
    single = len(one[0].outputs[0].token_ids) / (time.perf_counter() - t)
    ttfts = []
    for w in prompt_windows(tok):
        t = time.perf_counter()
        llm.generate([w], SamplingParams(max_tokens=1, temperature=0), use_tqdm=False)
        ttfts.append(time.perf_counter() - t)
    res = dict(batched=batched, single=single, ttft512=statistics.median(ttfts))
    print(f"llmserve {quantization or 'none'}: {res}", flush=True)
    del llm
    return res


def speculative(threads) -> dict:
    """Single stream on a copy-and-edit task, with and without --speculative-ngram 4 (same run)."""
    from llmserve import LLM, SamplingParams

    with open(os.path.join(ROOT, "llmserve", "engine", "ngram.py")) as f:
        code = f.read()[:1800]
    msgs = [[{"role": "user", "content": "Rewrite this code, adding a comment above each function:\n\n" + code}]]
    p = SamplingParams(max_tokens=256, temperature=0)
    out = {}
    for k in (0, 4):
        llm = LLM(num_threads=threads, speculative_ngram=k, kv_cache_memory=0.5)
        llm.chat(msgs, SamplingParams(max_tokens=4, temperature=0), use_tqdm=False)
        t = time.perf_counter()
        o = llm.chat(msgs, p, use_tqdm=False)[0]
        n = len(o.outputs[0].token_ids)
        out[k] = dict(
            tok_s=n / (time.perf_counter() - t),
            tokens=n,
            ids=o.outputs[0].token_ids,
            accepted=llm.engine.num_spec_accepted,
            proposed=llm.engine.num_spec_proposed,
        )
        del llm
    print({k: {a: b for a, b in v.items() if a != "ids"} for k, v in out.items()}, flush=True)
    return out


class Transformers:
    """transformers' float32 load of the bundled GGUF, in this process: `generate` one prompt alone."""

    def __init__(self, threads: int) -> None:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        from llmserve.model.loader import bundled_model_path

        torch.set_num_threads(threads)
        path = bundled_model_path()
        kw = dict(gguf_file=os.path.basename(path))
        self.model = AutoModelForCausalLM.from_pretrained(os.path.dirname(path), torch_dtype=torch.float32, **kw).eval()
        self.tok = AutoTokenizer.from_pretrained(os.path.dirname(path), **kw)

    def single(self, msgs, max_tokens: int) -> float:
        """Decode tok/s of one chat prompt, exactly max_tokens tokens (prefill included)."""
        text = self.tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
        x = torch.tensor([self.tok.encode(text, add_special_tokens=False)])
        with torch.inference_mode():
            t = time.perf_counter()
            out = self.model.generate(x, max_new_tokens=max_tokens, min_new_tokens=max_tokens, do_sample=False)
            return (out.shape[1] - x.shape[1]) / (time.perf_counter() - t)

    def ttft(self, ids: list[int]) -> float:
        with torch.inference_mode():
            t = time.perf_counter()
            self.model.generate(torch.tensor([ids]), max_new_tokens=1, do_sample=False)
            return time.perf_counter() - t


def transformers_numbers(threads, prompts, max_tokens) -> dict:
    """Single stream (after a 4-token warm-up) and the TTFT of a 512-token prompt (median of 3 windows)."""
    hf = Transformers(threads)
    hf.single(prompts[0], 4)  # warm-up
    single = hf.single(prompts[0], max_tokens)
    ttfts = [hf.ttft(w) for w in prompt_windows(hf.tok)]
    res = dict(single=single, ttft512=statistics.median(ttfts))
    print(f"transformers: {res}", flush=True)
    return res


async def _load(url: str, model: str, prompts, concurrency: int, max_tokens: int) -> float:
    """Output tok/s of every prompt through /v1/chat/completions at `concurrency` (after one warm-up request)."""
    sem = asyncio.Semaphore(concurrency)

    async def one(client, msgs):
        async with sem:
            r = await client.post(
                url + "/v1/chat/completions",
                json={"model": model, "messages": msgs, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True},
            )
            r.raise_for_status()
            return r.json()["usage"]["completion_tokens"]

    async with httpx.AsyncClient(timeout=900) as client:
        await one(client, prompts[0])  # warm-up
        t = time.perf_counter()
        n = sum(await asyncio.gather(*(one(client, p) for p in prompts)))
        return n / (time.perf_counter() - t)


def serve_numbers(flags: list[str], threads, prompts, max_tokens, load: bool = True, concurrency: int = 16) -> dict:
    """`llmserve serve FLAGS`: tok/s at `concurrency` (key c16 for 16) and the server's RSS after that load."""
    srv = ServerProcess("--num-threads", str(threads), "--log-level", "warning", "--kv-cache-memory", "1", *flags)
    try:
        srv.wait_ready(timeout=600)
        tok_s = asyncio.run(_load(srv.url, MODEL, prompts if load else prompts[:2], concurrency, max_tokens))
        rss = psutil.Process(srv.proc.pid).memory_info().rss
    finally:
        srv.terminate()
    res = {f"c{concurrency}": tok_s if load else None, "rss_mib": rss / 2**20}
    print(f"llmserve serve {' '.join(flags)}: {res}", flush=True)
    return res


def llama_numbers(binary: str, threads, prompts, max_tokens) -> dict:
    """llama-server on the bundled GGUF: tok/s at 16 concurrent, single stream, RSS."""
    proc, url = start_llama_server(binary, threads, slots=16, context=16 * 1024)
    try:
        c16 = asyncio.run(_load(url, "any", prompts, 16, max_tokens))
        single = asyncio.run(_load(url, "any", prompts[:2], 1, max_tokens))
        rss = psutil.Process(proc.pid).memory_info().rss
    finally:
        proc.terminate()
        proc.wait()
    res = dict(c16=c16, single=single, rss_mib=rss / 2**20)
    print(f"llama.cpp: {res}", flush=True)
    return res


def http_single(url: str, model: str, msgs, max_tokens: int) -> float:
    """One chat request of max_tokens tokens (EOS ignored): output tok/s over the request's time."""
    t = time.perf_counter()
    r = httpx.post(
        url + "/v1/chat/completions",
        timeout=600,
        json={"model": model, "messages": msgs, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True},
    )
    r.raise_for_status()
    return r.json()["usage"]["completion_tokens"] / (time.perf_counter() - t)


def http_ttft(url: str, model: str, ids: list[int]) -> float:
    """One completions request of the token ids, one output token: its time is the TTFT."""
    t = time.perf_counter()
    r = httpx.post(
        url + "/v1/completions", timeout=600, json={"model": model, "prompt": ids, "max_tokens": 1, "temperature": 0}
    )
    r.raise_for_status()
    return time.perf_counter() - t
