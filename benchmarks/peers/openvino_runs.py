"""llmserve against OpenVINO GenAI, engine to engine (issue #32): OpenVINO's `ContinuousBatchingPipeline` on
the model exported by optimum-intel (`shared/peers/openvino.sh export`: fp32, int8 or int4 weights) against
llmserve's `LLM.generate` on the same Hugging Face folder (defaults, `--quantization int8`, `int4`).

The load is the issue's: --prompts text prompts of --prompt-len tokens (windows of tests/data/alice.txt, 40
tokens apart, so no two share a block-sized prefix; prefix caching off in both), --max-tokens output tokens
each with EOS ignored, at most --max-num-seqs at once, greedy. Each engine runs in its own process after a
warm-up request, one after another, modes interleaved (OpenVINO fp32, llmserve defaults, OpenVINO int8, ...)
so each pair ran minutes apart at most. Exports are cached in $PEERS/ov-models. Never in CI.

    python -m benchmarks.peers.compare openvino [--models bundled ~/ckpt/llama-1b] [--modes fp32,int8,int4]
        [--prompts 48] [--prompt-len 256] [--max-tokens 128] [--max-num-seqs 16] [--threads 2] [--no-write]
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time

from benchmarks.common import ALICE, ROOT, write_section
from benchmarks.peers.servers import PEERS, hf_folder

OV_SH = os.path.join(os.path.dirname(ROOT), "shared", "peers", "openvino.sh")
QUANT = {"fp32": None, "int8": "int8", "int4": "int4"}  # OpenVINO's weight format -> llmserve's --quantization


def text_prompts(folder: str, n: int, length: int) -> list[str]:
    """n windows of `length` tokens of alice.txt (repeated), 40 tokens apart, as text."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(folder)
    with open(ALICE) as f:
        ids = tok.encode(f.read() * 4, add_special_tokens=False)
    return [tok.decode(ids[40 * i : 40 * i + length]) for i in range(n)]


def ov_export(folder: str, name: str, fmt: str) -> str:
    out = os.path.join(PEERS, "ov-models", f"{name}-{fmt}")
    if not os.path.exists(os.path.join(out, "openvino_model.xml")):
        subprocess.run(["bash", OV_SH, "export", folder, out, fmt], check=True)
    return out


def ov_run(ov_dir: str, prompts_file: str, args) -> dict:
    cmd = ["bash", OV_SH, "bench", ov_dir, prompts_file, str(args.max_tokens), str(args.max_num_seqs)]
    res = subprocess.run(cmd, capture_output=True, text=True, check=True)
    return json.loads(res.stdout.strip().splitlines()[-1])


def llmserve_run(folder: str | None, quantization: str | None, prompts_file: str, args) -> dict:
    cmd = [sys.executable, "-m", __spec__.name, "--child", prompts_file, "--threads", str(args.threads)]
    cmd += ["--max-tokens", str(args.max_tokens), "--max-num-seqs", str(args.max_num_seqs)]
    cmd += (["--model", folder] if folder else []) + (["--quantization", quantization] if quantization else [])
    res = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
    line = next((x for x in res.stdout.splitlines() if x.startswith("RESULT ")), None)
    if line is None:
        sys.exit(f"llmserve {quantization}: failed\n{res.stderr[-3000:]}")
    return json.loads(line[7:])


def child(argv: list[str]) -> None:
    """One llmserve run in this process: prints RESULT and a JSON line like openvino.sh bench's."""
    import argparse

    p = argparse.ArgumentParser()
    p.add_argument("--child")
    p.add_argument("--model", default=None)
    p.add_argument("--quantization", default=None)
    p.add_argument("--threads", type=int)
    p.add_argument("--max-tokens", type=int)
    p.add_argument("--max-num-seqs", type=int)
    a = p.parse_args(argv)
    from llmserve import LLM, SamplingParams

    prompts = json.load(open(a.child))
    llm = LLM(
        a.model,
        num_threads=a.threads,
        quantization=a.quantization,
        max_num_seqs=a.max_num_seqs,
        enable_prefix_caching=False,
        kv_cache_memory=2,
    )
    greedy = SamplingParams(max_tokens=a.max_tokens, temperature=0, ignore_eos=True)
    llm.generate(prompts[:1], greedy, use_tqdm=False)  # warm-up
    t = time.perf_counter()
    outs = llm.generate(prompts, greedy, use_tqdm=False)
    dt = time.perf_counter() - t
    toks = sum(len(o.outputs[0].token_ids) for o in outs)
    res = {"requests": len(prompts), "output_tokens": toks, "seconds": round(dt, 2), "tok_s": round(toks / dt, 1)}
    print("RESULT " + json.dumps(res), flush=True)


def run(args) -> None:
    rows = [
        "| model | weights | OpenVINO tok/s | llmserve tok/s | llmserve / OpenVINO | load |",
        "|---|---|---|---|---|---|",
    ]
    for model in args.models:
        folder = hf_folder() if model == "bundled" else os.path.expanduser(model)
        name = "bundled" if model == "bundled" else os.path.basename(folder.rstrip("/"))
        prompts = text_prompts(folder, args.prompts, args.prompt_len)
        with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
            json.dump(prompts, f)
        for fmt in args.modes.split(","):
            ov_dir = ov_export(folder, name, fmt)
            ov = ov_run(ov_dir, f.name, args)
            ours = llmserve_run(None if model == "bundled" else folder, QUANT[fmt], f.name, args)
            load = round(os.getloadavg()[0], 1)
            mode = f"--quantization {QUANT[fmt]}" if QUANT[fmt] else "defaults"
            rows.append(
                f"| {name} | OpenVINO {fmt} / llmserve {mode} | {ov['tok_s']} | {ours['tok_s']} "
                f"| {ours['tok_s'] / ov['tok_s']:.2f}x | {load} |"
            )
            print(rows[-1], flush=True)
        os.unlink(f.name)
    table = "\n".join(rows)
    print(table)
    if not args.no_write:
        body = (
            "`python -m benchmarks.peers.compare openvino "
            f"{' '.join(sys.argv[2:])}`: OpenVINO GenAI's ContinuousBatchingPipeline (`shared/peers/openvino.sh "
            f"bench`) against llmserve's `LLM.generate`, {args.prompts} prompts of {args.prompt_len} tokens, "
            f"{args.max_tokens} output tokens each (EOS ignored), at most {args.max_num_seqs} at once, greedy, "
            f"prefix caching off, {args.threads} threads.\n\n{table}\n"
        )
        write_section("Against OpenVINO GenAI, engine to engine (issue #32)", body)


if __name__ == "__main__":
    child(sys.argv[1:])
