"""The quality of llmserve's weight modes on a GGUF file, judged against llama.cpp's own output on the same file
(never in CI: llama.cpp is a peer). For each file and each llmserve mode (`gguf`: the default, the file's own blocks;
`none`: float32-exact):

  * greedy: llama-server's 256-token greedy continuation of 8 prompts (the same token ids sent to both, EOS
    ignored) against llmserve's; at the first divergence llama.cpp's token must be in llmserve's top-5 and
    llmserve's in llama.cpp's (vLLM's rule for reduced precision: `llmserve.model.evaluate.top_k_divergence`);
    also the tokens the two share before they part;
  * teacher-forced: llama.cpp's continuations fed to llmserve as prompts (prompt logprobs): the share of
    positions where llmserve's argmax is llama.cpp's token (target >= 97%);
  * perplexity on a text (default /usr/share/common-licenses/GPL-3) in windows of --ctx tokens, each scored on its
    second half as llama-perplexity scores it, against llama-perplexity's own figure (target within 1%).

    python -m benchmarks.peers.gguf_quality [--gguf FILE ...] [--modes gguf,none] [--tokens 256] [--no-write]

llama.cpp's tools come from shared/peers/llama-cpp.sh (`build`, plus `cmake --build ... -t llama-perplexity`).
Without --gguf: the bundled Q4_1 file and its Q4_K_M and Q8_0 requantizations by llama-quantize.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import subprocess
import tempfile

import httpx

from benchmarks.common import start_llama_server, write_section
from benchmarks.peers.servers import PEERS
from llmserve.model.evaluate import top_k_divergence

BIN = os.path.join(PEERS, "llama.cpp", "build", "bin")
PROMPTS = [
    "The history of the printing press begins",
    "def merge_sort(items):\n",
    "Photosynthesis is the process by which",
    "Here is a recipe for sourdough bread. First,",
    "The three laws of thermodynamics are",
    "Dear hiring manager, I am writing to apply for",
    "In computer networks, a TCP handshake",
    "Once upon a time, in a small village by the sea,",
]


def requantize(src: str, kind: str, out_dir: str) -> str:
    out = os.path.join(out_dir, f"{os.path.basename(src).rsplit('.', 2)[0]}.{kind}.gguf")
    if not os.path.exists(out):
        subprocess.run(
            [os.path.join(BIN, "llama-quantize"), "--allow-requantize", src, out, kind],
            check=True,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
    return out


def llama_continuations(path: str, prompts: list[list[int]], n: int, threads: int) -> list[tuple[list, list]]:
    """llama-server's greedy tokens and their top-5 ids per position, for prompts given as token ids."""
    proc, url = start_llama_server(os.path.join(BIN, "llama-server"), threads, 1, 4096, model=path)
    try:
        out = []
        for ids in prompts:
            body = {
                "prompt": ids,
                "n_predict": n,
                "temperature": 0,
                "top_k": 1,
                "n_probs": 5,
                "ignore_eos": True,
                "cache_prompt": False,
                "return_tokens": True,
            }
            r = httpx.post(url + "/completion", json=body, timeout=600).json()
            probs = r["completion_probabilities"]
            tokens = [p["id"] for p in probs]
            tops = [[t["id"] for t in p["top_logprobs"]] for p in probs]
            out.append((tokens, tops))
        return out
    finally:
        proc.terminate()
        proc.wait()


def llama_perplexity(path: str, text: str, ctx: int, threads: int) -> tuple[float, int]:
    r = subprocess.run(
        [os.path.join(BIN, "llama-perplexity"), "-m", path, "-f", text, "-c", str(ctx), "-t", str(threads)],
        capture_output=True,
        text=True,
        check=True,
    )
    log = r.stdout + r.stderr
    ppl = float(re.search(r"Final estimate: PPL = ([0-9.]+)", log).group(1))
    chunks = int(re.search(r"calculating perplexity over (\d+) chunks", log).group(1))
    return ppl, chunks


