"""Weight modes side by side: float32, bfloat16 (llmserve/model/formats/bf16.py: oneDNN's bf16 matmul, float32
activations), int8 and int4, engine to engine (`LLM.generate`), each mode in its own process, the modes
interleaved over `--rounds` so that a noisy minute hits them alike. Per mode: load time, decode tok/s at
each concurrency (prompts of `--prompt-len` random tokens, `--max-tokens` out, EOS ignored, after a warm-up
of the same prompts: the measured run is decode-bound), and greedy agreement with float32 (the share of
requests whose first `--max-tokens` tokens equal float32's, and the mean length of the common prefix).

Quality per mode (`--quality`, on by default): perplexity on tests/data/alice.txt (public domain; the first
`--text-tokens` tokens, teacher-forced as one prefill, llmserve/model/evaluate.py) and the share of its positions
where the mode's argmax equals float32's. `gguf` is a GGUF file's own quantized blocks (what `--quantization auto`
serves; the bundled model is a Q4_1 file); the other modes widen the blocks first. `--quality-only` skips the
timings: its figures do not need a quiet machine.

    python -m benchmarks.engine.dtype_modes [--model DIR_OR_GGUF] [--modes float32,bfloat16,int8,int4,gguf]
        [--concurrency 1,16] [--rounds 2] [--quality-only] [--no-write]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

from benchmarks.common import ROOT, machine, write_section

MODES = {  # name -> LLM keyword arguments
    "float32": dict(dtype="float32", quantization="none"),  # a GGUF's blocks widened: the exactness mode
    "bfloat16": dict(dtype="bfloat16", quantization="none"),
    "int8": dict(dtype="float32", quantization="int8"),
    "w8a8": dict(dtype="float32", quantization="w8a8"),
    "int4": dict(dtype="float32", quantization="int4"),
    "gguf": dict(dtype="float32", quantization="gguf"),
}
TEXT = os.path.join(ROOT, "tests", "data", "alice.txt")


def quality(llm, text_tokens: int) -> dict:
    """Perplexity on the text and the argmax at each of its positions (teacher-forced, one prefill)."""
    import math

    import torch
    import torch.nn.functional as F

    from llmserve.model.evaluate import sequence_logits

    ids = llm.get_tokenizer().encode(open(TEXT, encoding="utf-8").read())[:text_tokens]
    logits = sequence_logits(llm.engine.model, ids)
    ppl = math.exp(F.cross_entropy(logits[:-1], torch.tensor(ids[1:])).item())
    return {"ppl": ppl, "argmax": logits[:-1].argmax(-1).tolist()}


def child(args) -> None:
    """One mode in this process: prints one JSON line."""
    from llmserve import LLM, SamplingParams

    t0 = time.perf_counter()
    llm = LLM(args.model, num_threads=args.threads, kv_cache_memory=2, max_model_len=1024, **MODES[args.child])
    out = {"load_s": time.perf_counter() - t0, "tok_s": {}, "tokens": {}}
    if args.text_tokens:
        out["quality"] = quality(llm, args.text_tokens)
    prompts = [[(7 * i + j) % 40000 + 100 for j in range(args.prompt_len)] for i in range(64)]
    for c in [] if args.quality_only else args.conc:
        sp = SamplingParams(max_tokens=args.max_tokens, temperature=0, ignore_eos=True)
        llm.generate(prompts[:c], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True), use_tqdm=False)
        t = time.perf_counter()
        outs = llm.generate(prompts[:c], sp, use_tqdm=False)
        out["tok_s"][c] = c * args.max_tokens / (time.perf_counter() - t)
        out["tokens"][c] = [o.outputs[0].token_ids for o in outs]
    print("RESULT " + json.dumps(out), flush=True)


def prefix(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), len(a))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None, help="a Hugging Face folder or GGUF file (default: the bundled model)")
    p.add_argument("--modes", default="float32,bfloat16,int8,int4", help="of " + ",".join(MODES))
    p.add_argument("--concurrency", default="1,16")
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--text-tokens", type=int, default=1024, help="tokens of alice.txt scored (0: no quality pass)")
    p.add_argument("--quality-only", action="store_true", help="perplexity and agreement only, one round, no timing")
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    p.add_argument("--no-write", action="store_true")
    args = p.parse_args()
    args.conc = [int(c) for c in args.concurrency.split(",")]
    if args.quality_only:
        args.rounds, args.conc = 1, []
    if args.child:
        return child(args)
    modes = args.modes.split(",")
    runs: dict[str, list[dict]] = {m: [] for m in modes}
    env = dict(os.environ, LLMSERVE_CPU_BF16="1")
    for r in range(args.rounds):
        for m in modes:
            cmd = [sys.executable, "-m", __spec__.name, "--child", m, "--concurrency", args.concurrency]
            cmd += ["--prompt-len", str(args.prompt_len), "--max-tokens", str(args.max_tokens)]
            cmd += ["--threads", str(args.threads)] + (["--model", args.model] if args.model else [])
            cmd += ["--text-tokens", str(args.text_tokens)] + (["--quality-only"] if args.quality_only else [])
            res = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT)
            line = next((x for x in res.stdout.splitlines() if x.startswith("RESULT ")), None)
            if line is None:
                sys.exit(f"{m}: failed\n{res.stderr[-3000:]}")
            runs[m].append(json.loads(line[7:]))
            print(f"round {r + 1} {m}: " + ", ".join(f"{c}: {v:.1f}" for c, v in runs[m][-1]["tok_s"].items()))
    ref = runs.get("float32", [None])[0]
    qtable = quality_table(runs, modes)
    if args.quality_only:
        print(qtable)
        if not args.no_write:
            n = len(next(iter(runs.values()))[0]["quality"]["argmax"]) + 1
            write_section(f"Quality per weight mode ({_name(args.model)})", _quality_body(args, qtable, n))
        return
    conc = [str(c) for c in args.conc]
    head = "| mode | load s | " + " | ".join(f"{c} conc tok/s (x float32)" for c in conc) + " | greedy = float32 |"
    rows = [head, "|" + "---|" * (len(conc) + 3)]
    for m in modes:
        med = {c: statistics.median(r["tok_s"][c] for r in runs[m]) for c in conc}
        base = {c: statistics.median(r["tok_s"][c] for r in runs["float32"]) for c in conc} if ref else None
        cells = [f"{med[c]:.1f}" + (f" ({med[c] / base[c]:.2f}x)" if base else "") for c in conc]
        agree = ""
        if ref:
            a, b = runs[m][0]["tokens"][conc[-1]], ref["tokens"][conc[-1]]
            same = sum(x == y for x, y in zip(a, b))
            mean = statistics.mean(prefix(x, y) for x, y in zip(a, b))
            agree = f"{same}/{len(a)} requests, common prefix {mean:.0f}/{args.max_tokens}"
        load = statistics.median(r["load_s"] for r in runs[m])
        rows.append(f"| {m} | {load:.1f} | " + " | ".join(cells) + f" | {agree} |")
    table = "\n".join(rows) + ("\n\n" + qtable if qtable else "")
    print(table)
    if not args.no_write:
        model = args.model or "bundled SmolLM2-135M-Instruct"
        body = (
            f"`python -m benchmarks.engine.dtype_modes {' '.join(sys.argv[1:])}` ({time.strftime('%Y-%m-%d')}, "
            f"{machine()}; "
            f"model {os.path.basename(str(model).rstrip('/'))}; {args.prompt_len} tokens in, {args.max_tokens} out, "
            f"median of {args.rounds} interleaved rounds, LLM.generate)\n\n{table}\n"
        )
        write_section(f"Weight modes: float32, bfloat16, int8, int4 ({os.path.basename(str(model).rstrip('/'))})", body)


def _name(model: str | None) -> str:
    return os.path.basename(str(model).rstrip("/")) if model else "bundled SmolLM2-135M-Instruct"


def quality_table(runs: dict[str, list[dict]], modes: list[str]) -> str:
    """Perplexity per mode, its ratio to float32's and the share of positions whose argmax is float32's."""
    if not all("quality" in runs[m][0] for m in modes):
        return ""
    ref = runs["float32"][0]["quality"] if "float32" in runs else None
    rows = ["| mode | perplexity | x float32 | argmax = float32's |", "|---|---|---|---|"]
    for m in modes:
        q = runs[m][0]["quality"]
        ratio = agree = "-"
        if ref:
            ratio = f"{q['ppl'] / ref['ppl']:.4f}"
            same = sum(a == b for a, b in zip(q["argmax"], ref["argmax"]))
            agree = f"{100 * same / len(ref['argmax']):.1f}% of {len(ref['argmax'])}"
        rows.append(f"| {m} | {q['ppl']:.3f} | {ratio} | {agree} |")
    return "\n".join(rows)


def _quality_body(args, table: str, n: int) -> str:
    return (
        f"`python -m benchmarks.engine.dtype_modes {' '.join(sys.argv[1:])}` ({time.strftime('%Y-%m-%d')}, "
        f"{machine()}; model {_name(args.model)}): perplexity on tests/data/alice.txt (its first {n} tokens), "
        "teacher-forced as one prefill, and the share of its positions where the mode's argmax "
        "is float32's (float32: the exactness mode, greedy = transformers'). bfloat16 runs oneDNN's bf16 matmul "
        "where the CPU has AVX512-BF16 (LLMSERVE_CPU_BF16=1 here); gguf is the file's own blocks.\n\n" + table + "\n"
    )


if __name__ == "__main__":
    main()