def llmserve_scores(llm, prompts, conts, text_ids: list[int], ctx: int, chunks: int, n: int, bos: int | None):
    from llmserve import SamplingParams

    greedy = SamplingParams(max_tokens=n, temperature=0, ignore_eos=True, logprobs=5)
    outs = [o.outputs[0] for o in llm.generate(prompts, greedy, use_tqdm=False)]
    diverge, shared = [], []
    for o, (tokens, tops) in zip(outs, conts):
        mine = [[t.token_id for t in lp.top] for lp in o.logprobs]
        why = top_k_divergence(list(o.token_ids), mine, tokens, tops, k=5)
        diverge.append(why)
        same = next((i for i, (a, b) in enumerate(zip(o.token_ids, tokens)) if a != b), len(tokens))
        shared.append(same)
    forced = SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=1)
    hits = total = 0
    for ids, (tokens, _) in zip(prompts, conts):
        lps = llm.generate([ids + tokens], forced, use_tqdm=False)[0].prompt_logprobs
        for lp in lps[len(ids) :]:
            hits += lp.rank == 1
            total += 1
    nll, count = 0.0, 0
    windows = []
    for c in range(chunks):
        w = text_ids[c * ctx : (c + 1) * ctx]
        if bos is not None:
            w = [bos] + w[1:]
        windows.append(w)
    score = SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=0)
    for o in llm.generate(windows, score, use_tqdm=False):
        for lp in o.prompt_logprobs[ctx // 2 + 1 :]:  # tokens ctx/2+1 .. ctx-1: llama-perplexity's second half
            nll -= lp.logprob
            count += 1
    return {
        "top5_ok": sum(d is None for d in diverge),
        "failures": [d for d in diverge if d],
        "shared_median": sorted(shared)[len(shared) // 2],
        "forced_agree": hits / max(total, 1),
        "ppl": math.exp(nll / max(count, 1)),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--gguf", nargs="*", default=None)
    p.add_argument("--modes", default="gguf,none")
    p.add_argument("--tokens", type=int, default=256)
    p.add_argument("--ctx", type=int, default=512)
    p.add_argument("--text", default="/usr/share/common-licenses/GPL-3")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--llm-args", default="{}", help="more LLM(...) settings, JSON")
    p.add_argument("--no-write", action="store_true")
    a = p.parse_args()
    from llmserve import LLM
    from llmserve.model.loader import bundled_model_path

    files = a.gguf
    if not files:
        tmp = os.path.join(tempfile.gettempdir(), "llmserve-requant")
        os.makedirs(tmp, exist_ok=True)
        b = bundled_model_path()
        files = [b, requantize(b, "Q4_K_M", tmp), requantize(b, "Q8_0", tmp)]
    rows = []
    extra = json.loads(a.llm_args)
    for path in files:
        name = os.path.basename(path)
        # llama.cpp's figures, kept per file (its size and time) so that a rerun of llmserve's side skips them
        cache = os.path.join(tempfile.gettempdir(), f"gguf-quality-{name}-{os.path.getsize(path)}-{a.tokens}.json")
        ref = json.load(open(cache)) if os.path.exists(cache) else {}
        if "ppl" not in ref:
            ref["ppl"], ref["chunks"] = llama_perplexity(path, a.text, a.ctx, a.threads)
        ppl_ref, chunks = ref["ppl"], ref["chunks"]
        conts = ref.get("conts")
        for mode in a.modes.split(","):
            kw = {"quantization": mode} if mode != "none" else {"quantization": "none", "dtype": "float32"}
            llm = LLM(model=path, kv_cache_memory=1.0, max_model_len=4096, **kw, **extra)
            tok = llm.engine.tokenizer
            prompts = [tok.encode(t) for t in PROMPTS]
            if conts is None:
                conts = ref["conts"] = llama_continuations(path, prompts, a.tokens, a.threads)
                json.dump(ref, open(cache, "w"))
            text_ids = tok.encode(open(a.text).read())
            bos = tok.bos_token_id if tok.encode("a")[:1] == [tok.bos_token_id] else None  # llama.cpp's add_bos
            s = llmserve_scores(llm, prompts, conts, text_ids, a.ctx, chunks, a.tokens, bos)
            rows.append((name, mode, ppl_ref, s))
            print(name, mode, f"llama.cpp PPL {ppl_ref:.4f}", s, flush=True)
            del llm
    body = [
        "`python -m benchmarks.peers.gguf_quality` (llama.cpp from shared/peers/llama-cpp.sh, the same file for both).",
        f"Greedy: {len(PROMPTS)} prompts x {a.tokens} tokens, EOS ignored, the same token ids sent to both;",
        "teacher-forced on llama.cpp's continuations; perplexity on GPL-3's text in",
        f"{a.ctx}-token windows, second halves scored (llama-perplexity's method).",
        "",
        "| file | llmserve mode | top-5 rule at first divergence | tokens equal before it (median) | "
        "teacher-forced argmax = llama.cpp | PPL llmserve | PPL llama.cpp | PPL ratio |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for name, mode, ref, s in rows:
        body.append(
            f"| {name} | {mode} | {s['top5_ok']}/{len(PROMPTS)} | {s['shared_median']} | "
            f"{100 * s['forced_agree']:.1f}% | {s['ppl']:.4f} | {ref:.4f} | {s['ppl'] / ref:.4f} |"
        )
    fails = [f for _, _, _, s in rows for f in s["failures"]]
    if fails:
        body += ["", "Top-5 rule failures: " + "; ".join(fails)]
    print("\n".join(body))
    if not a.no_write:
        write_section("GGUF weight modes against llama.cpp's output", "\n".join(body))


if __name__ == "__main__":
    main()
